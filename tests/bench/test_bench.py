"""hvd-compress bench (micro, e2e) and advise."""
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from hvd_compress.costmodel import model as cost_model
from hvd_compress.tools import advise as adv
from hvd_compress.tools.bench import micro
from hvd_compress.tools.bench.specs import parse_spec, payload_nbytes, split_specs

REPO = Path(__file__).resolve().parents[2]
MICRO_FIELDS = {"scheme": str, "framework": str, "device": str, "numel": int, "encode_decode_s": float,
                "copy_s": float, "ratio_to_copy": float, "payload_bytes": int, "dense_fp32_bytes": int}
E2E_FIELDS = ("scheme", "framework", "model_params", "workers", "link_mbit", "median_step_s", "speedup_vs_none",
              "speedup_vs_hvd_fp16", "payload_bytes_per_step", "wire_bytes_per_step")


# ----------------------------------------------------------------------------- specs
def test_specs_parse_and_split():
    assert split_specs("none, TopK(0.1, values=BF16()),Int8") == ["none", "TopK(0.1, values=BF16())", "Int8"]
    assert parse_spec("hvd_fp16") == "hvd_fp16"
    c = parse_spec("TopK(0.1, values=BF16())")
    assert c.scheme.ratio == 0.1 and type(c.scheme.values).__name__ == "BF16"
    assert payload_nbytes("none", 1000) == (4000, True)
    assert payload_nbytes("hvd_fp16", 1000) == (2000, True)
    with pytest.raises(ValueError, match="unknown scheme"):
        parse_spec("Nope(1)")
    with pytest.raises(ValueError, match="unsupported"):
        parse_spec("os.system('true')")
    with pytest.raises(ValueError):
        parse_spec("__import__('os')")
    # a tuple argument, e.g. Auto's exclude
    spec = "Auto(exclude=('TopK(0.1)', 'TopK(0.01)', 'FP16', 'Int8'))"
    assert split_specs("PowerSGD(4)," + spec) == ["PowerSGD(4)", spec]
    assert [c.label for c in parse_spec(spec).candidates if "/" not in c.label] == ["none", "PowerSGD(4)"]
    with pytest.raises(ValueError, match="unsupported"):
        parse_spec("TopK((os.system('true'),))")


# ----------------------------------------------------------------------------- micro
def test_micro_tiny_both_frameworks(tmp_path):
    out, png = tmp_path / "micro.json", tmp_path / "micro.png"
    rows = micro.run(schemes=["TopK(0.01)", "Int8"], frameworks=("torch", "tf"), sizes="4096", reps=2,
                     out_json=str(out), out_png=str(png), progress=False, stream=open(os.devnull, "w"))
    assert not rows.errors, rows.errors
    data = json.loads(out.read_text())
    assert len(data) == 4
    assert {(r["framework"], r["scheme"]) for r in data} == {
        (f, s) for f in ("torch", "tensorflow") for s in ("TopK(0.01)", "Int8")}
    for r in data:
        for k, t in MICRO_FIELDS.items():
            assert isinstance(r[k], t), (k, r[k])
        assert r["numel"] == 4096 and r["dense_fp32_bytes"] == 4 * 4096 and r["device"] == "cpu"
        assert r["encode_decode_s"] > 0 and r["copy_s"] > 0
        assert math.isclose(r["ratio_to_copy"], r["encode_decode_s"] / r["copy_s"])
        assert 0 < r["payload_bytes"] < r["dense_fp32_bytes"]
        assert r["threads"] == 1
    # Int8: one byte an element + a 4-byte scale + the 4-byte placeholder
    assert all(r["payload_bytes"] == 4096 + 8 for r in data if r["scheme"] == "Int8")
    assert png.stat().st_size > 1000


def test_micro_repeats_under_each_allocator(tmp_path):
    """Each allocator's worker really starts with its malloc settings: the
    worker's own environment is what the row reports."""
    rows = micro.run(schemes=["Int8"], frameworks=("torch",), sizes="4096", reps=2, progress=False,
                     allocators=("default", "no-mmap"), stream=open(os.devnull, "w"))
    assert not rows.errors, rows.errors
    assert [r["allocator"] for r in rows] == ["default", "no-mmap"]
    assert [r["malloc_env"] for r in rows] == [{}, micro.ALLOCATORS["no-mmap"]]


