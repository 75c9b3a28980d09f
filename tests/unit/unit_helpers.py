"""Shared pieces of the unit tests: framework wrappers, recorded random draws,
the catalogue of scheme configurations, and the comparison rules against
``tests/reference.py``."""
from __future__ import annotations

import functools

import numpy as np

from hvd_compress import schemes as S
from hvd_compress.schemes.base import EncodeContext

f32 = np.float32


# --- frameworks --------------------------------------------------------------------------------
class Torch:
    name = "torch"

    def __init__(self):
        import torch
        from hvd_compress.backend import TorchBackend
        self.torch = torch
        self.B = TorchBackend()

    def tensor(self, a):
        return self.torch.from_numpy(np.array(a, copy=True))

    def np(self, t):
        return t.detach().cpu().numpy()

    def nbytes(self, t):
        return t.numel() * t.element_size()

    def add(self, a, b):
        return a + b


class TF:
    name = "tensorflow"

    def __init__(self):
        import tensorflow as tf
        from hvd_compress.backend import TensorFlowBackend
        self.tf = tf
        self.B = TensorFlowBackend()

    def tensor(self, a):
        return self.tf.constant(np.array(a, copy=True))

    def np(self, t):
        return np.asarray(t.numpy())

    def nbytes(self, t):
        return int(t.shape.num_elements()) * t.dtype.size

    def add(self, a, b):
        return a + b


@functools.lru_cache(maxsize=None)
def framework(name):
    return Torch() if name == "torch" else TF()


FRAMEWORKS = ("torch", "tensorflow")


# --- random draws the test controls ---------------------------------------------------------------
class Draws:
    """A ``ctx.uniform`` that draws from a seeded numpy generator, hands the
    framework a tensor and remembers every array, in call order, so the same
    draws can be fed to the reference."""

    def __init__(self, fw, seed):
        self.fw = fw
        self.rng = np.random.default_rng(seed)
        self.arrays = []

    def __call__(self, n):
        u = self.rng.random(int(n), dtype=f32)
        self.arrays.append(u)
        return self.fw.tensor(u)


def make_ctx(fw, draws, shared_seed=1234, rank=0, size=1, shape=None):
    return EncodeContext(key="t", step=0, rank=rank, size=size, uniform=draws,
                         shared_seed=shared_seed, shape=shape, state={})


# --- the catalogue ---------------------------------------------------------------------------------
def _cases():
    """Every registered example (hvd_compress.schemes.REGISTRY) of the schemes
    tests/reference.py has math for: case id -> a zero-argument scheme factory."""
    import reference as R  # tests/reference.py (conftest puts tests/ on the path)
    return [(cid, functools.partial(S.build, spec)) for reg in S.REGISTRY.values() if reg.name in R.SCHEMES
            for cid, spec in reg.examples.items()]


CASES = dict(_cases())
CASE_IDS = list(CASES)

#: schemes whose result involves a float reduction (norm, mean): the library
#: reduces in fp32 in its own order, the reference in float64
REDUCING = {reg.name for reg in S.REGISTRY.values() if reg.compare == "reducing"}


def ref_name_config(scheme):
    return scheme.name, scheme.config()


def reduces(scheme):
    if scheme.name in REDUCING:
        return True
    values = getattr(scheme, "values", None)
    return values is not None and values.name in REDUCING


def data(n, seed, outliers=True):
    """Gaussian gradient-like data with a few large outliers."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(f32)
    if outliers and n > 10:
        pos = rng.choice(n, size=max(1, n // 500), replace=False)
        x[pos] *= f32(20.0)
    return x


def assert_same(scheme, got, want, what=""):
    """Exact for element-wise schemes; for reducing ones, within float noise
    of the scale, with at most a handful of elements one quantization level
    off (an element sitting on a rounding boundary)."""
    got = np.asarray(got, f32).reshape(-1)
    want = np.asarray(want, f32).reshape(-1)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not reduces(scheme):
        np.testing.assert_array_equal(got, want, err_msg=f"{scheme!r} {what}")
        return
    if got.size == 0:
        return
    scale = float(np.nanmax(np.abs(want))) or 1.0
    diff = np.abs(got.astype(np.float64) - want)
    bad = diff > 1e-5 * scale
    allowed = max(1, got.size // 20000)
    assert bad.sum() <= allowed, (
        f"{scheme!r} {what}: {int(bad.sum())} elements differ beyond float noise "
        f"(max diff {diff.max():.3g}, scale {scale:.3g})")


def wire(payload):
    """The parts that travel (names starting with '_' stay local)."""
    return {k: v for k, v in payload.items() if not k.startswith("_")}


def wire_bytes(fw, scheme, payload):
    """Bytes handed to collectives for this payload: its parts, the 1-element
    fp32 placeholder of allgather transport, and a 4-byte length for every
    variable-length part."""
    parts = wire(payload)
    total = sum(fw.nbytes(t) for t in parts.values())
    if scheme.transport == "allgather":
        total += 4 + 4 * sum(1 for p in parts if p in scheme.variable_parts)
    return total


def kept_count(fw, scheme, payload, sent):
    """Kept count of a variable-size sparsifier (raw indices: the idx length)."""
    return int(fw.np(payload["idx"]).size)
