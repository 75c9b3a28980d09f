"""``hvd-compress bench tta``: time to accuracy on the emulated cluster.

Does a scheme reach dense training's accuracy sooner in wall-clock time?  Each run trains a
real model on real data (:mod:`hvd_compress.tools.bench.tta_data`) under ``horovodrun`` on
the emulated cluster (:mod:`hvd_compress.tools.testing.cluster`, one rank a host), each
scheme under its recipe (:mod:`hvd_compress.tools.recipes`), and evaluates on held-out data
every ``eval_every`` steps (:mod:`hvd_compress.tools.bench.tta_worker`).

**Target.** Dense training's final held-out accuracy, the median over the seeds, minus the
scheme's tolerance in the recipe table (:func:`hvd_compress.tools.recipes.tolerance_of`;
``none``: 0).  A run reaches it at the first evaluation at or above it (:func:`first_reach`);
one that does not within its budget is "not reached" with that budget: nothing is
extrapolated.  The budget is the model's ``steps``, or its multiple where the scheme's recipe
says so (:func:`hvd_compress.tools.recipes.budget_steps`: the sparsifiers on the transformer);
dense always trains ``steps``, so the target is the accuracy dense training reaches today.

**Links.** ``unshaped``, and ``1gbit``, ``10gbit``, ``100gbit``: the rates at which dense
training's communication-to-compute ratio equals that of ``stands_for`` (ResNet-50 or
BERT-large on 8 A100s) at 1, 10 and 100 Gbit/s (:mod:`hvd_compress.tools.link_mapping`, from
this model's tensors, its compute-only step and the latency measured on the cluster).

**CPU budget** (``mode="combined"``).  Synchronous training follows the same trajectory
whatever the link, so each fixed scheme's curve is measured once per seed on the unshaped link
(``measured: true`` there), and its step time once per link (``--time-steps``); a row of a
shaped link is combined (``measured: false``): the steps of the curve's dense warmup and ratio
ramp at ``none``'s step time on that link, the others at the scheme's.  ``Auto()`` chooses by
link, so it trains once per link, end to end (``measured: true``).  ``validate_link``: every
fixed scheme also trains seed 1 end to end on that link, and the report compares that measured
time to the target with the combined one (the target: within 10%).

Output: rows appended to ``out_json`` (docs/results/tta.json), each with :data:`FIELDS` and the
``command`` that made it; the link mapping, the step times and the validation go to
``<out>.meta.json`` (a list of runs).
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

from ..link_mapping import REFERENCE_GBIT, map_links
from ..recipes import WARMUP_EPOCHS, budget_steps, is_auto_spec, per_model, recipe_of_spec, tolerance_of
from .e2e import clean_log, run_launch
from .pinning import worker_arguments
from .report import Progress, write_json
from .specs import HOROVOD_SPECS, parse_spec, split_specs

FIELDS = ("model", "params", "framework", "workers", "link", "link_mbit", "scheme", "seed", "target", "reached",
          "time_to_target_s", "steps_to_target", "wire_bytes_to_target", "final_accuracy", "measured", "curve")
DEFAULT_SCHEMES = "none,hvd_fp16,TopK(0.01),DGC(0.001),PowerSGD(4),Int8(),EFSignSGD(),Auto()"
LINKS = ("unshaped",) + tuple(REFERENCE_GBIT)
AUTO = "Auto()"

#: (training steps at 4 ranks, evaluate every): the CNN's 10 epochs and the transformer's 20 of the
#: convergence bench (32 steps an epoch at 4 ranks, batch 32), the character LM's 300 steps
MODEL_STEPS = {"cnn": (320, 16), "transformer": (640, 32), "charlm": (300, 25)}


def first_reach(curve, target):
    """The first point of ``curve`` (a list of ``{"step", "time_s", "wire_bytes",
    "accuracy"}``) whose accuracy is at or above ``target``, or None."""
    return next((p for p in curve if p["accuracy"] is not None and p["accuracy"] >= target), None)


def dense_target(dense_finals, spec):
    """``spec``'s target: the median of dense's final accuracies less the scheme's tolerance."""
    if not dense_finals:
        raise ValueError("dense_finals must hold dense training's final accuracy of at least one seed")
    return round(statistics.median(dense_finals) - tolerance_of(spec), 3)


