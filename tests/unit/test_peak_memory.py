"""Aggregating N gathered payloads must not allocate N dense copies.

``scheme.aggregate(B, payloads, numel)`` is what ``decompress`` runs on the
payloads of all ranks (tests/horovod and scripts/measure_memory.py run it under
Horovod).  Here it is measured alone, in this process, with Linux's resident-set
high-water mark: ``/proc/self/clear_refs`` <- ``5`` resets ``VmHWM`` to the
current RSS, so ``VmHWM - VmRSS(before)`` after the call is the most the call
had allocated at once.  Torch's CPU allocator returns every block of this size to
the OS (64 MiB > glibc's 32 MiB mmap threshold), so the numbers are exact to a
page.

* Sparsifiers (Top-K) concatenate all ranks' indices and values and do *one*
  scatter: one dense output, plus O(N k) for the concatenation.
* Quantizers use the generic ``Scheme.aggregate``, which decodes one payload at a
  time and adds it to a running sum: a few dense temporaries (decoded values,
  the product with the scale, the new sum), independent of N.

Asserted: the transient grows by less than one dense copy from N=2 to N=8 and
stays under ``MAX_COPIES`` dense copies.  Torch only (TF's allocator keeps
freed memory, so RSS does not show its transients).
"""
import re
from pathlib import Path

import numpy as np
import pytest

from hvd_compress import schemes as S
from unit_helpers import framework, make_ctx

NUMEL = 16 * 2**20           # 64 MiB fp32: above glibc's mmap threshold
DENSE_MIB = NUMEL * 4 / 2**20
MAX_COPIES = 4.5
CASES = {
    "TopK(0.01)": lambda: S.TopK(0.01),
    "Int8": lambda: S.Int8(),
    "Int8(block_size=4096)": lambda: S.Int8(block_size=4096),
    "EFSignSGD": lambda: S.EFSignSGD(),
    "QSGD(127)": lambda: S.QSGD(127),
}


def _status_mib(field):
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) / 1024.0


@pytest.fixture(scope="module", autouse=True)
def _need_clear_refs():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_mib("VmHWM")
    except (OSError, AttributeError) as e:
        pytest.skip(f"no resettable VmHWM here ({e})")


def _payloads(scheme, n):
    torch = framework("torch").torch
    B = framework("torch").B
    out = []
    for r in range(n):
        x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(r))
        ctx = make_ctx(framework("torch"), lambda k, r=r: torch.rand(k, generator=torch.Generator().manual_seed(99 + r)),
                       rank=r, size=n)
        payload, sent = scheme.encode(B, x, ctx)
        del x, sent
        out.append({k: v for k, v in payload.items() if not k.startswith("_")})
    return B, out


def transient_mib(case, n):
    scheme = CASES[case]()
    B, payloads = _payloads(scheme, n)
    rss = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = scheme.aggregate(B, payloads, NUMEL)
    peak = _status_mib("VmHWM")
    assert tuple(out.shape) == (NUMEL,) and bool(out.isfinite().all())
    del out, payloads
    return peak - rss


@pytest.mark.parametrize("case", list(CASES))
def test_aggregate_does_not_allocate_a_dense_copy_per_rank(case):
    small, large = transient_mib(case, 2), transient_mib(case, 8)
    print(f"{case}: aggregate transient N=2 {small:.0f} MiB ({small / DENSE_MIB:.2f} dense), "
          f"N=8 {large:.0f} MiB ({large / DENSE_MIB:.2f} dense)")
    assert large - small < DENSE_MIB, (case, small, large)
    assert large < MAX_COPIES * DENSE_MIB, (case, large)


def test_the_measurement_sees_a_dense_copy_per_rank():
    """Control: a naive aggregate that decodes every payload first (N dense copies alive at once)
    is caught by the same measurement."""
    scheme = S.Int8()
    B, payloads = _payloads(scheme, 8)
    rss = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    decoded = [scheme.decode_one(B, p, NUMEL) for p in payloads]
    total = sum(decoded[1:], decoded[0])
    peak = _status_mib("VmHWM")
    del decoded, total
    assert peak - rss > 7 * DENSE_MIB, peak - rss
    assert np.isfinite(peak)
