"""Per-tensor byte counters: what each step hands to Horovod's collectives
versus what dense fp32 would have cost."""
from __future__ import annotations


def _value(v):
    if hasattr(v, "numpy"):  # a tf.Variable updated inside the graph
        return int(v.numpy())
    return int(v)


class CompressionStats:
    """``stats.per_tensor()`` -> {key: {"payload_bytes", "dense_fp32_bytes",
    "calls", "scheme"}} for the latest call of each tensor;
    ``stats.totals()`` sums the latest step over tensors and gives the ratio.
    Counts every byte handed to a collective, placeholders and lengths included.
    """

    def __init__(self):
        self._latest = {}
        self._calls = {}
        self._lost = {"ranks": 0, "tensors": 0, "sumsq": 0.0}

    def record(self, key, scheme, dense_fp32_bytes, payload_bytes, calls=None):
        """One communication of ``key``.  In eager frameworks each call of this
        is one communication.  Graph frameworks call it once per *trace* (and,
        under a schedule, once per traced branch), so they pass live values
        instead: ``payload_bytes`` and ``calls`` as variables the graph updates
        when it runs, and ``scheme`` as a function that names the scheme of the
        branch that ran last."""
        self._latest[key] = (scheme, int(dense_fp32_bytes), payload_bytes, calls)
        self._calls[key] = self._calls.get(key, 0) + 1

    def per_tensor(self):
        return {k: {"scheme": s() if callable(s) else s, "dense_fp32_bytes": d, "payload_bytes": _value(p),
                    "calls": self._calls.get(k, 0) if c is None else _value(c)}
                for k, (s, d, p, c) in self._latest.items()}

    def totals(self):
        rows = self.per_tensor().values()
        dense = sum(r["dense_fp32_bytes"] for r in rows)
        payload = sum(r["payload_bytes"] for r in rows)
        return {"tensors": len(rows), "dense_fp32_bytes": dense, "payload_bytes": payload,
                "ratio": (dense / payload) if payload else float("nan")}

    def record_lost(self, ranks, tensors, sumsq):
        """Elastic Horovod: ``ranks`` left holding ``tensors`` error-feedback
        residuals of squared norm ``sumsq`` (see :mod:`hvd_compress.integration.elastic`)."""
        self._lost["ranks"] += int(ranks)
        self._lost["tensors"] += int(tensors)
        self._lost["sumsq"] += float(sumsq)

    def lost(self):
        """What departed ranks took with them so far: {"ranks", "tensors",
        "norm"} (the norm of all their residuals together)."""
        return {"ranks": self._lost["ranks"], "tensors": self._lost["tensors"],
                "norm": self._lost["sumsq"] ** 0.5}

    def reset(self):
        self._latest.clear()
        self._calls.clear()
