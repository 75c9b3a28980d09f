"""Markdown summary of bench results against their targets::

    python -m hvd_compress.tools.bench.summary docs/results/micro.json docs/results/e2e.json

Prints the micro table at 16M elements, the e2e table and a target-by-target
verdict (met / NOT met, with the measured number).  Nothing is tuned: the
numbers are read from the JSON files as they are.
"""
from __future__ import annotations

import json
import sys

from .micro import allocator_of
from .report import human_bytes, human_count, human_seconds

MICRO_TARGET_NUMEL = 16_000_000
TARGET_SCHEME = "TopK(0.01)"


def _rate(r):
    return "unshaped" if r is None else f"{r:g} Mbit/s"


def micro_markdown(rows, numel=MICRO_TARGET_NUMEL):
    from .micro import target_of
    out = []
    for fw, al in sorted({(r["framework"], allocator_of(r)) for r in rows}):
        sub = [r for r in rows if r["framework"] == fw and allocator_of(r) == al]
        sizes = sorted({r["numel"] for r in sub})
        schemes = list(dict.fromkeys(r["scheme"] for r in sub))
        thr = sub[0].get("threads")
        out += [f"**{fw}**, {sub[0]['device']}, {thr} thread(s), malloc `{al}`: encode + error feedback + decode "
                f"as multiples of `dst.copy_(src)` (copy time in the header)", "",
                "| scheme | " + " | ".join(
                    f"{human_count(n)} (copy {human_seconds(_copy(sub, n))})" for n in sizes)
                + " | payload / fp32 | target at 16M |",
                "|---|" + "---:|" * len(sizes) + "---:|---|"]
        for s in schemes:
            cells, verdict, frac = [], "", None
            for n in sizes:
                m = [r for r in sub if r["scheme"] == s and r["numel"] == n]
                if not m:
                    cells.append("-")
                    continue
                r = m[0]
                cells.append(f"{r['ratio_to_copy']:.1f}x ({human_seconds(r['encode_decode_s'])})")
                frac = r["payload_bytes"] / r["dense_fp32_bytes"]
                t = target_of(r)
                if n == numel and t is not None:
                    verdict = f"<= {t:g}x: {'met' if r['ratio_to_copy'] <= t else '**NOT met**'}"
            out.append(f"| {s} | " + " | ".join(cells) + f" | {100 * frac:.3g}% | {verdict} |")
        out.append("")
    return "\n".join(out)