def test_micro_unknown_allocator_is_named():
    with pytest.raises(ValueError, match="allocators: unknown allocator 'jemalloc'"):
        micro.run(schemes=["Int8"], frameworks=("torch",), sizes="4096", progress=False, allocators=("jemalloc",))


def test_micro_bad_spec_fails_early():
    with pytest.raises(ValueError):
        micro.run(schemes=["NoSuchScheme(3)"], frameworks=("torch",), sizes="4096", progress=False)


# ----------------------------------------------------------------------------- advise
def test_worked_example_reproduced_and_corrected():
    w = adv.worked_example()
    # the back-of-envelope case's quoted numbers (advise.DOC_CASE): 440 -> 220 -> 22 MB, 35 / 18 / ~3 ms at 100 Gbit/s
    assert round(w["naive_mb"]["none"]) == 440
    assert round(w["naive_mb"]["fp16"]) == 220
    assert round(w["naive_mb"]["fp16_top10"]) == 22
    assert round(w["naive_ms"]["none"]) == 35 and round(w["naive_ms"]["fp16"]) == 18
    c = w["corrected"]
    # Top-10% of 16-bit values + int32 indices: 11M x (2 + 4) bytes = 66 MB, not 22
    assert round(c["top10_values_mb"]) == 22 and round(c["top10_index_mb"]) == 44
    assert round(c["top10_payload_mb"]) == 66
    # ring allreduce moves 2(N-1)/N of the payload; the sparse allgather (N-1) payloads
    assert round(c["none_wire_mb"]) == 770 and round(c["fp16_wire_mb"]) == 385
    assert round(c["top10_allgather_mb"]) == 7 * 66
    assert c["top10_allgather_mb"] > c["fp16_wire_mb"]
    # allgather traffic grows linearly with N; FP16 allreduce stays below 2x its payload
    g = {r["workers"]: r for r in w["growth"]}
    assert g[64]["top10_allgather_mb"] == pytest.approx(63 * 66, rel=1e-3)
    assert all(r["fp16_allreduce_mb"] < 440 for r in w["growth"])
    text = adv.format_worked_example(w)
    assert "66 MB per rank, not 22 MB" in text and "462 MB" in text


def _synthetic_micro():
    rows = []
    for n in (1_000_000, 16_000_000, 64_000_000):
        copy = n * 4 / 10e9
        for spec, enc_per, dec_per, frac in (("TopK(0.01)", 20e-9, 2e-9, 0.0127),
                                             ("Int8", 8e-9, 2e-9, 0.25), ("hvd_fp16", 1e-9, 1e-9, 0.5)):
            rows.append({"scheme": spec, "framework": "torch", "device": "cpu", "numel": n,
                         "encode_decode_s": (enc_per + dec_per) * n, "encode_s": enc_per * n,
                         "decode_s": dec_per * n, "copy_s": copy, "ratio_to_copy": (enc_per + dec_per) * n / copy,
                         "payload_bytes": int(frac * 4 * n), "dense_fp32_bytes": 4 * n})
    return rows


def test_advise_recommends_compression_on_a_slow_link_and_none_on_a_fast_one():
    ov = adv.Overhead(_synthetic_micro())
    layers = [("fc1.weight", 16_000_000), ("fc1.bias", 4000)]
    slow = adv.advise(layers, workers=2, bandwidth=adv.parse_bandwidth("100mbit"), overhead=ov)
    assert slow.per_layer[0]["choice"] == "TopK(0.01)"
    mid = adv.advise(layers, workers=2, bandwidth=adv.parse_bandwidth("10gbit"), overhead=ov)
    assert mid.per_layer[1]["choice"] == "none"  # a bias on a LAN: latency-bound, nothing to gain
    fast = adv.advise(layers, workers=2, bandwidth=adv.parse_bandwidth("100000gbit"), overhead=ov)
    assert [L["choice"] for L in fast.per_layer] == ["none", "none"]
    assert "does not pay" in fast.per_layer[0]["why"]
    assert "Compression does not pay for this model" in adv.format_advice(fast)


def test_advise_rows_and_their_savings_count_the_same_own_time():
    # BERT-large on 64 GPUs at 10 Gbit/s: PowerSGD's rounds are shared by the step's matrices, so charged to one
    # small matrix they exceed its dense time; each row and its saving count the tensor's own time only, and the
    # shared rounds are one line per step
    from hvd_compress.tools.projection import GPU_SCHEMES, MODELS, gpu_codec
    layers = MODELS["bert-large"].layers()
    a = adv.advise(layers, 64, adv.parse_bandwidth("10gbit"), schemes=GPU_SCHEMES, machine=cost_model.GPU_NCCL,
                   codec_of=gpu_codec)
    compressed = [L for L in a.per_layer if L["choice"] != "none"]
    assert any(L["predictions"][L["choice"]].cost.marginal_s > L["predictions"]["none"].cost.marginal_s
               for L in compressed)  # charged its rounds in full, a chosen tensor would look slower than none
    for L in a.per_layer:
        assert L["choice_s"] == L["predictions"][L["choice"]].cost.own_s
        assert L["none_s"] == L["predictions"]["none"].cost.own_s
    for L in compressed:
        assert L["choice_s"] < L["none_s"]
        assert f"saves {100 * (1 - L['choice_s'] / L['none_s']):.0f}% of this tensor's own time" == L["why"]
    # the rows plus the shared line make the step
    assert sum(L["choice_s"] for L in a.per_layer) + a.plan_shared_s == pytest.approx(a.plan_total_s)
    assert sum(L["none_s"] for L in a.per_layer) + a.none_shared_s == pytest.approx(a.none_total_s)
    assert a.plan_shared_s > 0
    text = adv.format_advice(a, max_layers=len(layers))
    assert text.count("Shared by the step's tensors, once per step") == 1
    assert f"{adv._ms(a.plan_shared_s)} with the plan" in text


def test_advise_overhead_interpolation_and_transports():
    ov = adv.Overhead(_synthetic_micro())
    e, d = ov.encode_decode("TopK(0.01)", 8_000_000)
    assert e == pytest.approx(20e-9 * 8e6) and d == pytest.approx(2e-9 * 8e6)
    p = adv.predict("TopK(0.01)", 16_000_000, 4, 1e9, 0.0, ov)
    assert p.transport == "allgather" and p.wire_bytes == pytest.approx(3 * p.payload_bytes)
    assert p.decode_s == pytest.approx(4 * 2e-9 * 16e6)  # every rank's payload is decoded
    q = adv.predict("none", 16_000_000, 4, 1e9, 0.0, ov)
    assert q.wire_bytes == pytest.approx(2 * 3 / 4 * 64e6) and q.overhead_s == 0


def test_advise_validate_reports_error(tmp_path):
    ov = adv.Overhead(_synthetic_micro())
    e2e_rows = [{"scheme": s, "framework": "torch", "model_params": 16_000_000, "layer_numels": [16_000_000],
                 "workers": 2, "link_mbit": 100.0, "link_measured_mbit": 95.0, "median_step_s": t + 0.1,
                 "compute_s": 0.1, "comm_s_measured": t, "payload_bytes_per_step": pb,
                 "wire_bytes_per_step": pb * 1.05}
                for s, t, pb in (("none", 5.5, 64e6), ("TopK(0.01)", 0.5, 0.8e6))]
    v = adv.validate(e2e_rows, ov, latency=0.0, machine=cost_model.Machine(entry_s=0.0))
    assert [r["scheme"] for r in v] == ["none", "TopK(0.01)"]
    none = v[0]
    assert none["predicted_s"] == pytest.approx(64e6 / (95e6 / 8))
    # the machine's collective cost: per byte received (2 (N-1)/N x 64 MB at N = 2), and one cycle a step
    gloo = adv.validate(e2e_rows, ov, latency=0.0,
                        machine=cost_model.Machine(reduce_s_per_byte=1e-9, cycle_s=1e-3, entry_s=0.0))
    assert gloo[0]["predicted_s"] == pytest.approx(64e6 / (95e6 / 8) + 64e6 * 1e-9 + 1e-3)
    assert none["error"] == pytest.approx((none["predicted_s"] - 5.5) / 5.5)
    text = adv.format_validation(v)
    assert "| 100 Mbit/s (95 measured) | none |" in text and "mean absolute error" in text