#: what an ``Auto`` run's record says of Auto, kept in its rows (:mod:`.tta_worker`)
AUTO_FIELDS = ("auto_plan", "auto_warmup", "auto_plan_starts", "auto_trials", "auto_recheck_trials",
               "auto_check_seconds")


def _reach(curve, target):
    """A row's ``target`` and what its curve says of it: reached, and the time, steps and bytes to it."""
    hit = first_reach(curve, target)
    return {"target": target, "reached": hit is not None, "time_to_target_s": hit["time_s"] if hit else None,
            "steps_to_target": hit["step"] if hit else None,
            "wire_bytes_to_target": hit["wire_bytes"] if hit else None}


def make_row(*, model, params, framework, workers, link, link_mbit, scheme, seed, target, curve, measured, command,
             steps, auto=None, pinned_cores=False):
    """One row of tta.json from a run's curve (times and bytes already those of ``link``);
    ``auto``: an Auto run's record, whose :data:`AUTO_FIELDS` the row keeps (``auto_plan``: the
    plan in force at the run's end, ``{tensor: scheme}``); ``pinned_cores``: its ranks ran bound
    to a core each (the field is left out of rows whose ranks were not)."""
    extra = {k: auto[k] for k in AUTO_FIELDS if auto and auto.get(k) is not None}
    return {"model": model, "params": params, "framework": framework, "workers": workers, "link": link,
            "link_mbit": link_mbit, "scheme": scheme, "seed": seed, **_reach(curve, target),
            "final_accuracy": curve[-1]["accuracy"] if curve else None, "measured": measured, "curve": curve,
            "budget_steps": steps, "command": command, **({"pinned_cores": True} if pinned_cores else {}), **extra}


def dense_phase_steps(spec, model, steps_per_epoch):
    """Steps of ``spec``'s recipe spent dense (its warmup) or on the ratio ramp."""
    if spec in HOROVOD_SPECS or is_auto_spec(spec):
        return 0
    r = recipe_of_spec(spec)
    warm = WARMUP_EPOCHS[model] * steps_per_epoch if r.warmup else 0
    ramp = per_model(r.params.get("ramp", 0), model) * steps_per_epoch * 4  # four stages before the ratio
    return warm + ramp


def combined_curve(curve, dense_steps, none_step_s, scheme_step_s, traces=()):
    """``curve`` with each point's time at a link's step times: its first
    ``dense_steps`` steps at ``none_step_s``, the rest at ``scheme_step_s``, plus
    the ``traces`` (``[(step index, seconds)]``, :func:`trace_steps`) among the
    steps the point has done."""
    out = []
    for p in curve:
        warm = min(p["step"], dense_steps)
        extra = sum(seconds for index, seconds in traces if index < p["step"])
        out.append(dict(p, time_s=round(extra + warm * none_step_s + (p["step"] - warm) * scheme_step_s, 4)))
    return out


#: a step that took this many times the run's median step, or longer, traced
#: (TensorFlow builds its graph; tens of times a step of tens of milliseconds)
TRACE_STEP_FACTOR = 5.0


def trace_steps(rec):
    """``[(step index, seconds beyond the median step)]`` of a measured run's
    steps that traced: the first step, and every later one of at least
    :data:`TRACE_STEP_FACTOR` times the median (TensorFlow traces again for the
    epoch's smaller last batch, a new input shape).  A curve combined from
    median step times would otherwise leave them out.  Empty where the run
    kept no step times."""
    times, median = rec.get("step_times_s") or [], rec.get("median_step_s")
    if not times or median is None:
        return []
    return [(i, t - median) for i, t in enumerate(times)
            if t > median and (i == 0 or t >= TRACE_STEP_FACTOR * median)]


