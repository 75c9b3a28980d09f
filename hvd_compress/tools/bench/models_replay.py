"""Replay ``Auto``'s decision of a ``bench models`` run offline, against the
fixed schemes measured in the same run.

Each ``Auto`` row keeps what its planner saw (``auto_state``, in
``<stem>_auto_state.json`` beside the rows: the tensors, the codec seconds
averaged over ranks, the fitted link, the backward span, the host, the
plan).  For the plan Auto adopted and for each fixed scheme it may choose,
applied to every tensor it can carry, the cost model's
predicted communication seconds a step (:func:`hvd_compress.auto.planner.predicted_total`)
stand beside the measured median step.  Compute is the same in every row,
so the differences from ``none`` compare: where the predicted and the
measured differences disagree in sign or by far more than the noise, a
term of the model is wrong for that case.

    .venv/bin/python -m hvd_compress.tools.bench.models_replay docs/results/models.json
"""
from __future__ import annotations

import argparse
import json

from .report import table

#: Horovod's own schemes as Auto's candidate labels
HOROVOD_AS_CANDIDATE = {"none": "none", "hvd_fp16": "FP16"}


def candidate_label(fixed_spec, labels):
    """The label of the candidate that runs ``fixed_spec`` (None where Auto has none)."""
    label = HOROVOD_AS_CANDIDATE.get(fixed_spec, fixed_spec.replace(" ", ""))
    return label if label in labels else None


def replay(auto_row, same_run):
    """Rows ``{plan, measured_step_s, predicted_comm_s}``: Auto's adopted plan
    (``plan``: ``"Auto"``) and each fixed scheme of ``same_run`` it may
    choose, every tensor it can carry under that scheme and the rest dense."""
    from hvd_compress.auto.planner import Choice, predicted_total, tensor_options
    from hvd_compress.costmodel.model import Link, Machine
    from .specs import parse_spec
    saved, workers = auto_row["auto_state"], auto_row["workers"]
    candidates = parse_spec(auto_row["scheme"]).candidates
    labels = [c.label for c in candidates]
    if labels != saved["candidates"]:
        raise ValueError(f"{auto_row['scheme']} has the candidates {labels}, its saved state {saved['candidates']}")
    tensors = {k: (n, tuple(s)) for k, (n, s) in saved["tensors"].items()}
    codec_s = {k: {label: v for label, v in zip(labels, row) if v is not None} for k, row in saved["codec_s"].items()}
    link, machine = Link(*saved["link"]), Machine(**saved["machine"])

    def predicted(label_of):
        choices = {k: Choice(label_of(k), 0.0, 0.0, None) for k in tensors}
        return predicted_total(choices, tensors, workers, link, candidates, codec_s, machine, saved["backward_s"])

    def uniform(label):
        def label_of(key):
            opts = tensor_options(*tensors[key], workers, link, candidates, codec_s.get(key, {}), machine)
            return label if label in opts else "none"
        return label_of
    rows = [{"plan": "Auto", "measured_step_s": auto_row["median_step_s"],
             "predicted_comm_s": predicted(lambda k: saved["plan"].get(k, "none"))}]
    for fixed in same_run:
        label = candidate_label(fixed["scheme"], labels)
        if label is not None:
            rows.append({"plan": fixed["scheme"], "measured_step_s": fixed["median_step_s"],
                         "predicted_comm_s": predicted(uniform(label))})
    return rows


def replay_file(path):
    """(title, rows) for every Auto row of a models.json whose planner inputs
    were kept (``<stem>_auto_state.json`` beside it)."""
    import os
    from ..recipes import is_auto_spec
    from .models_bench import auto_state_path, row_key
    with open(path) as f:
        rows = json.load(f)
    states = {}
    if os.path.exists(auto_state_path(path)):
        with open(auto_state_path(path)) as f:
            states = json.load(f)
    for r in rows:
        if row_key(r) in states:
            r["auto_state"] = states[row_key(r)]
    key = ("model", "size", "framework", "workers", "link_mbit")
    out = []
    for auto in rows:
        if not auto.get("auto_state") or not auto.get("auto_state", {}).get("link"):
            continue
        same = [r for r in rows if r is not auto and "median_step_s" in r and not is_auto_spec(r["scheme"])
                and all(r.get(k) == auto.get(k) for k in key)]
        title = " ".join(f"{k}={auto.get(k)}" for k in key) + f" {auto['scheme']}"
        out.append((title, replay(auto, same)))
    return out


def format_replay(rows):
    """Measured and predicted, each against the ``none`` row's."""
    none = next((r for r in rows if r["plan"] == "none"), None)

    def minus_none(r, field):
        return "-" if none is None else f"{r[field] - none[field]:+.3f}"
    cols = [("plan", lambda r: r["plan"], "<"), ("measured step s", lambda r: f"{r['measured_step_s']:.3f}", ">"),
            ("measured - none", lambda r: minus_none(r, "measured_step_s"), ">"),
            ("predicted comm s", lambda r: f"{r['predicted_comm_s']:.3f}", ">"),
            ("predicted - none", lambda r: minus_none(r, "predicted_comm_s"), ">")]
    return table(rows, cols)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a models.json with Auto rows that kept auto_state")
    a = ap.parse_args(argv)
    for title, rows in replay_file(a.path):
        print(title)
        print(format_replay(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
