"""Saving and loading :class:`hvd_compress.Auto`'s plan: the tensors seen,
the call counters, the fitted link, the measured costs and the history of
plans, as the JSON that ``state_dict()`` carries."""
from __future__ import annotations

from dataclasses import astuple

from .planner import Choice, Link


def plan_state(auto):
    """The Python side of ``auto``'s plan as plain JSON-ready data (what
    :meth:`hvd_compress.Auto.state_dict` saves)."""
    return {"tensors": {k: [n, list(s)] for k, (n, s) in auto.tensors.items()}, "calls": auto._calls,
            "next_check": auto._next_check, "step_s": auto.step_s, "codec_s": auto.codec_s,
            "link": None if auto.link is None else [auto.link.latency_s, auto.link.bytes_per_s],
            "early_link": None if auto.early_link is None else [auto.early_link.latency_s,
                                                                auto.early_link.bytes_per_s],
            "provisional": auto.provisional,
            "history": [[start, {k: list(astuple(c)) for k, c in ch.items()}, v] for start, ch, v in auto.history]}


def load_plan(auto, saved):
    """Restore into ``auto`` the plan :func:`plan_state` returned."""
    auto.tensors = {k: (n, tuple(s)) for k, (n, s) in saved["tensors"].items()}
    auto._calls, auto._next_check = dict(saved["calls"]), saved["next_check"]
    auto.step_s, auto.codec_s = saved["step_s"], saved["codec_s"]
    auto.link = None if saved["link"] is None else Link(*saved["link"])
    early = saved.get("early_link")
    auto.early_link = None if early is None else Link(*early)
    auto.provisional = dict(saved.get("provisional", {}))
    auto.history = [(start, {k: Choice(*c) for k, c in ch.items()}, v) for start, ch, v in saved["history"]]
