#!/usr/bin/env python
"""Peak memory per rank of one training step with and without compression.

    .venv/bin/python scripts/measure_memory.py [--np 3] [--controller gloo] [--out docs/results/memory.json]

A model with one 8192 x 8192 ``Linear`` weight (64 Mi elements, 256 MiB in fp32,
no bias) is trained with the stock ``hvd.DistributedOptimizer`` under
``horovodrun -np 3`` on this machine, once per compression: ``none``
(``hvd_compress.NoCompression``: a plain fp32 allreduce), ``TopK(0.01)``,
``Int8()`` and ``EFSignSGD()``.  Two steps are run (the first allocates the
error-feedback residual and Horovod's buffers; the second is the steady state).

Each rank measures, with Linux's resident-set high-water mark (``VmHWM`` in
``/proc/self/status``, reset at the start of each phase by writing ``5`` to
``/proc/self/clear_refs``), for each phase of each step (model creation is a
phase too):

* ``rss_start`` -- resident memory when the phase starts;
* ``peak`` -- the highest resident memory during the phase;
* ``transient = peak - rss_start`` -- what the phase allocated at its worst;
* ``rss_end``.

``peak`` of the whole run is the largest phase peak.  (``getrusage``'s
``ru_maxrss`` is not used: it keeps the high-water mark of the process that
``horovodrun`` forked and exec'd into the worker, about 1.3 GB here, whatever the
worker does.)

Phases: ``backward`` (forward + backward: Horovod's hooks call ``compress``, which
launches the allgathers), ``synchronize`` (waits for the collectives and calls
``decompress``: the aggregation of the N gathered payloads) and ``step``
(``optimizer.step()``).  Everything is reported in MiB and in *dense copies* of the
weight (256 MiB).  Background threads (Horovod's, Gloo's) count: they are part
of the process.

Results go to ``--out`` as JSON (per scheme: per-rank phase tables, the max over
ranks) and a table is printed; docs/design/reliability.md quotes them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS, COLS = 8192, 8192
DENSE_MIB = ROWS * COLS * 4 / 2**20
SCHEMES = {
    "none": "hvd_compress.NoCompression()",
    "TopK(0.01)": "hvd_compress.TopK(0.01)",
    "Int8": "hvd_compress.Int8()",
    "EFSignSGD": "hvd_compress.EFSignSGD()",
}


# --------------------------------------------------------------------------------------------- worker
def _status_mib(field):
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) / 1024.0


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _phase(fn):
    rss0 = _status_mib("VmRSS")
    _reset_peak()
    fn()
    peak = _status_mib("VmHWM")
    return {"rss_start": round(rss0, 1), "peak": round(peak, 1), "transient": round(peak - rss0, 1),
            "rss_end": round(_status_mib("VmRSS"), 1)}


def worker(args):
    import torch

    import horovod.torch as hvd

    import hvd_compress  # noqa: F401  (used by eval of the scheme expression)

    torch.set_num_threads(1)  # 3 ranks share 2 cores
    hvd.init()
    rank = hvd.rank()
    base = _status_mib("VmRSS")
    made = {}

    def make_model():
        made["model"] = torch.nn.Linear(COLS, ROWS, bias=False)
        with torch.no_grad():
            made["model"].weight.normal_(0, 0.01, generator=torch.Generator().manual_seed(0))

    model_phase = _phase(make_model)
    model = made["model"]
    comp = eval(SCHEMES[args.scheme], {"hvd_compress": hvd_compress})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(), compression=comp)
    x = torch.randn(8, COLS, generator=torch.Generator().manual_seed(rank))
    after_model = _status_mib("VmRSS")
    steps = []
    for _ in range(2):
        opt.zero_grad()

        def backward():
            model(x).square().mean().backward()

        def synchronize():
            opt.synchronize()

        def step():
            with opt.skip_synchronize():
                opt.step()

        steps.append({"backward": _phase(backward), "synchronize": _phase(synchronize), "step": _phase(step)})
    finite = bool(torch.isfinite(model.weight).all())
    peak = max([model_phase["peak"]] + [ph["peak"] for st in steps for ph in st.values()])
    res = {"rank": rank, "size": hvd.size(), "scheme": args.scheme, "rss_after_init": round(base, 1),
           "model": model_phase, "rss_after_model": round(after_model, 1), "steps": steps,
           "peak_mib": peak, "weight_finite": finite}
    Path(args.result_dir, f"{args.scheme}.rank{rank}.json").write_text(json.dumps(res))


# --------------------------------------------------------------------------------------------- driver
def run_scheme(scheme, np_, controller, result_dir, timeout):
    py = sys.executable
    hvdrun = str(Path(py).parent / "horovodrun")
    cmd = [hvdrun, "-np", str(np_), "-H", f"localhost:{np_}", f"--{controller}", "--start-timeout", "120",
           py, str(Path(__file__).resolve()), "--worker", "--scheme", scheme, "--result-dir", str(result_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3", OMPI_MCA_mpi_yield_when_idle="1")
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))
    if r.returncode != 0:
        raise SystemExit(f"{scheme}: horovodrun failed ({r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    ranks = [json.loads(Path(result_dir, f"{scheme}.rank{i}.json").read_text()) for i in range(np_)]
    return cmd, ranks, time.monotonic() - t0


def summarize(ranks):
    """Max over ranks of each phase's numbers, per step."""
    out = []
    for s in range(len(ranks[0]["steps"])):
        row = {}
        for phase in ("backward", "synchronize", "step"):
            row[phase] = {k: max(r["steps"][s][phase][k] for r in ranks) for k in ("rss_start", "peak",
                                                                                   "transient", "rss_end")}
        out.append(row)
    return {"steps": out, "peak_mib": max(r["peak_mib"] for r in ranks),
            "rss_after_model_mib": max(r["rss_after_model"] for r in ranks),
            "weight_finite": all(r["weight_finite"] for r in ranks)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=3)
    ap.add_argument("--controller", choices=["gloo", "mpi"], default="gloo")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "memory.json"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    results, commands = {}, {}
    with tempfile.TemporaryDirectory(prefix="hvdc-memory-") as d:
        for scheme in args.schemes.split(","):
            cmd, ranks, wall = run_scheme(scheme, args.np, args.controller, d, args.timeout)
            results[scheme] = {"summary": summarize(ranks), "ranks": ranks, "wall_s": round(wall, 1)}
            commands[scheme] = shlex.join(cmd).replace(d, "<tmpdir>")
            print(f"[{scheme}] done in {wall:.0f} s", file=sys.stderr)
    doc = {
        "what": "peak resident memory per rank of one training step (8192x8192 fp32 Linear weight, "
                f"{ROWS * COLS} elements = {DENSE_MIB:.0f} MiB) under horovodrun -np {args.np} on one machine",
        "method": "VmHWM reset per phase via /proc/self/clear_refs; transient = phase peak - RSS at phase "
                  "start; max over ranks; MiB",
        "dense_copy_mib": DENSE_MIB,
        "np": args.np, "controller": args.controller,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": f"{sys.executable} scripts/measure_memory.py --np {args.np} --controller {args.controller}",
        "horovodrun_commands": commands,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    return 0


def table(doc):
    dense = doc["dense_copy_mib"]
    lines = [f"RSS per rank, max over {doc['np']} ranks, MiB (dense copy = {dense:.0f} MiB); transient = phase peak - "
             "RSS at phase start, step 1 / step 2",
             f"{'scheme':<12} {'after model':>11} {'peak':>6} {'vs none':>7} {'backward (compress)':>21} "
             f"{'synchronize (decompress)':>26} {'after step 2':>12}"]
    none_peak = doc["results"].get("none", {}).get("summary", {}).get("peak_mib")
    for scheme, res in doc["results"].items():
        s = res["summary"]

        def cell(ph):
            a, b = (st[ph]["transient"] for st in s["steps"][:2])
            return f"{a:5.0f} / {b:5.0f} ({b / dense:3.1f}x)"
        rel = f"{s['peak_mib'] / none_peak:6.2f}x" if none_peak else "   n/a"
        lines.append(f"{scheme:<12} {s['rss_after_model_mib']:11.0f} {s['peak_mib']:6.0f} {rel:>7} "
                     f"{cell('backward'):>21} {cell('synchronize'):>26} {s['steps'][-1]['step']['rss_end']:12.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