def _copy(sub, n):
    m = [r["copy_s"] for r in sub if r["numel"] == n]
    return sorted(m)[len(m) // 2] if m else None


def e2e_markdown(rows):
    def f2(v):
        return "-" if v is None else f"{v:.2f}"
    r0 = rows[0]
    out = [f"{r0['framework']} {r0['model']}, {human_count(r0['model_params'])} parameters, {r0['workers']} workers "
           f"on {r0['hosts']} hosts, batch {r0['batch']}, {r0['threads']} thread(s) per rank, "
           f"{r0.get('controller', 'gloo')}", "",
           f"glibc malloc: {allocator_of(r0)}", "",
           "| link (measured goodput) | scheme | median step | compute | vs none | vs hvd fp16 | byte-limited "
           "ceiling | of ceiling | payload/step | wire/step | wire/payload | Horovod idle traffic | "
           "(wire - idle)/payload | load avg |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        meas = r.get("link_measured_mbit")
        link = _rate(r["link_mbit"]) + (f" ({meas:.0f})" if meas else "")
        out.append(f"| {link} | {r['scheme']} | {human_seconds(r['median_step_s'])} | "
                   f"{human_seconds(r.get('compute_s'))} | {f2(r.get('speedup_vs_none'))} | "
                   f"{f2(r.get('speedup_vs_hvd_fp16'))} | {f2(r.get('ceiling_speedup'))} | "
                   f"{_percent(r.get('ceiling_fraction'))} | {human_bytes(r['payload_bytes_per_step'])} | "
                   f"{human_bytes(r.get('wire_bytes_per_step'))} | {f2(r.get('wire_to_payload'))} | "
                   f"{human_bytes(r.get('idle_wire_bytes_per_s'))}/s | "
                   f"{f2(r.get('wire_minus_control_to_payload'))} | "
                   f"{_load(r)} |")
    return "\n".join(out)


def _percent(v):
    return "-" if v is None else f"{v:.0%}"


def _load(r):
    v = r.get("loadavg_1m_before")
    return "-" if v is None else f"{v:.1f}"


def verdicts(micro_rows, e2e_rows):
    """[(target, measured, met)] for the bench micro and e2e targets and the Auto rows."""
    out = []

    def row(scheme, rate):
        m = [r for r in e2e_rows if r["scheme"] == scheme and r["link_mbit"] == rate]
        return m[0] if m else None

    for rate, want in ((100.0, 22.0), (1000.0, 3.5), (None, 1.4)):
        r = row(TARGET_SCHEME, rate)
        if r and r.get("speedup_vs_none") is not None:
            v = r["speedup_vs_none"]
            out.append((f"e2e {TARGET_SCHEME} vs none >= {want:g}x at {_rate(rate)}", f"{v:.2f}x", v >= want))
    r = row(TARGET_SCHEME, 100.0)
    if r and r.get("speedup_vs_hvd_fp16") is not None:
        v = r["speedup_vs_hvd_fp16"]
        out.append((f"e2e {TARGET_SCHEME} vs Horovod fp16 >= 11x at 100 Mbit/s", f"{v:.2f}x", v >= 11))
    out += auto_verdicts(e2e_rows)
    from .micro import target_of
    for r in micro_rows or []:
        t = target_of(r)
        if t is not None:
            out.append((f"micro 16M, 1 thread, {r['framework']}: {r['scheme']} <= {t:g}x copy",
                        f"{r['ratio_to_copy']:.1f}x", r["ratio_to_copy"] <= t))
    for r in micro_rows or []:
        ref = [h for h in micro_rows or [] if h["scheme"] == "hvd_fp16" and h["framework"] == r["framework"]
               and h["numel"] == r["numel"] and allocator_of(h) == allocator_of(r)]
        if r["scheme"] == "FP16" and ref and target_of(r) is not None:
            out.append((f"micro 16M, {r['framework']}: FP16 not slower than Horovod's fp16",
                        f"{r['encode_decode_s'] / ref[0]['encode_decode_s']:.2f}x its time",
                        r["encode_decode_s"] <= ref[0]["encode_decode_s"]))
    return out


def auto_verdicts(e2e_rows, auto="Auto()"):
    """The targets of the ``Auto()`` rows: against ``none`` and the
    best fixed scheme measured at the same link in the same run."""
    out = []
    wants = {None: 0.95, 1000.0: 0.9, 100.0: 0.9}
    for rate, want in wants.items():
        same = [r for r in e2e_rows if r["link_mbit"] == rate]
        a = next((r for r in same if r["scheme"] == auto), None)
        fixed = [r for r in same if r["scheme"] not in (auto, "none", "hvd_fp16")]
        if a is None or not fixed:
            continue
        best = min(fixed, key=lambda r: r["median_step_s"])
        v = best["median_step_s"] / a["median_step_s"]
        out.append((f"e2e {auto} >= {want:g}x the best fixed scheme ({best['scheme']}) at {_rate(rate)}",
                    f"{v:.2f}x", v >= want))
        if rate is None and a.get("speedup_vs_none") is not None:
            out.append((f"e2e {auto} >= 0.97x none at {_rate(rate)}", f"{a['speedup_vs_none']:.2f}x",
                        a["speedup_vs_none"] >= 0.97))
    return out


def verdict_markdown(v):
    lines = ["| target | measured | |", "|---|---:|---|"]
    for what, meas, ok in v:
        lines.append(f"| {what} | {meas} | {'met' if ok else '**NOT met**'} |")
    met = sum(1 for _, _, ok in v if ok)
    lines.append("")
    lines.append(f"{met} of {len(v)} targets met.")
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        micro_rows = json.load(f)
    with open(argv[1]) as f:
        e2e_rows = json.load(f)
    from .e2e import _add_speedups
    _add_speedups(e2e_rows)  # rows written before a field existed get it (ceiling_*)
    print("### bench micro\n")
    print(micro_markdown(micro_rows))
    print("### bench e2e\n")
    print(e2e_markdown(e2e_rows))
    print("\n### Targets\n")
    print(verdict_markdown(verdicts(micro_rows, e2e_rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
