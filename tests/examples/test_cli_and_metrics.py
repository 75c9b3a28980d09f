"""Fast checks without horovodrun: the examples' --compression flags map to the
right compressors, and hvd_compress.tools.metrics computes and writes what it says."""
import argparse
import csv
import math
import os
import sys

import pytest
import torch

from hvdc_examples_util import REPO

sys.path.insert(0, os.path.join(REPO, "examples"))

import _common  # noqa: E402
import hvd_compress  # noqa: E402
from hvd_compress.tools.metrics import CompressionMeter, TorchCompressionLogger, format_bytes  # noqa: E402


class _Compression:  # stands in for horovod.<framework>.Compression
    class none:
        pass

    class fp16:
        pass


class _Hvd:
    Compression = _Compression


def _parse(*argv):
    p = _common.add_compression_args(argparse.ArgumentParser())
    return p.parse_args(list(argv))


def test_every_public_scheme_has_a_cli_name():
    names = set(_common.scheme_factories())
    for expected in ("fp16", "bf16", "int8", "qsgd", "terngrad", "signsgd", "efsignsgd", "onebit", "topk",
                     "randomk", "threshold", "dgc", "nocompression"):
        assert expected in names
    # every scheme of the package that has a public factory is reachable
    schemes = {n.lower() for n in hvd_compress.schemes.__all__ if n not in ("Scheme", "EncodeContext")
               and n in hvd_compress.__all__}
    assert schemes <= names


@pytest.mark.parametrize("name", sorted(_common.scheme_factories()))
@pytest.mark.parametrize("ef", [None, True, False])
def test_each_scheme_builds_with_and_without_error_feedback(name, ef):
    flags = ["--compression", name] + {None: [], True: ["--error-feedback"], False: ["--no-error-feedback"]}[ef]
    comp, describe = _common.make_compression(_parse(*flags), _Hvd)
    assert isinstance(comp, hvd_compress.Compressor)
    assert comp.scheme.name.lower() == name
    if ef is not None:
        assert comp.error_feedback is ef
    assert "hvd_compress" in describe


def test_scheme_options_reach_the_scheme():
    comp, _ = _common.make_compression(_parse("--compression", "topk", "--ratio", "0.05"), _Hvd)
    assert comp.scheme.ratio == 0.05 and comp.error_feedback is True
    comp, _ = _common.make_compression(_parse("--compression", "qsgd", "--levels", "4"), _Hvd)
    assert comp.scheme.levels == 4
    comp, _ = _common.make_compression(_parse("--compression", "int8", "--block-size", "256"), _Hvd)
    assert comp.scheme.block_size == 256
    comp, _ = _common.make_compression(_parse("--compression", "dgc", "--ratio", "0.01", "--values", "int8"), _Hvd)
    assert comp.scheme.values.name == "Int8"
    comp, _ = _common.make_compression(_parse("--compression", "topk", "--no-error-feedback"), _Hvd)
    assert comp.error_feedback is False
    # options only the factory takes get scheme-prefixed flags (DGC's momentum correction)
    comp, _ = _common.make_compression(_parse("--compression", "dgc", "--dgc-momentum", "0.9"), _Hvd)
    assert comp.memory is not None
    with pytest.raises(SystemExit, match="applies to --compression dgc only"):
        _common.make_compression(_parse("--compression", "topk", "--dgc-momentum", "0.9"), _Hvd)


def test_horovod_builtins_and_bad_options():
    comp, describe = _common.make_compression(_parse("--compression", "hvd-fp16"), _Hvd)
    assert comp is _Compression.fp16 and "Horovod" in describe
    comp, _ = _common.make_compression(_parse("--fp16-allreduce"), _Hvd)  # Horovod's benchmark flag
    assert comp is _Compression.fp16
    comp, _ = _common.make_compression(_parse(), _Hvd)
    assert comp is _Compression.none
    with pytest.raises(SystemExit, match="does not take --levels"):
        _common.make_compression(_parse("--compression", "topk", "--levels", "4"), _Hvd)
    with pytest.raises(SystemExit, match="takes no scheme options"):
        _common.make_compression(_parse("--compression", "none", "--ratio", "0.1"), _Hvd)
    with pytest.raises(SystemExit, match="no error feedback"):
        _common.make_compression(_parse("--compression", "hvd-fp16", "--error-feedback"), _Hvd)
    with pytest.raises(SystemExit):
        _parse("--compression", "nonsense")


