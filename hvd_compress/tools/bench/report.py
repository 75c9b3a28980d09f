"""Terminal output shared by the benchmarks: a progress line per finished
item (with an ETA) and fixed-width tables."""
from __future__ import annotations

import json
import math
import os
import sys
import time


def human_count(n: int) -> str:
    """16000000 -> '16M', 1048576 -> '1.05M', 2_000_000 -> '2M', 999562 -> '1M'."""
    for div, suf in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if n >= div * 0.9995:
            return f"{n / div:.3g}{suf}"
    return str(n)


def human_bytes(b) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "-"
    for div, suf in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(b) >= div:
            return f"{b / div:.3g} {suf}"
    return f"{b:.0f} B"


def human_seconds(s) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s >= 100:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


class Progress:
    """``[ 3/42 7%] <label> <result>  (elapsed 1m02s, eta ~3m10s)`` per item, on stderr."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total = max(int(total), 1)
        self.done = 0
        self.t0 = time.monotonic()
        self.stream = stream or sys.stderr
        self.enabled = enabled

    @staticmethod
    def _fmt(s):
        s = int(round(s))
        return f"{s // 60}m{s % 60:02d}s"

    def step(self, label: str, result: str = "", weight_done: float = None):
        self.done += 1
        if not self.enabled:
            return
        el = time.monotonic() - self.t0
        frac = self.done / self.total if weight_done is None else weight_done
        eta = el / frac * (1 - frac) if frac > 0 else float("nan")
        w = len(str(self.total))
        print(f"[{self.done:>{w}}/{self.total} {100 * frac:3.0f}%] {label} {result}  "
              f"(elapsed {self._fmt(el)}, eta ~{self._fmt(eta) if eta == eta else '?'})",
              file=self.stream, flush=True)

    def note(self, text: str):
        if self.enabled:
            print(text, file=self.stream, flush=True)


def table(rows, columns, title=None) -> str:
    """``columns``: list of (header, function(row) -> str, align '<' or '>')."""
    cells = [[h for h, _, _ in columns]] + [[str(f(r)) for _, f, _ in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = []
    if title:
        lines.append(title)
    for j, c in enumerate(cells):
        lines.append("  ".join(f"{v:{a}{w}}" for v, w, (_, _, a) in zip(c, widths, columns)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path, rows):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def git_describe():
    """Short commit (and '-dirty') of the repository holding this package, or None."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        c = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        if c.returncode != 0:
            return None
        d = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10)
        return c.stdout.strip() + ("-dirty" if d.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None
