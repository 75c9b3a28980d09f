"""scripts/gpu_check.sh / hvd_compress.tools.bench.gpu_check in its CPU-fallback
form, which is what CI can run; plus checks that its comparisons have teeth, and
a dry run of the CUDA sync check's control flow with the debug mode emulated on
the CPU.  The real CUDA sync check runs here only where CUDA is present."""
from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from hvd_compress import schemes as S
from hvd_compress.tools.bench import gpu_check as gc

REPO = Path(__file__).resolve().parents[2]
MICRO_FIELDS = {"scheme": str, "framework": str, "device": str, "numel": int, "encode_decode_s": float,
                "copy_s": float, "ratio_to_copy": float, "payload_bytes": int, "dense_fp32_bytes": int}
ENV = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


def test_cpu_fallback_end_to_end(tmp_path):
    """All three parts at the quick sizes, in this process (the micro part in
    bench micro's own worker process)."""
    rc = gc.main(["--cpu-fallback", "--quick", "--out", str(tmp_path), "--schemes", "Int8,TopK(0.01)",
                  "--reps", "1"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0 and report["ok"], report["failures"]
    assert report["environment"]["mode"] == "cpu-fallback"
    assert report["under_test"].startswith("torch:cpu[") and report["reference"] == "torch:cpu[1 thread]"
    # 1. every case compared (Lossless only where zstandard is installed), none failed
    same = report["same_draws"]
    assert {r["case"] for r in same} == {c for c, _, _ in gc.cases()}
    assert all(r["status"] in ("ok", "skipped") for r in same), [r for r in same if r["status"] != "ok"]
    assert all(r["status"] == "ok" for r in report["own_generators"])
    assert report["tensorflow"]["status"] == "skipped"
    # 2. host reads: only where documented (variable-size payloads' lengths, the host codec)
    rows = report["sync"]["rows"]
    assert report["sync"]["unexpected"] == []
    by = {(r["case"], r["level"]): r for r in rows}
    assert by[("topk1%", "compressor")]["status"] == "no host read"
    assert by[("threshold", "compressor")]["status"] == "HOST READ"
    assert any("split" in s for s in by[("threshold", "compressor")]["all_syncs"])
    # 3. bench micro's JSON format, on the CPU, under its fallback name only
    assert not (tmp_path / "micro_cuda.json").exists()
    micro = json.loads((tmp_path / "micro_cpu_fallback.json").read_text())
    assert {r["scheme"] for r in micro} == {"Int8", "TopK(0.01)"}
    for r in micro:
        for k, t in MICRO_FIELDS.items():
            assert isinstance(r[k], t), (k, r[k])
        assert r["device"] == "cpu" and r["numel"] == 16384
    assert {t["scheme"] for t in report["targets"]["rows"]} == {"Int8", "TopK(0.01)"}
    log = (tmp_path / "gpu_check.log").read_text()
    assert "CPU FALLBACK" in log and "[3] bench micro" in log


def test_shell_script(tmp_path):
    """The wrapper runs with nothing but the repository on PYTHONPATH."""
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--cpu-fallback", "--quick", "--parts",
                        "correctness", "--cases", "int8,topk1%", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, env=ENV, cwd="/")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "CPU FALLBACK" in r.stdout and "OK in" in r.stdout
    assert (tmp_path / "gpu_check.log").read_text().count("bit-identical") == 2


# --- the comparisons have teeth -------------------------------------------------------------------
def test_compare_rules():
    a = np.linspace(-1, 1, 1000, dtype=np.float32)
    b = a.copy()
    b[17] = np.nextafter(b[17], np.float32(2))
    assert gc.compare(a, a.copy(), "exact", a.size)[0]
    assert not gc.compare(a, b, "exact", a.size)[0]
    assert not gc.compare(a, a.astype(np.float64), "exact", a.size)[0]
    assert gc.compare(a, b, "close", a.size)[0]
    c = a.copy()
    c[:10] += 0.5
    assert not gc.compare(a, c, "close", a.size)[0]
    assert gc.compare(a, a * (1 + 1e-6), "lowrank", a.size)[0]
    assert not gc.compare(a, a * 1.01, "lowrank", a.size)[0]
    x = gc.tie_free(50_000, 0)
    assert np.unique(np.abs(x)).size == x.size


def test_same_draws_detects_a_wrong_kernel():
    ref = gc.TorchSide("cpu", threads=1)
    assert all(r["status"] == "ok" for r in gc.check_same_draws(ref, gc.TorchSide("cpu"), [(33, 31)],
                                                                only={"int8", "dgc"}, log=lambda m: None))
    bad = gc.TorchSide("cpu", threads=1)
    bad.B.round_clip = lambda x, lo, hi: torch.clamp(torch.round(x), lo, hi - 1)  # the largest loses a level
    res = gc.check_same_draws(ref, bad, [(33, 31)], only={"int8"}, log=lambda m: None)
    assert res[0]["status"] == "FAILED" and "differ" in res[0]["detail"][0]
    bad2 = gc.TorchSide("cpu", threads=1)
    bad2.B.topk_indices = lambda x, k: torch.topk(x, k + 1, sorted=True).indices[1:]  # off by one
    res = gc.check_same_draws(ref, bad2, [(33, 31)], only={"topk1%"}, log=lambda m: None)
    assert res[0]["status"] == "FAILED"


def test_distribution_check_detects_a_biased_generator():
    ref = gc.TorchSide("cpu", controlled=False)
    ok = gc.check_quantizer_distribution(ref, gc.TorchSide("cpu", controlled=False), S.QSGD(4), 2048, 16)
    assert all(v[0] for v in ok.values()), ok
    skewed = gc.TorchSide("cpu", controlled=False)
    orig = skewed.B.uniform
    skewed.B.uniform = lambda n, seed, like: orig(n, seed, like) ** 1.5  # not U[0,1)
    bad = gc.check_quantizer_distribution(ref, skewed, S.QSGD(4), 2048, 16)
    assert not all(v[0] for v in bad.values())
    assert not all(v[0] for v in gc.check_uniform(skewed, 1 << 16).values())


def test_targets():
    assert gc.target_of("TopK(0.01)") == ("topk_dgc", 8.0)
    assert gc.target_of("DGC(0.01)") == ("topk_dgc", 8.0)
    assert gc.target_of("QSGD(error_feedback=True)") == ("quantizer", 4.0)
    assert gc.target_of("Int8") == ("quantizer", 4.0)
    assert gc.target_of("RandomK(0.01)") == (None, None)
    assert gc.target_of("hvd_fp16") == (None, None)
    rows = [{"scheme": "TopK(0.01)", "numel": gc.TARGET_NUMEL, "ratio_to_copy": 9.0},
            {"scheme": "Int8", "numel": gc.TARGET_NUMEL, "ratio_to_copy": 3.0},
            {"scheme": "Int8", "numel": 16_000_000, "ratio_to_copy": 30.0}]
    assert [(j["scheme"], j["met"]) for j in gc.judge_targets(rows)] == [("TopK(0.01)", False), ("Int8", True)]
    from hvd_compress.tools.bench.specs import parse_spec
    specs = gc.micro_specs()
    assert "hvd_fp16" not in specs and "QSGD(error_feedback=True)" in specs
    for s in specs:
        parse_spec(s)
    sync = gc.sync_specs()
    assert set(sync) == {c for c, _, _ in gc.cases()}
    for cid, factory, how in gc.cases():  # the compressor-level spec builds the same scheme as the case
        assert repr(parse_spec(sync[cid]).scheme) == repr(factory()), cid
    rules = {cid: how for cid, _, how in gc.cases()}
    assert rules["topk-qsgd"] == "topk-reducing" and rules["dgc-qsgd"] == "reducing"
    assert rules["dgc-int8"] == "exact" and rules["qsgd4"] == "reducing" and rules["powersgd"] == "lowrank"


# --- the CUDA sync check's control flow, with the debug mode emulated ------------------------------------
def _emulate_sync_debug_mode(monkeypatch):
    """torch.cuda's sync debug mode on the CPU: a host read (.tolist/.cpu/.item)
    raises in 'error' mode and warns in 'warn' mode, as torch does for a sync."""
    mode = {"m": 0}
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["m"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.update(m={"error": 2, "warn": 1}.get(m, m)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    for name in ("tolist", "cpu", "item"):
        orig = getattr(torch.Tensor, name)

        def emulated(self, *a, _orig=orig, **k):
            if mode["m"] == 2:
                raise RuntimeError("called a synchronizing CUDA operation")
            if mode["m"] == 1:
                warnings.warn("called a synchronizing CUDA operation", UserWarning)
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, emulated)


def test_sync_check_flow_emulated(monkeypatch):
    """check_sync_cuda's control flow on the CPU, with the debug mode emulated."""
    _emulate_sync_debug_mode(monkeypatch)
    rows = gc.check_sync_cuda((16, 256), only={"int8", "threshold", "lossless"}, log=lambda m: None,
                              device="cpu")
    by = {(r["case"], r["level"]): r for r in rows}
    assert by[("int8", "scheme")]["status"] == "no sync"
    assert by[("int8", "compressor")]["status"] == "no sync"
    thr = by[("threshold", "compressor")]
    assert thr["status"] == "SYNC" and thr["expected"]
    assert any("backend.py" in f and "split" in f for f in thr["first_at"])
    assert any("split" in s for s in thr["all_syncs"])
    if gc._has("zstandard"):
        assert by[("lossless", "scheme")]["status"] == "SYNC"
        assert any("host_call" in s for s in by[("lossless", "scheme")]["all_syncs"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the real sync check runs in "
                    "scripts/gpu_check.sh on a GPU machine")
def test_sync_check_on_cuda():
    rows = gc.check_sync_cuda((16, 256), only={"int8", "topk1%", "threshold"}, log=lambda m: None)
    by = {(r["case"], r["level"]): r for r in rows}
    assert by[("int8", "scheme")]["status"] == "no sync"
    assert by[("threshold", "compressor")]["status"] == "SYNC"


def test_cuda_mode_driver_dry_run(tmp_path, monkeypatch):
    """The CUDA-mode driver end to end (the run a GPU machine gets once), with
    the device under test pointed at the CPU, torch.cuda's few calls faked and
    the benchmark replaced by fixed rows: the report, micro_cuda.json and the
    target verdicts at 256M come out as they will on the GPU."""
    import types

    from hvd_compress.tools.bench import report as rep
    _emulate_sync_debug_mode(monkeypatch)
    monkeypatch.setattr(gc.catalogue, "CUDA_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(total_memory=2**30, major=9, minor=0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    monkeypatch.setattr(gc.speed, "copy_with_events", lambda n, reps=20: {"numel": n, "copy_s_cuda_events": 1e-3,
                                                                    "bandwidth_GBps": 8 * n / 1e-3 / 1e9})

    def fake_micro(device, sizes, reps, threads, out_json, schemes=None, log=print, deadline=None):
        assert device == "cpu" and threads is None and sizes == [16_000_000, 256_000_000]
        rows = [{"scheme": s, "framework": "torch", "device": "cuda", "numel": n, "encode_decode_s": r * 1e-3,
                 "copy_s": 1e-3, "ratio_to_copy": r, "payload_bytes": 1, "dense_fp32_bytes": 4 * n}
                for n in sizes for s, r in (("TopK(0.01)", 12.0), ("DGC(0.01)", 6.0), ("Int8", 3.0))]
        rep.write_json(out_json, rows)
        return rows, []
    monkeypatch.setattr(gc.speed, "run_micro", fake_micro)
    rc = gc.main(["--quick", "--out", str(tmp_path), "--cases", "int8,topk1%,threshold,dgc", "--tf", "off"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0, report["failures"]
    assert report["environment"]["mode"] == "cuda" and report["environment"]["gpu"] == "FakeGPU"
    assert report["under_test"] == "torch:cpu" and len(report["same_draws"]) == 4
    assert report["sync"]["method"] == "torch.cuda.set_sync_debug_mode"
    by = {(r["case"], r["level"]): r["status"] for r in report["sync"]["rows"]}
    assert by[("int8", "scheme")] == "no sync" and by[("threshold", "compressor")] == "SYNC"
    assert json.loads((tmp_path / "micro_cuda.json").read_text())[0]["device"] == "cuda"
    verdict = {t["scheme"]: t["met"] for t in report["targets"]["rows"]}
    assert verdict == {"TopK(0.01)": False, "DGC(0.01)": True, "Int8": True}
    log = (tmp_path / "gpu_check.log").read_text()
    assert "CUDA mode on FakeGPU" in log and "NOT met" in log