def test_meter_sums_steps_and_formats():
    comp = hvd_compress.TopK(0.01)
    meter = CompressionMeter(comp)
    comp.stats.record("w", "TopK", 4000, 100)
    comp.stats.record("b", "TopK", 40, 12)
    for _ in range(3):
        step = meter.step()
    assert step["bytes_sent"] == 112 and step["bytes_dense_fp32"] == 4040
    s = meter.epoch_summary()
    assert s["steps"] == 3 and s["bytes_sent"] == 336 and s["bytes_dense_fp32"] == 12120
    assert math.isclose(s["compression_ratio"], 4040 / 112)
    line = CompressionMeter.format(s)
    assert "sent 336 B vs dense 12.12 KB (36.1x smaller, 97.2% saved)" in line
    meter.reset_epoch()
    assert meter.epoch_summary()["steps"] == 0


def test_meter_for_horovod_builtin_counts_elements():
    meter = CompressionMeter(_Compression.fp16, dense_fp32_bytes=4000)
    meter.step()
    s = meter.epoch_summary()
    assert s["bytes_sent"] == 2000 and s["compression_ratio"] == 2.0 and s["residual_norm"] == 0.0
    meter = CompressionMeter(_Compression.none, dense_fp32_bytes=4000)
    meter.step()
    assert meter.epoch_summary()["compression_ratio"] == 1.0


def test_residual_norm_reads_the_adapters_residuals():
    comp = hvd_compress.TopK(0.01)
    adapter = comp.adapter_for("torch")
    adapter.residuals["a"] = torch.tensor([3.0, 0.0])
    adapter.residuals["b"] = torch.tensor([4.0])
    assert math.isclose(CompressionMeter(comp).residual_norm(), 5.0)


def test_torch_logger_writes_csv_without_tensorboard(tmp_path, monkeypatch):
    import hvd_compress.tools.metrics as m
    monkeypatch.setattr(m, "tensorboard_available", lambda: False)
    comp = hvd_compress.Int8()
    model = torch.nn.Linear(10, 2)  # 22 parameters
    logger = TorchCompressionLogger(comp, model=model, logdir=str(tmp_path), every_n_steps=2)
    assert logger.sink.kind == "csv"
    comp.stats.record("weight", "Int8", 80, 24)
    for _ in range(4):
        logger.step()
    summary = logger.end_epoch(1)
    logger.close()
    rows = list(csv.DictReader(open(tmp_path / "compression_metrics.csv")))
    assert [r["kind"] for r in rows] == ["step", "step", "epoch"]
    assert float(rows[-1]["bytes_sent"]) == 96 and summary["steps"] == 4
    assert "compress_ms_per_step" in summary  # codec timing wrapper installed


def test_stdout_sink(capsys):
    comp = hvd_compress.FP16()
    logger = TorchCompressionLogger(comp, sink="stdout", time_codec=False)
    comp.stats.record("w", "FP16", 400, 200)
    logger.step()
    logger.end_epoch(3)
    assert "[compression/epoch 3]" in capsys.readouterr().out


def test_format_bytes():
    assert format_bytes(999) == "999 B"
    assert format_bytes(1500) == "1.50 KB"
    assert format_bytes(2.5e9) == "2.50 GB"


def _phases(comp, name, numel):
    return [(start, type(scheme).__name__, memory) for start, scheme, memory, _ in comp.plan_for(name, numel, (numel,))]


def test_dense_below_and_warmup_wrap_the_scheme_in_a_policy_and_a_schedule():
    comp, describe = _common.make_compression(
        _parse("--compression", "topk", "--ratio", "0.05", "--dense-below", "1024", "--warmup-steps", "50"), _Hvd)
    assert isinstance(comp, hvd_compress.Policy) and "Policy" in type(comp).__name__
    small = _phases(comp, "fc.bias", 1024)
    assert [(s, n) for s, n, _ in small] == [(0, "NoCompression")]
    big = _phases(comp, "fc.weight", 1025)
    assert [(s, n) for s, n, _ in big] == [(0, "NoCompression"), (50, "TopK")]
    assert comp.plan_for("fc.weight", 1025, (1025,))[-1][1].ratio == 0.05
    # only one of the two
    comp, _ = _common.make_compression(_parse("--compression", "int8", "--warmup-steps", "3"), _Hvd)
    assert isinstance(comp.default, hvd_compress.Schedule) and comp.rules == []
    assert [(s, n) for s, n, _ in _phases(comp, "w", 10)] == [(0, "NoCompression"), (3, "Int8")]
    comp, _ = _common.make_compression(_parse("--compression", "int8"), _Hvd)
    assert not isinstance(comp, (hvd_compress.Policy, hvd_compress.Schedule))