class Session:
    """One cluster and the launches of one ``bench tta`` run."""

    def __init__(self, cluster, a, tmp, prog):
        self.c, self.a, self.tmp, self.prog, self.failures, self.launches = cluster, a, tmp, prog, [], 0
        self.env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": str(a["threads"])}

    def launch_budgets(self, label, schemes, seeds, compute_steps=0):
        """The curves of ``schemes``: one launch per step budget among them (the model's first),
        the records in one list."""
        a, groups = self.a, {}
        for s in schemes:
            groups.setdefault(budget_steps(s, a["model"], a["steps"]), []).append(s)
        recs = []
        for steps in sorted(groups, key=lambda n: n != a["steps"]):
            tag = "" if steps == a["steps"] else f", {steps} steps"
            recs += self.launch(label + tag, groups[steps], seeds, compute_steps=compute_steps, steps=steps)
        return recs

    def launch(self, label, schemes, seeds, time_steps=0, compute_steps=0, steps=None):
        """One horovodrun of the worker: its records (those finished before a failure)."""
        a = self.a
        self.launches += 1
        out = os.path.join(self.tmp, f"launch{self.launches}.json")
        cmd = [sys.executable, "-m", "hvd_compress.tools.bench.tta_worker", "--framework", a["framework"],
               "--model", a["model"], "--schemes", ",".join(schemes), "--seeds", ",".join(map(str, seeds)),
               "--steps", str(steps or a["steps"]), "--eval-every", str(a["eval_every"]), "--threads", str(a["threads"]),
               "--iface", self.c.iface, "--out", out, "--time-steps", str(time_steps),
               "--compute-steps", str(compute_steps)] + worker_arguments(a.get("pin_cores"))
        argv = self.c.horovodrun_command(cmd, np=a["workers"], controller="gloo", extra=["--start-timeout", "180"])
        rc, log = run_launch(self.c, argv, self.env, a["run_timeout"])
        got = json.load(open(out)) if os.path.exists(out) else []
        if rc != 0:
            self.failures.append({"launch": label, "rc": rc, "log_tail": clean_log(log)[-3000:]})
            self.prog.note(f"{label}: FAILED (exit {rc}); log tail:\n{clean_log(log)[-1500:]}")
        return got

    def goodput(self):
        try:
            return round(self.c.measure_throughput_mbit(src=1, dst=0, seconds=2.0), 1)
        except Exception as e:  # the run can go on without it
            self.prog.note(f"throughput measurement failed: {e}")
            return None


def _command():
    argv = sys.argv[1:]
    argv = argv[argv.index("tta") + 1:] if "tta" in argv else argv
    return "hvd-compress bench tta " + shlex.join(argv)


