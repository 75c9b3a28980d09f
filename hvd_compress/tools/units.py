"""Parsers of the quantities the tools take on the command line: parameter
counts (``16M``, ``1Mi``) and link rates (``100mbit``, ``1gbit``).

Kept apart from the benchmarks and the emulated cluster so that ``advise``,
``bench`` and ``testing.cluster`` share one parser without importing each
other.  Standard library only: ``testing/cluster.py``, run by path as a script,
loads this file directly.
"""
from __future__ import annotations

import re
from typing import Optional, Union

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_count(text) -> int:
    """'16M' -> 16_000_000, '1Mi' -> 1_048_576, '110e6' -> 110_000_000, 4096 -> 4096.
    (Decimal suffixes, as parameter counts are quoted; ``Ki/Mi/Gi`` for powers of two.)"""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmg]i?)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"cannot parse a count from {text!r} (use e.g. 4096, 1M, 16M, 1Mi, 110e6)")
    return int(round(float(m.group(1)) * _SUFFIX[m.group(2) or ""]))


def parse_counts(text) -> list:
    """Comma-separated counts: '1M,16M' -> [1_000_000, 16_000_000]."""
    return [parse_count(t) for t in str(text).split(",") if t.strip()]


def parse_rate(text: Union[str, float, int, None]) -> Optional[float]:
    """'100mbit' -> 100.0, '1gbit' -> 1000.0, '500kbit' -> 0.5, '100' -> 100.0 (Mbit/s);
    None, 'none', 'off', 'unshaped' -> None."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ValueError(f"rate must be positive, got {text}")
        return float(text)
    t = text.strip().lower()
    if t in ("", "none", "off", "unshaped", "0"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(gbit|mbit|kbit|g|m|k)?(?:/s|ps)?", t)
    if not m:
        raise ValueError(f"cannot parse rate {text!r} (use e.g. 100mbit, 1gbit, none)")
    value, unit = float(m.group(1)), (m.group(2) or "mbit")[0]
    rate = value * {"g": 1000.0, "m": 1.0, "k": 0.001}[unit]
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {text!r}")
    return rate
