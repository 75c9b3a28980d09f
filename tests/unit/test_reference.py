"""``reference.simulate`` (the integration tests' oracle) against the library
driven by hand: per rank, ``encode_with_residual`` with the torch backend; per
step, the scheme's aggregation and the compressor's op scaling -- so the
oracle's error-feedback loop, byte counts and op handling are themselves
checked before multi-process tests rely on them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import reference as R
from hvd_compress.backend import TorchBackend
from hvd_compress.compressor import encode_with_residual
from hvd_compress.schemes.base import EncodeContext
from unit_helpers import CASE_IDS, CASES, assert_same, data, wire

B = TorchBackend()


def uniform_fn(step, rank, n):
    return np.random.default_rng(1000 * step + rank + 7 * n).random(n, dtype=np.float32)


def indices_fn(step, n, k):
    return B.randperm_prefix(n, k, 4242 + step, like=torch.zeros(1)).numpy()


def library_run(scheme, grads, error_feedback, op):
    nsteps, size = len(grads), len(grads[0])
    n = grads[0][0].size
    residuals = [torch.zeros(n) if error_feedback else None for _ in range(size)]
    out, nbytes = [], []
    for step in range(nsteps):
        payloads = []
        for rank in range(size):
            ctx = EncodeContext(key="p", step=step, rank=rank, size=size,
                                uniform=lambda k, s=step, r=rank: torch.from_numpy(uniform_fn(s, r, k)),
                                shared_seed=4242 + step, shape=(n,), state={})
            payload, residuals[rank] = encode_with_residual(B, scheme, torch.from_numpy(grads[step][rank]),
                                                            residuals[rank], ctx)
            payloads.append(payload)
        placeholder = torch.ones(1) * (1.0 if op == "average" else float(size))  # Horovod's op on 1.0
        if scheme.transport == "allreduce":
            total = payloads[0]["reduce"]
            for p in payloads[1:]:
                total = total + p["reduce"]
            local = {k: v for k, v in payloads[0].items() if k.startswith("_")}
            dense = scheme.decode_reduced(B, total, n, local).double()
            dense = (dense * (1.0 / size if op == "average" else 1.0)).float()
        else:
            dense = scheme.aggregate(B, [wire(p) for p in payloads], n)
            if scheme.apply_op_scale:
                dense = dense * (placeholder[0] / float(size))
        out.append(dense.numpy())
    return out, [None if r is None else r.numpy() for r in residuals]


@pytest.mark.parametrize("op", ["average", "sum"])
@pytest.mark.parametrize("case", CASE_IDS)
def test_simulate_matches_the_library(case, op):
    scheme = CASES[case]()
    size, steps, n = 3, 4, 301
    grads = [[data(n, seed=10 * s + r) for r in range(size)] for s in range(steps)]
    ef = True
    res = R.simulate(scheme.name, scheme.config(), grads, ef, op=op, uniform_fn=uniform_fn,
                     indices_fn=indices_fn)
    got, got_res = library_run(scheme, grads, ef, op)
    assert len(res.aggregated) == steps
    for s in range(steps):
        if scheme.name == "FP16":  # the library sums fp16 here in fp16 too, but scales in fp32
            np.testing.assert_allclose(got[s], res.aggregated[s], rtol=2e-3, atol=1e-3)
        else:
            assert_same(scheme, got[s], res.aggregated[s], f"step {s}")
    for r in range(size):
        scale = np.abs(grads[0][r]).max()
        if R._name(scheme.name) in ("QSGD", "EFSignSGD", "OneBit") or getattr(scheme, "values", None):
            np.testing.assert_allclose(got_res[r], res.residuals[r], atol=1e-4 * scale * steps)
        else:
            np.testing.assert_array_equal(got_res[r], res.residuals[r])
    # the law the integration tests rely on holds inside the oracle itself
    for r in range(size):
        lhs = sum(res.sent[s][r].astype(np.float64) for s in range(steps)) + res.residuals[r]
        rhs = sum(grads[s][r].astype(np.float64) for s in range(steps))
        np.testing.assert_allclose(lhs, rhs, atol=1e-5 * steps * np.abs(rhs).max())
    for s in range(steps):
        for r in range(size):
            assert res.nbytes[s][r] > 0


def test_simulate_without_feedback_has_no_residual():
    grads = [[data(10, 1), data(10, 2)]]
    agg, residuals = R.simulate("TopK", {"ratio": 0.2}, grads, error_feedback=False)
    assert residuals == [None, None]
    want = (R.sent("TopK", {"ratio": 0.2}, grads[0][0]) + R.sent("TopK", {"ratio": 0.2}, grads[0][1]))
    np.testing.assert_array_equal(agg[0], want * np.float32(np.float32(1.0) / np.float32(2)))


def test_reference_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown scheme"):
        R.sent("TopQ", {}, np.zeros(3, np.float32))