def run(framework="torch", model="cnn", schemes=DEFAULT_SCHEMES, seeds="1,2,3", links=",".join(LINKS),
        stands_for="resnet50", workers=4, steps=None, eval_every=None, validate_link=None, time_steps=8,
        threads=1, prefix="tta", out_json=None, out_png=None, run_timeout=3600, progress=True, command=None,
        validate_schemes=None, curves_from=None, rates_from=None, save_curves=None, pin_cores=True):
    """Bring up the cluster, measure every curve, step time and Auto run, write the rows; return
    ``(rows, meta)``.  ``pin_cores``: rank ``r`` bound to core ``r mod cores``
    (:mod:`hvd_compress.tools.bench.pinning`; the rows say ``pinned_cores``).
    ``validate_schemes``: the fixed schemes trained end to end on
    ``validate_link`` (default: all).  ``curves_from``: a worker JSON of unshaped curves measured
    before (the same model, ranks, steps, schemes and seeds), in place of measuring them again.
    ``rates_from``: a tta meta JSON; the shaped links' rates of its last run of this model,
    framework and ranks, in place of mapping them again (rows that join an earlier run's).
    ``save_curves``: where to write the unshaped curves' worker JSON, for a later ``curves_from``."""
    from ..testing.cluster import Cluster
    from .scale import measure_rtt_s

    schemes = split_specs(schemes) if isinstance(schemes, str) else list(schemes)
    for s in schemes:
        parse_spec(s)
        tolerance_of(s)  # every scheme needs a target: a clear error now, not after the runs
    if "none" not in schemes:
        raise ValueError("schemes must include 'none': its final accuracy sets every target")
    links = [x.strip() for x in links.split(",")] if isinstance(links, str) else list(links)
    bad = [x for x in links if x not in LINKS]
    if bad or "unshaped" not in links:
        raise ValueError(f"links must be a comma list of {', '.join(LINKS)} including unshaped; got {links}")
    if validate_link is not None and validate_link not in links[1:]:
        raise ValueError(f"validate_link must be one of the shaped links {links[1:]}; got {validate_link!r}")
    seeds = [int(x) for x in str(seeds).split(",")]
    default_steps, default_eval = MODEL_STEPS[model]
    a = {"framework": framework, "model": model, "workers": workers, "threads": threads, "run_timeout": run_timeout,
         "steps": steps or default_steps, "eval_every": eval_every or default_eval, "pin_cores": bool(pin_cores)}
    command = command or _command()
    fixed = [s for s in schemes if not is_auto_spec(s)]
    auto_specs = [s for s in schemes if is_auto_spec(s)]
    prog = Progress(3 + len(links), enabled=progress)
    meta = {"command": command, "started": _now(), "model": model, "framework": framework, "workers": workers,
            "steps": a["steps"], "eval_every": a["eval_every"], "stands_for": stands_for, "seeds": seeds,
            "curves_from": curves_from, "pinned_cores": a["pin_cores"]}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvdc_tta_") as tmp, Cluster(workers, prefix=prefix) as c:
        ses = Session(c, a, tmp, prog)
        c.set_rate(None)
        meta["latency_s"] = measure_rtt_s(c) / 2
        curves = (_saved_curves(curves_from, a, schemes, seeds) if curves_from else
                  ses.launch_budgets("curves (unshaped)", fixed + auto_specs, seeds, compute_steps=3))
        prog.step("curves", f"{len(curves)} runs")
        if save_curves and not curves_from:
            write_json(save_curves, curves)
        if not curves:
            raise RuntimeError(f"no curve came back: {ses.failures}")
        base = curves[0]
        meta["compute_s"], meta["params"] = base["compute_s"], base["params"]
        if rates_from:
            meta["link_mapping"] = saved_link_mapping(rates_from, model, framework, workers, links)
        else:
            mapping = map_links(base["layer_numels"], workers, base["compute_s"], meta["latency_s"],
                                [x for x in links if x != "unshaped"], (stands_for,))[stands_for]
            meta["link_mapping"] = {k: vars(m) for k, m in mapping.items()}
        rates = {"unshaped": None, **{k: m["link_mbit"] for k, m in meta["link_mapping"].items()}}
        times, autos, measured_val = {}, {}, []
        for link in links:
            c.set_rate(rates[link])
            meta.setdefault("goodput_mbit", {})[link] = ses.goodput()
            if link != "unshaped":  # there the curves themselves are measured end to end
                timed = ses.launch(f"step times ({link})", fixed, [1], time_steps=time_steps)
                times[link] = {r["scheme"]: r["median_step_s"] for r in timed}
            if auto_specs and link != "unshaped":  # Auto chooses by link: every seed runs there
                autos[link] = ses.launch(f"Auto ({link})", auto_specs, seeds,
                                         steps=budget_steps(auto_specs[0], model, a["steps"]))
            if link == validate_link:
                measured_val = ses.launch_budgets(f"validation ({link})", split_specs(validate_schemes)
                                                  if validate_schemes else fixed, [seeds[0]])
            prog.step(f"link {link} ({rates[link] or 'unshaped'} Mbit/s)", ", ".join(
                f"{k} {v * 1e3:.0f} ms" for k, v in times.get(link, {}).items() if v))
        meta["step_times_s"], meta["link_mbit"] = times, rates
    meta["seconds"] = round(time.monotonic() - t_start, 1)
    meta["failures"] = ses.failures
    rows = build_rows(a, curves, times, autos, measured_val, rates, validate_link, command)
    meta["validation"] = validation(rows, validate_link)
    if out_json:
        append_rows(out_json, rows, meta)
    if out_png:
        plot(rows, out_png)
    return rows, meta


