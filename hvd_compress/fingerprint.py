"""Cross-rank configuration check.

Ranks that disagree on the scheme, its ratio, the seed, the policy or the set
of parameters would exchange payloads of different shapes or meanings: at
best a hang, at worst a silently wrong average.  At the first exchange of
each compressor every rank allgathers a short JSON description of its side
(configuration + a digest of the parameter names and shapes) under one fixed
collective name, compares all of them, and raises
:class:`ConfigMismatchError` on every rank, naming the fields that differ.
"""
from __future__ import annotations

import hashlib
import json


class ConfigMismatchError(ValueError):
    pass


def describe_side(comp, params, size):
    """``params``: list of (name, shape).  Returns JSON bytes."""
    plist = sorted((str(n), [int(d) for d in s]) for n, s in params)
    digest = hashlib.blake2b(json.dumps(plist).encode(), digest_size=8).hexdigest()
    return json.dumps({"compression": comp.config(), "parameters": {"count": len(plist), "digest": digest},
                       "world_size": size}, sort_keys=True, default=str).encode()


def compare(blobs):
    """Raise ConfigMismatchError if the per-rank JSON blobs differ."""
    sides = [json.loads(bytes(b).decode()) for b in blobs]
    if all(s == sides[0] for s in sides[1:]):
        return
    diffs = []
    for field in sorted(set().union(*[s.keys() for s in sides])):
        values = [s.get(field) for s in sides]
        if any(v != values[0] for v in values[1:]):
            shown = "; ".join(f"rank {r}: {json.dumps(v, sort_keys=True, default=str)}" for r, v in enumerate(values))
            diffs.append(f"{field} differs -- {shown}")
    raise ConfigMismatchError("hvd_compress configuration mismatch across ranks (every rank must build the same "
                              "compressor and parameter set): " + " | ".join(diffs))