def test_dense_names_send_the_named_tensors_dense():
    comp, _ = _common.make_compression(_parse("--compression", "topk", "--compression-momentum", "0.9",
                                              "--dense-names", "*embed*, pos", "--warmup-steps", "5"), _Hvd)
    for name in ("embed.weight", "pos"):
        assert [(s, n) for s, n, _ in _phases(comp, name, 1792)] == [(0, "NoCompression")]
    assert [(s, n) for s, n, _ in _phases(comp, "encoder.linear1.weight", 1792)] == [(0, "NoCompression"), (5, "TopK")]
    assert _phases(comp, "pos", 1792)[0][2].momentum == 0.9


def test_dense_parts_of_a_recipe_carry_the_compressors_momentum():
    # momentum in the compressor: the optimizer has none, so the dense tensors and the
    # dense warmup must apply it themselves
    comp, _ = _common.make_compression(_parse("--compression", "efsignsgd", "--compression-momentum", "0.9",
                                              "--dense-below", "100", "--warmup-steps", "5"), _Hvd)
    for name, numel in (("b", 100), ("w", 101)):
        memories = [m for _, _, m in _phases(comp, name, numel)]
        assert all(isinstance(m, hvd_compress.MomentumMemory) and m.momentum == 0.9 for m in memories), memories
    comp, _ = _common.make_compression(_parse("--compression", "topk", "--dense-below", "100"), _Hvd)
    assert not isinstance(_phases(comp, "b", 10)[0][2], hvd_compress.MomentumMemory)


@pytest.mark.parametrize("argv, message", [
    (("none", "--dense-below", "10"), "--dense-below, --dense-names, --warmup-steps and --ramp-steps need an hvd_compress"),
    (("hvd-fp16", "--dense-names", "*embed*"), "--warmup-steps and --ramp-steps need an hvd_compress"),
    (("none", "--ramp-steps", "5"), "--ramp-steps need an hvd_compress"),
    (("topk", "--dense-names", " , "), "--dense-names takes comma-separated globs"),
    (("topk", "--warmup-steps", "-1"), "--warmup-steps takes a non-negative"),
    (("topk", "--ramp-steps", "-1"), "--ramp-steps takes a non-negative"),
    (("int8", "--ramp-steps", "5"), "--ramp-steps: ramp_steps ramps a sparsifier's ratio: it needs TopK"),
])
def test_recipe_flags_refuse_horovod_builtins_and_bad_values(argv, message):
    with pytest.raises(SystemExit, match=message):
        _common.make_compression(_parse("--compression", *argv), _Hvd)


def test_ramp_steps_flag_builds_dgcs_phases():
    comp, _ = _common.make_compression(_parse("--compression", "dgc", "--warmup-steps", "4", "--ramp-steps", "2"), _Hvd)
    assert [p.start for p in comp.plan_for("w", 10**4, (10**4,))] == [0, 4, 6, 8, 10, 12]


def test_auto_takes_only_the_compressors_momentum():
    comp, describe = _common.make_compression(_parse("--compression", "auto", "--compression-momentum", "0.9"), _Hvd)
    assert isinstance(comp, hvd_compress.Auto) and comp.memory.momentum == 0.9 and "momentum=0.9" in describe
    comp, describe = _common.make_compression(_parse("--compression", "auto"), _Hvd)
    assert isinstance(comp.memory, hvd_compress.ResidualMemory) and describe == "hvd_compress Auto()"
    for extra in (["--ratio", "0.1"], ["--dense-below", "10"], ["--warmup-steps", "5"], ["--no-error-feedback"],
                  ["--dense-names", "*embed*"]):
        with pytest.raises(SystemExit, match="auto takes no scheme options"):
            _common.make_compression(_parse("--compression", "auto", *extra), _Hvd)


def test_learning_rate_warms_up_from_the_single_rank_rate_then_follows_the_cosine():
    kw = dict(peak=0.08, total_steps=100, warmup_steps=10, size=4, cosine=False)
    assert _common.learning_rate(0, **kw) == pytest.approx(0.02)       # Goyal et al.: start at peak / size
    assert _common.learning_rate(5, **kw) == pytest.approx(0.05)       # linear: 0.02 + 0.06 * 5/10
    assert _common.learning_rate(10, **kw) == _common.learning_rate(60, **kw) == pytest.approx(0.08)
    kw.update(cosine=True)
    assert _common.learning_rate(50, **kw) == pytest.approx(0.04)      # half way down the cosine
    assert _common.learning_rate(0, **dict(kw, warmup_steps=0)) == pytest.approx(0.08)
    p = _common.add_schedule_args(argparse.ArgumentParser())
    assert p.parse_args(["--lr-warmup-epochs", "1.5"]).lr_warmup_epochs == 1.5