def saved_link_mapping(path, model, framework, workers, links):
    """The link mapping of the last run in the tta meta JSON ``path`` of this model, framework and
    ranks that maps every shaped link of ``links`` (a later run of the unshaped link alone maps
    none); an error names what is missing."""
    shaped = [x for x in links if x != "unshaped"]
    with open(path) as f:
        runs = [r for r in json.load(f) if (r["model"], r["framework"], r["workers"]) == (model, framework, workers)
                and all(x in r.get("link_mapping", {}) for x in shaped)]
    if not runs:
        raise ValueError(f"rates_from: {path} has no run of {framework} {model} at {workers} ranks mapping "
                         f"the links {shaped}")
    return {x: runs[-1]["link_mapping"][x] for x in shaped}


def _saved_curves(path, a, schemes, seeds):
    """The worker records in ``path``, checked against this run's model, ranks, steps, schemes and seeds."""
    with open(path) as f:
        recs = json.load(f)
    got = {(r["scheme"], r["seed"]) for r in recs}
    want = {(s, seed) for s in schemes for seed in seeds}
    if want - got or any(r["steps"] != budget_steps(r["scheme"], a["model"], a["steps"])
                         or r["workers"] != a["workers"] for r in recs):
        raise ValueError(f"curves_from: {path} lacks {sorted(want - got)} or has other steps/ranks than "
                         f"{a['steps']} (the recipes' budgets)/{a['workers']}")
    return [r for r in recs if (r["scheme"], r["seed"]) in want]


def _now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_rows(a, curves, times, autos, measured_val, rates, validate_link, command):
    """Every row: measured curves (unshaped, Auto per link, the validation runs) and combined ones."""
    finals = [r["curve"][-1]["accuracy"] for r in curves if r["scheme"] == "none" and r["curve"]]
    rows = []

    def add(rec, link, curve, measured):
        rows.append(make_row(model=a["model"], params=rec["params"], framework=a["framework"],
                             workers=rec["workers"], link=link, link_mbit=rates[link], scheme=rec["scheme"],
                             seed=rec["seed"], target=dense_target(finals, rec["scheme"]), curve=curve,
                             measured=measured, command=command, steps=rec["steps"],
                             auto=rec if "auto_plan" in rec else None, pinned_cores=a.get("pin_cores", False)))
    for rec in curves:
        add(rec, "unshaped", rec["curve"], True)
        if is_auto_spec(rec["scheme"]):
            continue
        for link, t in times.items():
            if link == "unshaped" or t.get(rec["scheme"]) is None or t.get("none") is None:
                continue
            dense = dense_phase_steps(rec["scheme"], a["model"], rec["steps_per_epoch"])
            add(rec, link, combined_curve(rec["curve"], dense, t["none"], t[rec["scheme"]], trace_steps(rec)), False)
    for link, recs in autos.items():
        for rec in recs:
            add(rec, link, rec["curve"], True)
    for rec in measured_val:
        add(rec, validate_link, rec["curve"], True)
    return rows


def validation(rows, link):
    """Per scheme on ``link``: the measured time to target over the combined one (seed alike)."""
    out = []
    for m in (r for r in rows if r["link"] == link and r["measured"]):
        comb = next((r for r in rows if r["link"] == link and not r["measured"] and r["scheme"] == m["scheme"]
                     and r["seed"] == m["seed"]), None)
        if comb is None:
            continue
        # the same step of both curves (the measured run may reach the target at another evaluation)
        step = m["curve"][-1]["step"]
        cm = next((p for p in comb["curve"] if p["step"] == step), None)
        ratio = m["curve"][-1]["time_s"] / cm["time_s"] if cm and cm["time_s"] else None
        out.append({"scheme": m["scheme"], "seed": m["seed"], "step": step,
                    "measured_s": m["curve"][-1]["time_s"], "combined_s": cm["time_s"] if cm else None,
                    "ratio": ratio, "within_10pct": ratio is not None and abs(ratio - 1) <= 0.10})
    return out


def append_rows(path, rows, meta):
    old = json.load(open(path)) if os.path.exists(path) else []
    write_json(path, old + rows)
    meta_path = os.path.splitext(path)[0] + ".meta.json"
    runs = json.load(open(meta_path)) if os.path.exists(meta_path) else []
    write_json(meta_path, runs + [meta])


