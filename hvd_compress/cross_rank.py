"""Names and hashes that come out the same on every rank.

Every layer needs them: the transports name their side collectives with
:func:`collective_name`, the adapters and ``Auto`` seed and check with
:func:`stable_hash`, and :class:`~hvd_compress.Compressor` fingerprints its
configuration with it.  This module imports nothing of the package, so any
layer may import it.
"""
from __future__ import annotations

import functools
import hashlib
import re

_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def collective_name(key, part):
    """Deterministic, TF-op-safe name for a side collective, distinct for
    distinct keys: where making the key op-safe changed it (``a/b:0`` and
    ``a_b:0`` would both read ``a_b_0``), a short hash of the exact key follows."""
    safe = _SAFE.sub("_", key)
    if safe != key:
        safe += "-h" + hashlib.blake2b(key.encode(), digest_size=4).hexdigest()
    return "hvdc." + safe + "." + part.replace(".", "_")


@functools.lru_cache(maxsize=1 << 14, typed=True)  # per tensor and call: seeds of the same few keys
def stable_hash(*parts):
    """A 63-bit integer from strings/ints, identical on every process
    (Python's hash() is salted per process).  ``typed``: ``1`` and ``1.0``
    print differently, so they are different inputs."""
    h = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF
