"""The command line: sets up the sides for CUDA or the CPU fallback, runs the
check families in order and writes ``gpu_check.json`` and ``gpu_check.log``."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from . import catalogue, speed
from .catalogue import TARGET_NUMEL, _has, cases
from .generators import check_own_generators
from .same_draws import check_same_draws
from .sides import TFSide, TorchSide
from .sync import check_host_reads_cpu, check_sync_cuda

def environment(mode):
    import torch
    env = {"mode": mode, "python": platform.python_version(), "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(), "host": platform.node(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "zstandard": _has("zstandard"), "tensorflow": _has("tensorflow"),
           "horovod": _has("horovod")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}",
                   allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    try:
        from ..report import git_describe
        env["commit"] = git_describe()
    except Exception:
        env["commit"] = None
    return env

def _tf_side(want, cuda):
    """(TFSide or None, reason)."""
    if want == "off":
        return None, "--tf off"
    if not _has("tensorflow"):
        return None, "TensorFlow is not installed"
    if want == "auto" and not cuda:
        return None, "CPU fallback (the unit tests compare TensorFlow with the reference on the CPU); --tf on forces it"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    try:
        import tensorflow as tf
        gpus = tf.config.list_physical_devices("GPU")
        for g in gpus:  # TF would otherwise take all GPU memory from torch and the benchmark
            tf.config.experimental.set_memory_growth(g, True)
    except Exception as e:
        return None, f"TensorFlow does not import: {type(e).__name__}: {e}"
    if cuda and not gpus and want == "auto":
        return None, "TensorFlow sees no GPU (a CPU-only build); its CPU path is covered by the unit tests"
    dev = "/GPU:0" if gpus else "/CPU:0"
    return TFSide(dev), None

class _Tee:
    """Write to a stream and to the log file."""

    def __init__(self, stream, f):
        self.stream, self.f = stream, f

    def isatty(self):
        return False

    def close(self):  # a logging handler may hold this stream past main()
        pass

    def write(self, s):
        self.stream.write(s)
        if not self.f.closed:
            self.f.write(s)
        return len(s)

    def flush(self):
        self.stream.flush()
        if not self.f.closed:
            self.f.flush()

def _parser():
    ap = argparse.ArgumentParser(prog="gpu_check", description=sys.modules[__package__].__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: docs/results on CUDA, "
                    "out/gpu_check in the CPU fallback)")
    ap.add_argument("--cpu-fallback", action="store_true", help="CPU-only form even where CUDA is present")
    ap.add_argument("--quick", action="store_true", help="smallest sizes (the unit test)")
    ap.add_argument("--parts", default="correctness,sync,micro", help="comma-separated subset")
    ap.add_argument("--sizes", default=None, help="micro sizes (default 16M,256M on CUDA, 64Ki on the CPU)")
    ap.add_argument("--reps", type=int, default=None, help="micro repetitions (default 5 on CUDA, 2 on the CPU)")
    ap.add_argument("--schemes", default=None, help="micro specs (default: bench micro's list + EF variants)")
    ap.add_argument("--cases", default=None, help="correctness/sync cases (default: all): " +
                    ",".join(c for c, _, _ in cases()))
    ap.add_argument("--threads", type=int, default=None, help="CPU fallback: threads of the side under test")
    ap.add_argument("--tf", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--budget-s", type=float, default=420.0, help="leave out micro sizes that would start "
                    "after this many seconds (default %(default)s, so that the whole check fits in 8 minutes)")
    ap.add_argument("--strict", action="store_true", help="also fail on a sync in a fixed-size scheme not "
                    "listed as known, and on a missed speed target")
    return ap


def main(argv=None):
    """Command-line entry (``python -m hvd_compress.tools.bench.gpu_check --help``);
    returns the exit status.  Everything printed also goes to
    ``<out>/gpu_check.log``."""
    args = _parser().parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"gpu_check: needs PyTorch ({e})", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not args.cpu_fallback
    repo = Path(__file__).resolve().parents[4]  # the checkout: hvd_compress/tools/bench/gpu_check/driver.py
    out_dir = args.out or os.path.join(repo, "docs/results" if cuda else "out/gpu_check")
    os.makedirs(out_dir, exist_ok=True)
    saved = sys.stdout, sys.stderr
    with open(os.path.join(out_dir, "gpu_check.log"), "w") as logf:
        sys.stdout, sys.stderr = _Tee(saved[0], logf), _Tee(saved[1], logf)
        try:
            return _main(args, torch, cuda, out_dir)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = saved


class _Run:
    """One run's report, failures and notes, written to ``gpu_check.json``
    after every part, so that a crash keeps what was checked."""

    def __init__(self, args, cuda, out_dir):
        self.args, self.cuda, self.out_dir = args, cuda, out_dir
        self.t_start = time.monotonic()
        self.mode = "cuda" if cuda else "cpu-fallback"
        self.only = set(args.cases.split(",")) if args.cases else None
        self.report = {"environment": environment(self.mode), "arguments": vars(args)}
        self.path = os.path.join(out_dir, "gpu_check.json")
        self.failures, self.notes = [], []

    def log(self, msg=""):
        print(msg, flush=True)

    def fail_on(self, what, rows):
        self.failures += [f"{what}: {x['case']}" + (f" n={x['numel']}" if "numel" in x else "")
                          for x in rows if x["status"] == "FAILED"]

    def save(self):
        self.report["elapsed_s"] = round(time.monotonic() - self.t_start, 1)
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.report, f, indent=1, default=str)
            f.write("\n")
        os.replace(self.path + ".tmp", self.path)


class _Setup:
    """What differs between CUDA mode and the CPU fallback: the two sides and the sizes."""

    def __init__(self, run, torch):
        from ...units import parse_counts
        args, env = run.args, run.report["environment"]
        self.ref = TorchSide("cpu", threads=1)
        if run.cuda:
            run.log(f"gpu_check: CUDA mode on {env['gpu']} (torch {env['torch']}, CUDA {env.get('cuda')}, "
                    f"TF32 matmul {'on' if env.get('allow_tf32_matmul') else 'off'})")
            self.dut = TorchSide(catalogue.CUDA_DEVICE)
            self.shapes = [(257, 255), (2049, 2047)] if not args.quick else [(65, 63)]
            self.dist_n, self.trials = (1 << 14, 32) if not args.quick else (4096, 16)
            self.sizes = parse_counts(args.sizes or "16M,256M")
            self.reps = args.reps or 5
            self.micro_name, self.threads = "micro_cuda.json", None
            return
        why = "--cpu-fallback" if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"
        nthreads = args.threads or max(2, min(4, os.cpu_count() or 2))
        run.log(f"gpu_check: CPU FALLBACK ({why}): the device under test is the CPU with {nthreads} threads, "
                f"the reference the CPU with 1; small sizes; host-read recording instead of the CUDA sync check")
        self.dut = TorchSide("cpu", threads=nthreads)
        self.shapes = [(65, 63)] if args.quick else [(257, 255)]
        self.dist_n, self.trials = (2048, 16) if args.quick else (4096, 24)
        self.sizes = parse_counts(args.sizes or ("16384" if args.quick else "65536"))
        self.reps = args.reps or (1 if args.quick else 2)
        self.micro_name, self.threads = "micro_cpu_fallback.json", 1


def _part_correctness(run, setup):
    ref, dut = setup.ref, setup.dut
    run.log(f"\n[1a] same inputs and draws, 2 ranks x 3 steps, error feedback on: {dut.name} vs {ref.name}")
    run.report["same_draws"] = r = check_same_draws(ref, dut, setup.shapes, only=run.only, log=run.log)
    run.fail_on("same draws", r)
    run.save()
    run.log(f"\n[1b] own random generators ({setup.trials} trials, n={setup.dist_n}; DGC n={16 * setup.dist_n}): "
            f"{dut.name} (seeds 10000+) vs {ref.name} (seeds 0+)")
    run.report["own_generators"] = r = check_own_generators(
        TorchSide("cpu", threads=1, controlled=False),
        TorchSide(dut.device.type, threads=dut.threads, controlled=False), setup.dist_n, setup.trials, log=run.log)
    run.fail_on("own generators", r)
    run.save()
    tf_side, why = _tf_side(run.args.tf, run.cuda)
    if tf_side is None:
        run.log(f"\n[1c] TensorFlow: SKIPPED: {why}")
        run.report["tensorflow"] = {"status": "skipped", "reason": why}
    else:
        run.log(f"\n[1c] TensorFlow, same inputs and draws: {tf_side.name} vs {ref.name}")
        run.report["tensorflow"] = r = check_same_draws(ref, tf_side, setup.shapes[:1], only=run.only, log=run.log)
        run.failures += [f"tensorflow: {x['case']}" for x in r if x["status"] == "FAILED"]
    run.save()


def _part_sync(run):
    sync_shape = (64, 1024) if not run.args.quick else (16, 256)
    if run.cuda:
        run.log("\n[2] host syncs: each hot path under torch.cuda.set_sync_debug_mode('error') "
                f"(n={int(np.prod(sync_shape))}; 'scheme' = encode+EF for 2 ranks + aggregate, "
                "'compressor' = the one-rank compressor bench micro times)")
        r = check_sync_cuda(sync_shape, only=run.only, log=run.log)
    else:
        run.log("\n[2] host reads (CPU stand-in for the CUDA sync check: .item/.cpu/.tolist/.numpy/bool/int/"
                "float recorded; syncs inside kernels such as nonzero/unique are invisible here)")
        r = check_host_reads_cpu(sync_shape, only=run.only, log=run.log)
    run.report["sync"] = {"method": "torch.cuda.set_sync_debug_mode" if run.cuda else "host-read recording (CPU)",
                          "rows": r}
    unexpected = sorted({x["case"] for x in r if x["status"] in ("SYNC", "HOST READ") and not x.get("expected")})
    crashed = sorted({x["case"] for x in r if x["status"] == "FAILED"})
    run.report["sync"]["unexpected"] = unexpected
    run.failures += [f"sync: {c} crashed" for c in crashed]
    if unexpected:
        run.notes.append("host syncs in fixed-size schemes not listed as known: " + ", ".join(unexpected))
        if run.args.strict:
            run.failures.append("sync: " + ", ".join(unexpected))
    run.save()


def _part_micro(run, setup, torch):
    from ..specs import split_specs
    micro_path = os.path.join(run.out_dir, setup.micro_name)
    run.log(f"\n[3] bench micro (torch, {'cuda' if run.cuda else 'cpu'}): sizes {setup.sizes}, {setup.reps} reps "
            f"-> {micro_path}")
    if _has("tensorflow"):
        run.log("  TensorFlow left out of the micro part: bench micro's TF worker always adds the CPU device, "
                "and TF on the CPU at 256M does not fit in the time budget")
    if run.cuda:
        torch.cuda.empty_cache()
        run.report["copy_cuda_events"] = [speed.copy_with_events(n) for n in setup.sizes]
        for c in run.report["copy_cuda_events"]:
            run.log(f"  copy with CUDA events, n={c['numel']}: {c['copy_s_cuda_events'] * 1e3:.3f} ms "
                    f"({c['bandwidth_GBps']:.0f} GB/s read+write)")
    specs = split_specs(run.args.schemes) if run.args.schemes else None
    try:
        rows, errors = speed.run_micro(catalogue.CUDA_DEVICE if run.cuda else "cpu", setup.sizes, setup.reps,
                                       setup.threads, micro_path, specs, log=run.log,
                                       deadline=run.t_start + run.args.budget_s)
    except Exception as e:
        rows, errors = [], [f"{type(e).__name__}: {e}"]
    run.report["micro"] = {"json": micro_path, "rows": len(rows), "errors": errors}
    run.failures += [f"micro: {e}" for e in errors]
    _judge_targets(run, rows, TARGET_NUMEL if run.cuda else max(setup.sizes))
    run.save()


def _judge_targets(run, rows, tnumel):
    judged = speed.judge_targets(rows, tnumel)
    run.report["targets"] = {"numel": tnumel, "rows": judged,
                             "note": None if run.cuda else "CPU fallback: no CUDA target applies; shown for the record"}
    if not judged:
        return
    run.log(f"\n  CUDA targets at {tnumel} elements (encode+decode+EF <= 8x copy for Top-K/DGC, <= 4x for "
            f"quantizers){'' if run.cuda else ' -- CPU fallback, informational only'}:")
    for j in judged:
        run.log(f"    {j['scheme']:<32} {j['ratio_to_copy']:8.2f}x  (<= {j['bar_x_copy']:g}x)  "
                f"{'met' if j['met'] else 'NOT met'}")
    if run.cuda and run.args.strict and not all(j["met"] for j in judged):
        run.failures.append("targets not met")


def _main(args, torch, cuda, out_dir):
    """The check families in order, each skipped unless named in ``--parts``."""
    run = _Run(args, cuda, out_dir)
    setup = _Setup(run, torch)
    run.report.update(reference=setup.ref.name, under_test=setup.dut.name)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if "correctness" in parts:
        _part_correctness(run, setup)
    if "sync" in parts:
        _part_sync(run)
    if "micro" in parts:
        _part_micro(run, setup, torch)
    run.report.update(failures=run.failures, notes=run.notes, ok=not run.failures)
    run.save()
    run.log(f"\ngpu_check: {run.mode}: {'OK' if not run.failures else 'FAILED'} in "
            f"{time.monotonic() - run.t_start:.0f} s; report {run.path}")
    for f_ in run.failures:
        run.log(f"  FAILED: {f_}")
    for n_ in run.notes:
        run.log(f"  note: {n_}")
    return 0 if not run.failures else 1