def _cell_key(row):
    """What makes one cell of the table: a model, framework and rank count, a link and a scheme."""
    return row["model"], row["framework"], row["workers"], row["link"], row["scheme"]


def _pick(rows, model, framework, workers, link, scheme):
    """The rows of one cell; where a link has both, the combined ones: every fixed scheme's cell
    on a shaped link then rests on the same step-time measurement (the validation runs are
    compared with them in the run's meta)."""
    sel = [r for r in rows if _cell_key(r) == (model, framework, workers, link, scheme)]
    return [r for r in sel if not r["measured"]] or sel


def time_to(rows, target):
    """(median seconds over the rows' seeds to ``target`` from their curves, seeds reached, seeds)."""
    hits = [first_reach(r["curve"], target) for r in rows]
    got = [h["time_s"] for h in hits if h]
    return (statistics.median(got) if got and len(got) == len(hits) else None), len(got), len(hits)


def speedups(rows):
    """Per (model, framework, ranks, link, scheme): the scheme's median time to its target, and
    ``none``'s and ``hvd_fp16``'s median time to the same target, from their curves on the link."""
    out = []
    for key in sorted({_cell_key(r) for r in rows}, key=str):
        model, fw, workers, link, scheme = key
        mine = _pick(rows, *key)
        target = mine[0]["target"]
        t, hit, n = time_to(mine, target)
        cell = {"model": model, "framework": fw, "workers": workers, "link": link, "link_mbit": mine[0]["link_mbit"],
                "scheme": scheme,
                "target": target, "time_s": t, "reached": hit, "seeds": n,
                "measured": all(r["measured"] for r in mine)}
        for base in ("none", "hvd_fp16"):
            b = _pick(rows, model, fw, workers, link, base)
            tb = time_to(b, target)[0] if b else None
            cell[f"vs_{base}"] = tb / t if t and tb else None
        out.append(cell)
    return out


