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


#: Above this many bytes of names and shapes only the digest travels (the
#: error then says that the sets differ, not which parameter).
MAX_LISTED_PARAMS_BYTES = 1 << 20


def describe_side(comp, params, size):
    """``params``: list of (name, shape).  Returns JSON bytes.

    The parameter list itself travels (up to :data:`MAX_LISTED_PARAMS_BYTES`)
    so that a mismatch can name the parameter; only its digest is compared."""
    plist = sorted((str(n), [int(d) for d in s]) for n, s in params)
    listed = json.dumps(plist)
    digest = hashlib.blake2b(listed.encode(), digest_size=8).hexdigest()
    side = {"compression": comp.config(), "parameters": {"count": len(plist), "digest": digest},
            "world_size": size}
    if len(listed) <= MAX_LISTED_PARAMS_BYTES:
        side["_parameter_list"] = plist
    return json.dumps(side, sort_keys=True, default=str).encode()


def _parameter_differences(sides):
    """Human-readable differences of the ranks' parameter lists against rank 0's."""
    lists = [s.get("_parameter_list") for s in sides]
    if any(lst is None for lst in lists):
        return []
    ref = {n: tuple(sh) for n, sh in lists[0]}
    out = []
    for r, lst in enumerate(lists[1:], start=1):
        mine = {n: tuple(sh) for n, sh in lst}
        extra = sorted(set(mine) - set(ref))
        missing = sorted(set(ref) - set(mine))
        shapes = sorted(n for n in set(mine) & set(ref) if mine[n] != ref[n])
        if extra:
            out.append(f"rank {r} has parameters rank 0 lacks: {', '.join(extra[:10])}"
                       + (f" (+{len(extra) - 10} more)" if len(extra) > 10 else ""))
        if missing:
            out.append(f"rank {r} lacks parameters rank 0 has: {', '.join(missing[:10])}"
                       + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
        for n in shapes[:10]:
            out.append(f"parameter {n} has shape {list(ref[n])} on rank 0 and {list(mine[n])} on rank {r}")
    return out


def compare(blobs):
    """Raise ConfigMismatchError if the per-rank JSON blobs differ."""
    sides = [json.loads(bytes(b).decode()) for b in blobs]
    public = [{k: v for k, v in s.items() if not k.startswith("_")} for s in sides]
    if all(s == public[0] for s in public[1:]):
        return
    diffs = []
    for field in sorted(set().union(*[s.keys() for s in public])):
        values = [s.get(field) for s in public]
        if any(v != values[0] for v in values[1:]):
            shown = "; ".join(f"rank {r}: {json.dumps(v, sort_keys=True, default=str)}" for r, v in enumerate(values))
            detail = _parameter_differences(sides) if field == "parameters" else []
            diffs.append(f"{field} differs -- {shown}" + (" (" + "; ".join(detail) + ")" if detail else ""))
    raise ConfigMismatchError("hvd_compress configuration mismatch across ranks (every rank must build the same "
                              "compressor and parameter set): " + " | ".join(diffs))
