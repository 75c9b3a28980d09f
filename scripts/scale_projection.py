#!/usr/bin/env python
"""Does compression pay at 8 to 256 GPUs?  The one cost model
(hvd_compress/costmodel/model.py, through ``hvd-compress advise``'s functions)
projected to real clusters, and checked against Horovod's published scaling.

    .venv/bin/python scripts/scale_projection.py     # -> docs/results/scale_projection.{json,png}, prints the tables

Grid: N = 8, 16, 32, 64, 128, 256 GPUs (one rank a GPU, one NIC a rank), links
of 1, 10, 25 and 100 Gbit/s, 10 us a ring step; models ResNet-50, BERT-large and
a 1.3B transformer (GPT-3 XL) with the tensors, compute per step and GPU codec
costs of ``hvd_compress/tools/projection.py`` (sources and assumptions in its
docstring); NCCL on GPUs (``cost_model.GPU_NCCL``: no CPU work in the
collective, Horovod's 1 ms cycle).  Per cell, every scheme and transport of
``projection.GPU_SCHEMES`` for the whole model, and the plan that ``advise``
(and ``Auto``) would choose, a scheme per tensor for the fastest step; the best of them, its step time
``compute + communication`` (no overlap: the bound most favourable to
compression) and, as the other bound, ``max(compute, communication)`` (the
communication fully hidden behind the backward pass), its speedups over
``none`` and over Horovod's fp16, and the bytes each rank receives per step.

Published check: Horovod's README ("128 servers with 4 Pascal GPUs each connected
by RoCE-capable 25 Gbit/s network ... 90% scaling efficiency for both Inception V3
and ResNet-101, and 68% scaling efficiency for VGG-16", 512 GPUs).  The model's
efficiency of ``none`` there is ``compute / step`` with ResNet-101's and VGG-16's
tensors written from their architectures and a P100's compute per step from
their forward FLOPs (He et al. 2016, Table 1: ResNet-101 7.6 GFLOPs; VGG-16 15.5
GFLOPs, multiply-adds) x 2 x 3 (forward + backward) x 64 images at 45% of the
P100's 10.6 TFLOP/s fp32 peak -- an assumption, stated with the result.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hvd_compress.costmodel.model import GPU_NCCL  # noqa: E402
from hvd_compress.tools import advise  # noqa: E402
from hvd_compress.tools.projection import (GPU_SCHEMES, MODELS, REFERENCE_LATENCY_S, gpu_codec,  # noqa: E402
                                           resnet_layers, vgg16_layers)

WORKERS = (8, 16, 32, 64, 128, 256)
LINKS_GBIT = (1, 10, 25, 100)
LATENCY_S = REFERENCE_LATENCY_S
PLAN = "plan"

#: Horovod's published scaling (README: 512 Pascal GPUs, 25 Gbit/s)
HOROVOD_PUBLISHED = {"workers": 512, "link_gbit": 25, "efficiency": {"ResNet-101": 0.90, "VGG-16": 0.68},
                     "source": "Horovod README / docs/benchmarks.rst (Sergeev & Del Balso, arXiv:1802.05799)"}
P100_FP32_FLOPS, P100_UTILISATION, BATCH = 10.6e12, 0.45, 64
FORWARD_MACS = {"ResNet-101": 7.6e9, "VGG-16": 15.5e9}


def cell(model, workers, gbit):
    layers = model.layers()
    adv = advise.advise(layers, workers, gbit * 1e9 / 8, LATENCY_S, None, GPU_SCHEMES, 0.1, GPU_NCCL,
                        codec_of=gpu_codec)
    options = {s: (t["total_s"], t["wire_bytes"]) for s, t in adv.totals.items()}
    plan_wire = sum(L["predictions"][L["choice"]].wire_bytes for L in adv.per_layer)
    options[PLAN] = (adv.plan_total_s, plan_wire)
    c = model.compute_s
    step = {s: c + t for s, (t, _) in options.items()}
    hidden = {s: max(c, t) for s, (t, _) in options.items()}
    best = min(step, key=step.get)
    best_hidden = min(hidden, key=hidden.get)
    plan_mix = {}
    for L in adv.per_layer:
        plan_mix[L["choice"]] = plan_mix.get(L["choice"], 0) + L["numel"]
    uniform = min((s for s in step if s != PLAN), key=step.get)
    return {"best_single": uniform, "best_single_step_s": step[uniform],
            "model": model.name, "workers": workers, "link_gbit": gbit, "compute_s": c,
            "comm_s": {s: t for s, (t, _) in options.items()},
            "wire_bytes_per_rank": {s: w for s, (_, w) in options.items()},
            "best": best, "best_step_s": step[best], "best_wire_bytes": options[best][1],
            "speedup_vs_none": step["none"] / step[best], "speedup_vs_fp16": step["hvd_fp16"] / step[best],
            "best_if_hidden": best_hidden,
            "speedup_vs_none_if_hidden": hidden["none"] / hidden[best_hidden],
            "speedup_vs_fp16_if_hidden": hidden["hvd_fp16"] / hidden[best_hidden],
            "none_efficiency": c / step["none"], "plan_elements_by_scheme": plan_mix}


def horovod_check():
    out = {}
    N, gbit = HOROVOD_PUBLISHED["workers"], HOROVOD_PUBLISHED["link_gbit"]
    for name, layers in (("ResNet-101", resnet_layers((3, 4, 23, 3))), ("VGG-16", vgg16_layers())):
        compute = FORWARD_MACS[name] * 2 * 3 * BATCH / (P100_FP32_FLOPS * P100_UTILISATION)
        adv = advise.advise(layers, N, gbit * 1e9 / 8, LATENCY_S, None, ["none"], 0.1, GPU_NCCL, codec_of=gpu_codec)
        comm = adv.totals["none"]["total_s"]
        published = HOROVOD_PUBLISHED["efficiency"][name]
        # the compute a step would need for the no-overlap bound to equal the published efficiency
        matching = published / (1 - published) * comm
        out[name] = {"params": sum(L[1] for L in layers), "compute_s": compute, "comm_s": comm,
                     "efficiency_no_overlap": compute / (compute + comm),
                     "efficiency_full_overlap": compute / max(compute, comm),
                     "published_efficiency": published,
                     "utilisation_matching_published_without_overlap":
                         FORWARD_MACS[name] * 2 * 3 * BATCH / (P100_FP32_FLOPS * matching)}
    return out


def label(s):
    return s.replace("/two_phase", " 2-phase")


def describe(c):
    """A cell's best choice; a plan with the schemes that carry at least 5%
    of the elements, largest first."""
    if c["best"] != PLAN:
        return label(c["best"])
    mix = c["plan_elements_by_scheme"]
    total = sum(mix.values())
    parts = [f"{label(s)} {100 * n / total:.0f}%" for s, n in sorted(mix.items(), key=lambda kv: -kv[1])
             if n >= 0.05 * total]
    return "plan (" + ", ".join(parts) + ")"


def range_table(title, cells, text_of):
    """Markdown lines: ``title``, then a row per model and a column per link, each cell
    ``text_of(the cells of that model and link)``."""
    lines = [title, "", "| model | " + " | ".join(f"{g} Gbit/s" for g in LINKS_GBIT) + " |",
             "|---|" + "---|" * len(LINKS_GBIT)]
    for model in MODELS.values():
        row = [f"| {model.name} "]
        for g in LINKS_GBIT:
            row.append(text_of([c for c in cells if c["model"] == model.name and c["link_gbit"] == g]))
        lines.append(" | ".join(row) + " |")
    return lines


def tables(cells, check):
    lines = ["Per cell: the best choice (`plan`: a scheme and transport per tensor for the fastest step, as "
             "`advise` and `Auto` choose, with the schemes that carry at least 5% of the elements), its step speedup over `none` / over Horovod fp16 with no overlap of communication and "
             "backward pass, the same with communication fully hidden behind compute (`hidden`), and the MB each "
             "rank receives per step.", ""]
    for model in MODELS.values():
        rows = [c for c in cells if c["model"] == model.name]
        lines += [f"**{model.name}** ({model.params / 1e6:.1f}M parameters, compute {1e3 * model.compute_s:.0f} ms "
                  f"a step: {model.compute_source}).", "",
                  "| N | " + " | ".join(f"{g} Gbit/s" for g in LINKS_GBIT) + " |",
                  "|---:|" + "---|" * len(LINKS_GBIT)]
        for n in WORKERS:
            row = [f"| {n} "]
            for g in LINKS_GBIT:
                c = next(x for x in rows if x["workers"] == n and x["link_gbit"] == g)
                row.append(f"{describe(c)} {c['speedup_vs_none']:.2f}x / {c['speedup_vs_fp16']:.2f}x "
                           f"(hidden {c['speedup_vs_none_if_hidden']:.2f}x / {c['speedup_vs_fp16_if_hidden']:.2f}x), "
                           f"{c['best_wire_bytes'] / 1e6:.0f} MB")
            lines.append(" | ".join(row) + " |")
        lines.append("")
    def no_overlap_and_hidden(cs):
        a = [c["speedup_vs_none"] for c in cs]
        h = [c["speedup_vs_none_if_hidden"] for c in cs]
        return f"{min(a):.2f}-{max(a):.2f}x ({min(h):.2f}-{max(h):.2f}x)"
    lines += range_table("Ranges over N = 8..256: speedup of the best choice over `none`, no overlap (communication "
                         "hidden):", cells, no_overlap_and_hidden)
    wins, gains = {}, []
    for c in cells:
        wins[label(c["best"])] = wins.get(label(c["best"]), 0) + 1
        wins_single = label(c["best_single"])
        gains.append((c["best_single_step_s"] / c["best_step_s"], wins_single))
    singles = {}
    for _, s in gains:
        singles[s] = singles.get(s, 0) + 1
    lines += ["", "Best choice, cells won: " + ", ".join(f"{k} {v}" for k, v in sorted(wins.items(), key=lambda kv: -kv[1]))
              + f" (of {len(cells)}). The best single scheme for every tensor: "
              + ", ".join(f"{k} {v}" for k, v in sorted(singles.items(), key=lambda kv: -kv[1]))
              + f"; the plan's step is {min(g for g, _ in gains):.2f}-{max(g for g, _ in gains):.2f}x as fast "
              "as the best single scheme's.", ""]
    lines += ["Horovod's published scaling at 512 GPUs, 25 Gbit/s, against the model's `none`:", "",
              "| model | parameters | compute (assumed) | comm (model) | efficiency, no overlap | full overlap | "
              "published | P100 use at which no overlap = published |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in check.items():
        lines.append(f"| {name} | {r['params'] / 1e6:.1f}M | {1e3 * r['compute_s']:.0f} ms | {1e3 * r['comm_s']:.0f} ms | "
                     f"{100 * r['efficiency_no_overlap']:.0f}% | {100 * r['efficiency_full_overlap']:.0f}% | "
                     f"{100 * r['published_efficiency']:.0f}% | "
                     f"{100 * r['utilisation_matching_published_without_overlap']:.0f}% of peak |")
    return "\n".join(lines)


def plot(cells, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4), sharey=True)
    for ax, model in zip(axes, MODELS.values()):
        for g in LINKS_GBIT:
            rows = sorted((c for c in cells if c["model"] == model.name and c["link_gbit"] == g),
                          key=lambda c: c["workers"])
            ax.plot([c["workers"] for c in rows], [c["speedup_vs_none"] for c in rows], marker="o",
                    label=f"{g} Gbit/s, no overlap")
            ax.plot([c["workers"] for c in rows], [c["speedup_vs_none_if_hidden"] for c in rows], ls="--",
                    color=ax.lines[-1].get_color(), label=f"{g} Gbit/s, comm hidden")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(model.name)
        ax.set_xlabel("GPUs")
    axes[0].set_ylabel("step speedup of the best choice over none")
    axes[-1].legend(fontsize=7)
    fig.suptitle("scripts/scale_projection.py: the cost model projected (GPU codec from memory bandwidth, NCCL)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "scale_projection.json"))
    a = p.parse_args(argv)
    cells = [cell(m, n, g) for m in MODELS.values() for n in WORKERS for g in LINKS_GBIT]
    check = horovod_check()
    with open(a.out, "w") as f:
        json.dump({"command": "scripts/scale_projection.py", "latency_s": LATENCY_S, "schemes": GPU_SCHEMES,
                   "models": {k: {"name": m.name, "params": m.params, "compute_s": m.compute_s,
                                  "compute_source": m.compute_source} for k, m in MODELS.items()},
                   "cells": cells, "horovod_published": HOROVOD_PUBLISHED, "horovod_check": check,
                   "p100_assumption": {"fp32_flops": P100_FP32_FLOPS, "utilisation": P100_UTILISATION,
                                       "batch": BATCH, "forward_macs": FORWARD_MACS}}, f, indent=1)
    plot(cells, os.path.splitext(a.out)[0] + ".png")
    print(tables(cells, check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