def markdown(rows):
    """The "time to dense accuracy" table: per link, each scheme's median time to its target and
    its speedup over ``none`` and Horovod fp16 at that target; a missing cell says why."""
    cells = speedups(rows)
    lines = []
    for model, fw, workers in sorted({(c["model"], c["framework"], c["workers"]) for c in cells}):
        mine = [c for c in cells if (c["model"], c["framework"], c["workers"]) == (model, fw, workers)]
        links = [x for x in LINKS if any(c["link"] == x for c in mine)]
        lines += [f"**{fw} {model}, {workers} ranks** ({mine[0]['seeds']} seed(s) where measured; time to target in "
                  "s, speedup vs none / vs Horovod fp16; `m`: measured end to end, `c`: combined from steps x step time)", "",
                  "| scheme | " + " | ".join(f"{x} ({next(c['link_mbit'] for c in mine if c['link'] == x) or '-'} "
                                            "Mbit/s)" for x in links) + " |",
                  "|---|" + "---:|" * len(links)]
        for scheme in dict.fromkeys(c["scheme"] for c in mine):
            row = [f"| {scheme}"]
            for x in links:
                c = next((c for c in mine if c["link"] == x and c["scheme"] == scheme), None)
                row.append(_cell_text(c))
            lines.append(" | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell_text(c):
    if c is None:
        return "not run"
    if c["time_s"] is None:
        return f"not reached ({c['reached']}/{c['seeds']} seeds)"
    f = "-" if c["vs_none"] is None else f"{c['vs_none']:.2f}x"
    g = "-" if c["vs_hvd_fp16"] is None else f"{c['vs_hvd_fp16']:.2f}x"
    return f"{c['time_s']:.1f} s, {f} / {g} ({'m' if c['measured'] else 'c'})"


def plot(rows, path):
    """Accuracy against wall-clock seconds, one panel per link, a colour per scheme (measured:
    solid, combined: dashed), the target of ``none`` as a grey line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter
    links = [x for x in LINKS if any(r["link"] == x for r in rows)]
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(4.5 * len(links), 4), sharey=True, squeeze=False)
    for ax, link in zip(axes[0], links):
        for i, s in enumerate(schemes):
            for j, r in enumerate(r for r in rows if r["link"] == link and r["scheme"] == s):
                ax.plot([p["time_s"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]],
                        "-" if r["measured"] else "--", color=f"C{i % 10}", lw=1, label=s if j == 0 else None)
        mb = next((r["link_mbit"] for r in rows if r["link"] == link), None)
        ax.set_title(f"{link} ({mb} Mbit/s)" if mb else link, fontsize=9)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # a panel spanning less than a decade labels every minor tick
        ax.set_xlabel("training wall-clock [s]")
        ax.grid(alpha=0.3)
        dense = [r["target"] for r in rows if r["scheme"] == "none"]
        if dense:
            ax.axhline(dense[0], color="grey", lw=0.8)
    lo = min((p["accuracy"] for r in rows for p in r["curve"][len(r["curve"]) // 3:]), default=0)
    axes[0][0].set_ylim(lo - 1, None)
    axes[0][0].set_ylabel("held-out accuracy [%]")
    axes[0][-1].legend(fontsize=7)
    r0 = rows[0]
    fig.suptitle(f"bench tta: {r0['framework']} {r0['model']} ({r0['params']} parameters), {r0['workers']} ranks",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def mapping_markdown(runs):
    """The link each run's rows stand for (``<out>.meta.json``): the rate, the ratio reached
    there, the measured compute-only step and latency it was solved with."""
    lines = ["| model | framework | ranks | compute-only step | latency | link | stands for | target ratio | "
             "rate (Mbit/s) | ratio there |", "|---|---|---:|---:|---:|---|---|---:|---:|---:|"]
    for run in runs:
        for link, m in run.get("link_mapping", {}).items():
            rate = "unshaped (none reaches it)" if m["link_mbit"] is None else f"{m['link_mbit']:g}"
            lines.append(f"| {run['model']} | {run['framework']} | {run['workers']} | "
                         f"{run['compute_s'] * 1e3:.0f} ms | {run['latency_s'] * 1e6:.0f} us | {link} | "
                         f"{m['stands_for']} | {m['target_ratio']:.3g} | {rate} | {m['ratio_at_link']:.3g} |")
    return "\n".join(lines)


def _dense_finals(rows, row):
    """The final accuracies of ``rows``' ``none`` runs of ``row``'s model, framework and ranks."""
    return [d["final_accuracy"] for d in rows if d["scheme"] == "none" and d["link"] == "unshaped"
            and _cell_key(d)[:3] == _cell_key(row)[:3]]


def _retarget(row, finals):
    """Hold ``row`` to the target ``finals`` (dense's final accuracies) give its scheme, its reach
    read again from its curve; the target of its own run stays as ``own_target``."""
    row.update({"own_target": row.get("own_target", row["target"]),
                **_reach(row["curve"], dense_target(finals, row["scheme"]))})


def join_rows(rows, new_rows, source=None):
    """``rows`` and the rows of ``new_rows`` for seeds they lack (a cell's other seeds, a scheme
    not run before), every row of the models joined then held to the target of all their ``none``
    rows together: a run in several sittings.  A (cell, seed) ``rows`` has already keeps its row."""
    have = {(_cell_key(r), r["seed"]) for r in rows}
    new = [dict(r, joined_from=source) if source else dict(r) for r in new_rows
           if (_cell_key(r), r["seed"]) not in have]
    if not new:
        raise ValueError("join: every (cell, seed) of the new rows is in the table already")
    models = {_cell_key(r)[:3] for r in new}
    out = [dict(r) if _cell_key(r)[:3] in models else r for r in rows] + new
    for r in out:
        if _cell_key(r)[:3] in models:
            _retarget(r, _dense_finals(out, r))
    return out


def splice_rows(rows, new_rows, schemes=None, keep_targets=False, source=None):
    """``rows`` with ``new_rows`` (only ``schemes``' where given) in place of its rows of the same
    cells: a later run's rows join an earlier run's table.  ``keep_targets``: each spliced row is
    held to the target of ``rows``' own ``none`` rows of its model, framework and ranks (their
    final accuracies on the unshaped link), its reach read again from its curve; the row keeps
    the target of its own run as ``own_target``."""
    wanted = None if schemes is None else set(split_specs(schemes) if isinstance(schemes, str) else schemes)
    sel = [dict(r) for r in new_rows if wanted is None or r["scheme"] in wanted]
    if not sel:
        raise ValueError(f"splice: no row of the schemes {sorted(wanted or [])} to splice")
    cells = {_cell_key(r) for r in sel}
    kept = [r for r in rows if _cell_key(r) not in cells]
    for r in sel:
        if source:
            r["spliced_from"] = source
        if not keep_targets:
            continue
        if r["scheme"] == "none":
            raise ValueError("splice: keep_targets holds rows to the table's own none rows; do not splice none")
        _retarget(r, _dense_finals(kept, r))
    out, placed = [], set()  # each cell where its old rows stood (the plots' colours follow the order)
    for r in rows:
        key = _cell_key(r)
        if key not in cells:
            out.append(r)
        elif key not in placed:
            placed.add(key)
            out += [n for n in sel if _cell_key(n) == key]
    return out + [n for n in sel if _cell_key(n) not in placed]


def main_args(args, command) -> int:
    """``hvd-compress bench tta``: the run (or, with ``--report``, the tables of ``--out``; with
    ``--splice``, another run's rows put into ``--out``)."""
    from ..testing.cluster import ClusterError
    if args.splice:
        with open(args.splice) as f:
            new_rows = json.load(f)
        with open(args.out) as f:
            rows = json.load(f)
        if args.join:
            out = join_rows(rows, new_rows, source=args.splice)
            print(f"{len(out) - len(rows)} rows of {args.splice} joined to {args.out}; its models' targets "
                  "from all their none rows")
        else:
            out = splice_rows(rows, new_rows, args.splice_schemes, args.keep_targets, source=args.splice)
            n = sum(1 for r in out if r.get("spliced_from") == args.splice)
            print(f"{n} rows of {args.splice} put into {args.out} in place of {len(rows) - (len(out) - n)}")
        write_json(args.out, out)
        return 0
    if args.report:
        with open(args.out) as f:
            rows = json.load(f)
        print(markdown(rows))
        meta = os.path.splitext(args.out)[0] + ".meta.json"
        if os.path.exists(meta):
            with open(meta) as f:
                print(mapping_markdown(json.load(f)))
        if args.png:  # the plot of --model, --framework and --workers' rows, drawn again
            mine = [r for r in rows if _cell_key(r)[:3] == (args.model, args.framework, args.workers)]
            if not mine:
                raise ValueError(f"--report --png: {args.out} has no rows of {args.framework} {args.model} "
                                 f"at {args.workers} ranks")
            print(f"plot: {plot(mine, args.png)}")
        return 0
    ranks = "" if args.workers == 4 else f"-np{args.workers}"  # another rank count does not draw over the 4 ranks'
    png = args.png or f"{os.path.splitext(args.out)[0]}-{args.framework}-{args.model}{ranks}.png"
    try:
        rows, meta = run(framework=args.framework, model=args.model, schemes=args.schemes, seeds=args.seeds,
                         links=args.links, stands_for=args.stands_for, workers=args.workers, steps=args.steps,
                         eval_every=args.eval_every, validate_link=args.validate_link,
                         time_steps=args.time_steps, threads=args.threads, prefix=args.prefix,
                         out_json=args.out, out_png=png, validate_schemes=args.validate_schemes,
                         curves_from=args.curves_from, rates_from=args.rates_from,
                         save_curves=args.save_curves, command=command, pin_cores=not args.no_pin_cores)
    except ClusterError as err:
        print(f"hvd-compress bench tta: {err}", file=sys.stderr)
        return 2
    print(markdown(rows))
    for v in meta["validation"]:
        print(f"validation {v['scheme']} seed {v['seed']}: measured {v['measured_s']} s, combined "
              f"{v['combined_s']} s, ratio {v['ratio'] and round(v['ratio'], 3)}")
    return 1 if meta["failures"] else 0