def test_advise_cli(tmp_path):
    from hvd_compress.tools.cli import main
    mp = tmp_path / "micro.json"
    mp.write_text(json.dumps(_synthetic_micro()))
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps({"emb": [30522, 768], "fc": 4096}))
    out = tmp_path / "advice.md"
    assert main(["advise", "--layers", str(layers), "--workers", "4", "--bandwidth", "1gbit", "--micro", str(mp),
                 "--worked-example", "--out", str(out)]) == 0
    text = out.read_text()
    assert "66 MB per rank" in text and "| emb |" in text
    e2e = tmp_path / "e2e.json"
    e2e.write_text(json.dumps([{"scheme": "none", "framework": "torch", "model_params": 1000, "workers": 2,
                                "link_mbit": 100.0, "median_step_s": 1.0, "compute_s": 0.5,
                                "comm_s_measured": 0.5, "payload_bytes_per_step": 4000}]))
    val = tmp_path / "val.md"
    assert main(["advise", "--validate", str(e2e), "--micro", str(mp), "--out", str(val)]) == 0
    assert "predicted vs measured" in val.read_text()


# ----------------------------------------------------------------------------- e2e
def _cluster_usable():
    try:
        from hvd_compress.tools.testing import cluster  # noqa: F401
    except ImportError:
        return "hvd_compress.tools.testing.cluster does not exist"
    if os.geteuid() != 0:
        return "bench e2e needs root (network namespaces)"
    for tool in ("ip", "sshd", "tc"):
        if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
            return f"{tool} not found"
    return None


def cluster_or_skip(prefix):
    """The cluster module, with a crashed run's leftovers of ``prefix`` (the test's own) cleared;
    skips where the emulated cluster cannot run."""
    why = _cluster_usable()
    if why:
        pytest.skip(why)
    from hvd_compress.tools.testing import cluster
    cluster.teardown(prefix)
    return cluster


def test_e2e_smoke_two_hosts(tmp_path):
    from hvd_compress.tools.bench import e2e
    cluster = cluster_or_skip("hvdcbt")
    out = tmp_path / "e2e.json"
    rows = e2e.run(params="200k", hosts=2, rates="none", schemes=["none", "TopK(0.01)"], steps=3, warmup=1,
                   max_seconds=5, out_json=str(out), out_png=str(tmp_path / "e2e.png"), prefix="hvdcbt",
                   measure_link=False, run_timeout=150, progress=False, stream=open(os.devnull, "w"))
    assert not rows.failures, rows.failures
    data = json.loads(out.read_text())
    assert [r["scheme"] for r in data] == ["none", "TopK(0.01)"]
    for r in data:
        for k in E2E_FIELDS:
            assert k in r, k
        assert r["workers"] == 2 and r["hosts"] == 2 and r["link_mbit"] is None
        assert r["median_step_s"] > 0 and r["wire_bytes_per_step"] > 0
        assert 150_000 < r["model_params"] < 250_000
    none, topk = data
    assert none["speedup_vs_none"] == pytest.approx(1.0)
    assert none["payload_bytes_per_step"] == pytest.approx(4 * none["model_params"])
    # dense allreduce with 2 ranks: each host sends about one payload (+ TCP/IP headers)
    assert 0.95 < none["wire_bytes_per_step"] / none["payload_bytes_per_step"] < 1.5
    assert topk["payload_bytes_per_step"] < 0.05 * none["payload_bytes_per_step"]
    assert (tmp_path / "e2e.png").exists() and (tmp_path / "e2e_wire.png").exists()
    assert "hvdcbt" not in cluster.existing_clusters()


def test_models_smoke_two_hosts(tmp_path):
    """``bench models`` end to end on a tiny GPT-2-like decoder: one launch runs
    ``none``, Horovod's fp16 and Auto, each from the same weights, in two
    rounds of timed steps, each with its row of the fields
    docs/results/models.json promises; Auto's plan and start-up."""
    why = _cluster_usable()
    if why:
        pytest.skip(why)
    from hvd_compress.tools.bench import models_bench
    from hvd_compress.tools.testing import cluster
    cluster.teardown("hvdcmt")  # this test's own prefix: clear a crashed run's leftovers
    out = tmp_path / "models.json"
    rows, failures = models_bench.run(models="gpt2", frameworks="torch", workers="2", rates="none",
                                      schemes="none,hvd_fp16,Auto()", size="tiny", steps=2, rounds=2, warmup=1,
                                      prefix="hvdcmt", out_json=str(out), run_timeout=100, progress=False,
                                      stream=open(os.devnull, "w"), extra_env={"HVDC_PAIR_SWAP_MIN_BYTES": "1048576"})
    assert not failures, failures
    data = json.loads(out.read_text())
    assert [r["scheme"] for r in data] == ["none", "hvd_fp16", "Auto()"]
    for r in data:
        assert {"model", "framework", "workers", "link_mbit", "scheme", "median_step_s", "first_step_s",
                "startup_s", "plan", "launch_s", "scheme_s", "loadavg_1m_before", "loadavg_1m_after",
                "vs_best_fixed"} <= set(r)
        assert (r["model"], r["framework"], r["workers"], r["link_mbit"]) == ("gpt2", "torch", 2, None)
        assert r["pinned_cores"] is True  # each rank bound to a core, by default
        # extra_env reached the ranks (the launcher may add HVDC_* variables of its own)
        assert r["hvdc_env"].get("HVDC_PAIR_SWAP_MIN_BYTES") == "1048576"
        assert r["median_step_s"] > 0 and r["startup_s"] >= 0 and r["tensors"] == 28
        assert r["rounds"] == 2 and len(r["round_median_step_s"]) == 2
        assert len(r["step_s_all"]) == r["untimed_steps"] + 4
        assert 0 < r["scheme_s"] < r["launch_s"] == data[0]["launch_s"]  # one launch, shared
        assert r["initial_weights_sum"] == data[0]["initial_weights_sum"]  # every scheme from the same weights
    assert sum(r["scheme_s"] for r in data) < data[0]["launch_s"]
    none, fp16, auto = data
    assert none["plan"] is None and fp16["plan"] is None and sum(auto["plan"].values()) == 28
    best = min(none["median_step_s"], fp16["median_step_s"]) / auto["median_step_s"]
    assert auto["vs_best_candidate"] == pytest.approx(best) and "vs_best_candidate" not in none
    states = json.loads(open(models_bench.auto_state_path(str(out))).read())
    assert list(states) == [models_bench.row_key(auto)] and len(states[models_bench.row_key(auto)]["plan"]) == 28
    parts = auto["auto_startup"]
    # the trial plans' steps (where more than one plan was predicted close) count before the final plan
    assert parts["calibration_steps"] == 3 and parts["probe_s"] > 0 and parts["trial_plans_run"] != 1
    assert parts["early_link"]["bytes_per_s"] > 0 and parts["link"]["bytes_per_s"] > 0
    assert parts["steps_before_final_plan"] == 3 + 4 * parts["trial_plans_run"]
    ran = [t for t in parts["trials"] if not t["before"]]
    assert len(ran) == parts["trial_plans_run"] and sum(t["picked"] for t in parts["trials"]) == (1 if ran else 0)
    assert all(sum(t["plan"].values()) == 28 for t in parts["trials"])
    assert models_bench.merged(str(out), data[:1]) == data[1:] + data[:1]  # a rerun replaces its own rows
    assert "hvdcmt" not in cluster.existing_clusters()


def test_models_env_takes_name_equals_value():
    from hvd_compress.tools.bench.models_bench import parse_env
    assert parse_env(["HVDC_PAIR_SWAP_MIN_BYTES=1048576", "A_B="]) == {"HVDC_PAIR_SWAP_MIN_BYTES": "1048576",
                                                                      "A_B": ""}
    for bad in ("HVDC_PAIR_SWAP_MIN_BYTES", "=1", "1A=2", "A B=1"):
        with pytest.raises(ValueError, match="--env takes NAME=VALUE"):
            parse_env([bad])


