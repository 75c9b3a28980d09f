"""Loss curves of an elastic Horovod job through membership changes:
``docs/results/elastic.json`` and ``docs/results/elastic.png``.

    .venv/bin/python scripts/elastic_results.py

Runs the job of tests/testing/test_elastic_jobs.py (tests/testing/elastic_worker_torch.py:
3 workers, host ``127.0.0.1`` removed, added back, its worker SIGKILLed mid-step,
2 workers to the end; ``horovodrun --gloo --min-np 2 --max-np 3
--host-discovery-script``) and keeps, per committed step, the number of workers and
the evaluation loss of the four models trained side by side on the same data:
Horovod's uncompressed ``none``, ``hvd_compress.TopK(0.01)``,
``hvd_compress.Int8(transport="two_phase")`` and ``hvd_compress.Auto(calibration_steps=3)``;
plus the job's conservation and lost-mass numbers.  It runs on this machine's
``localhost`` (2 slots) and ``127.0.0.1`` (1 slot), two names Horovod's elastic
driver treats as two hosts, so it needs no root; the test runs the same worker on
the emulated cluster.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "testing" / "elastic_worker_torch.py"


def run_job(timeout_s=600):
    with tempfile.TemporaryDirectory() as tmp:
        hosts = Path(tmp) / "hosts"
        hosts.write_text("localhost:2\n127.0.0.1:1\n")
        discover = Path(tmp) / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
        discover.chmod(stat.S_IRWXU)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", HOROVOD_GLOO_TIMEOUT_SECONDS="30",
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        cmd = [horovodrun, "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(discover),
               "--elastic-timeout", "120", "--network-interface", "lo", "--gloo", sys.executable, str(WORKER),
               str(hosts), "localhost:2", "127.0.0.1"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout_s)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "ELASTIC_RESULT " in line]
    if out.returncode != 0 or len(lines) != 1:
        raise SystemExit(f"the elastic job failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    return json.loads(lines[0].split("ELASTIC_RESULT ", 1)[1])


def plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = list(range(1, len(doc["workers"]) + 1))
    for kind, label in (("none", "none (Horovod)"), ("topk", "TopK(0.01)"), ("int8", "Int8, two-phase"),
                        ("auto", "Auto(), re-planned at each change")):
        ax.semilogy(steps, doc["loss"][kind], label=label)
    for change in doc["changes"]:
        ax.axvline(change["step"], color="grey", lw=0.8, ls="--")
        ax.text(change["step"], ax.get_ylim()[1], f" {change['workers']}", va="top", fontsize=8, color="grey")
    ax.set_xlabel("committed step")
    ax.set_ylabel("evaluation loss (MSE)")
    ax.set_title("elastic Horovod: workers 3 -> 2 (removed) -> 3 (added) -> 2 (killed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "elastic.json"))
    args = ap.parse_args()
    result = run_job()
    sizes = result["sizes"]
    doc = {
        "command": ".venv/bin/python scripts/elastic_results.py",
        "job": "tests/testing/elastic_worker_torch.py under horovodrun --gloo --min-np 2 --max-np 3 "
               "--host-discovery-script; op=hvd.Sum, SGD lr 0.3, linear regression 64 -> 16",
        "initial_loss": result["initial_loss"],
        "workers": sizes,
        "changes": [{"step": i + 1, "workers": s} for i, s in enumerate(sizes) if i > 0 and s != sizes[i - 1]],
        "loss": {kind: [row[kind] for row in result["losses"]] for kind in ("none", "topk", "int8", "auto")},
        "final_loss": {kind: r["final_loss"] for kind, r in result["kinds"].items()},
        "conservation": {kind: {k: r[k] for k in ("conservation_error", "error_without_lost", "grad_scale",
                                                  "lost_expected_norm", "lost_reported")}
                         for kind, r in result["kinds"].items() if kind != "none"},
        "identical_replicas": result["identical"],
    }
    out = Path(args.out)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}: final loss {doc['final_loss']}")


if __name__ == "__main__":
    main()