def test_models_compares_auto_with_the_fixed_schemes_it_may_choose():
    from hvd_compress.tools.bench.models_bench import auto_may_choose
    fixed = ["none", "hvd_fp16", "TopK(0.01)", "PowerSGD(4)", "Int8", "EFSignSGD", "Auto()"]
    assert [auto_may_choose("Auto()", f) for f in fixed] == [True] * 5 + [False, False]
    assert [auto_may_choose("Auto(include_sign=True)", f) for f in fixed] == [True] * 6 + [False]
    assert not auto_may_choose("Auto(powersgd_rank=None)", "PowerSGD(4)")


def test_models_architectures_match_their_published_sizes():
    """The PyTorch ResNet-50 and MobileNetV2 have torchvision's parameter
    counts; the tiny ones keep the tensors' kinds at a fraction of the size."""
    torch = pytest.importorskip("torch")
    from hvd_compress.tools.bench.architectures import torch_model
    counts = {a: sum(p.numel() for p in torch_model(a, "full")[0].parameters()) for a in ("resnet50", "mobilenetv2")}
    assert counts == {"resnet50": 25_557_032, "mobilenetv2": 3_504_872}
    model, batch, loss = torch_model("bert", "tiny")
    x, y = batch(2)
    assert torch.isfinite(loss(model(x), y))
    with pytest.raises(ValueError, match="model must be one of"):
        torch_model("vgg", "tiny")


def test_models_replay_predicts_each_fixed_scheme_from_autos_own_measurements():
    """The replay rebuilds Auto's planner inputs from its saved state: on a slow
    link the predicted communication of Top-K and Int8 is below ``none``'s,
    Auto's adopted plan is predicted as its own choices, and schemes Auto
    cannot choose are left out."""
    from dataclasses import asdict
    from hvd_compress.costmodel.model import LINK_ONLY
    from hvd_compress.tools.bench.models_replay import candidate_label, format_replay, replay
    from hvd_compress.tools.bench.specs import parse_spec
    labels = [c.label for c in parse_spec("Auto()").candidates]
    cost = {"none": 0.0, "Int8": 1e-3, "TopK(0.01)": 2e-3}
    state = {"candidates": labels, "tensors": {"w": [1 << 20, [1024, 1024]], "b": [1024, [1024]]},
             "codec_s": {"w": [cost.get(x) for x in labels], "b": [0.0] + [None] * (len(labels) - 1)},
             "link": [1e-4, 12.5e6], "backward_s": 0.0, "step_s": 1.0, "machine": asdict(LINK_ONLY),
             "min_gain": 0.1, "plan": {"w": "TopK(0.01)", "b": "none"}}
    auto = {"scheme": "Auto()", "workers": 2, "median_step_s": 0.5, "auto_state": state}
    fixed = [{"scheme": s, "median_step_s": t} for s, t in
             (("none", 1.0), ("TopK(0.01)", 0.5), ("Int8", 0.6), ("EFSignSGD", 0.4))]
    rows = {r["plan"]: r for r in replay(auto, fixed)}
    assert set(rows) == {"Auto", "none", "TopK(0.01)", "Int8"}  # EFSignSGD: not one of Auto()'s candidates
    assert rows["Auto"]["predicted_comm_s"] == pytest.approx(rows["TopK(0.01)"]["predicted_comm_s"])
    assert rows["TopK(0.01)"]["predicted_comm_s"] < rows["Int8"]["predicted_comm_s"] < rows["none"]["predicted_comm_s"]
    assert "measured - none" in format_replay(list(rows.values()))
    assert candidate_label("hvd_fp16", ["none", "FP16"]) == "FP16" and candidate_label("EFSignSGD", ["none"]) is None
    with pytest.raises(ValueError, match="candidates"):
        replay({**auto, "scheme": "Auto(include_sign=True)"}, fixed)
