"""The two sides the GPU check compares -- PyTorch or TensorFlow on a device,
with the schemes' random draws made on the host so both sides see the same
ones -- the tie-free test data, and one multi-rank, multi-step run of a case
on a side (:func:`run_case`, :func:`run_powersgd`)."""
from __future__ import annotations

import contextlib
import functools

import numpy as np

from ....compressor import encode_with_residual
from ....schemes.base import EncodeContext
from .catalogue import f32



# =================================================================================== data
@functools.lru_cache(maxsize=64)
def _tie_free(n, seed, outliers):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(f32)
    if outliers and n > 10:
        pos = rng.choice(n, size=max(1, n // 500), replace=False)
        x[pos] *= f32(20.0)
    mags = np.maximum(np.abs(x), f32(1e-30))
    order = np.argsort(mags, kind="stable")
    # positive floats order like their bit patterns: make the sorted patterns
    # strictly increasing (a repeat moves the fewest ulps up that it must)
    bits = mags[order].view(np.int32).astype(np.int64)
    ar = np.arange(n, dtype=np.int64)
    bits = np.maximum.accumulate(bits - ar) + ar
    m = bits.astype(np.int32).view(f32)
    out = np.empty_like(x)
    out[order] = np.where(x[order] < 0, -m, m)
    out.setflags(write=False)
    return out

def tie_free(n, seed, outliers=True):
    """Gradient-like fp32 data (N(0,1) with a few 20x outliers) whose magnitudes
    are all distinct, so Top-K has a unique answer (cached; read-only)."""
    return _tie_free(int(n), int(seed), bool(outliers))


# =================================================================================== sides
def _controlled(base_cls):
    """A backend whose own random draws come from numpy, so both sides see the
    same ones (the schemes' math is checked, not the device's generator)."""

    class Controlled(base_cls):
        def uniform(self, n, seed, like=None):
            u = np.random.default_rng(int(seed) & 0x7FFF_FFFF).random(int(n), dtype=f32)
            return self._put_like(u, like)

        def randperm_prefix(self, n, k, seed, like=None):
            idx = np.sort(np.random.default_rng(int(seed) & 0x7FFF_FFFF).choice(n, size=k, replace=False))
            return self._put_like(idx.astype(np.int64), like)

    Controlled.__name__ = "Controlled" + base_cls.__name__
    return Controlled

class TorchSide:
    """PyTorch on one device (and, on the CPU, a thread count)."""
    framework = "torch"

    def __init__(self, device, threads=None, controlled=True):
        import torch
        from ....backend import TorchBackend
        self.torch = torch
        self.device = torch.device(device)
        self.threads = threads
        if controlled:
            cls = _controlled(TorchBackend)
            cls._put_like = lambda _b, a, like: torch.from_numpy(np.require(a, requirements=("C", "W"))).to(
                like.device if like is not None else self.device)
            self.B = cls()
        else:
            self.B = TorchBackend()
        self.name = f"torch:{self.device.type}" + (f"[{threads} thread{'s' * (threads != 1)}]" if threads else "")

    def put(self, a):
        return self.torch.from_numpy(np.require(a, requirements=("C", "W"))).to(self.device)

    def get(self, t):
        if t.dtype == self.torch.bfloat16:
            return t.detach().view(self.torch.int16).cpu().numpy()
        return t.detach().cpu().numpy()

    @contextlib.contextmanager
    def scope(self):
        prev = self.torch.get_num_threads()
        if self.threads:
            self.torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            self.torch.set_num_threads(prev)

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

class TFSide:
    """TensorFlow (eager) on one device."""
    framework = "tensorflow"

    def __init__(self, device):
        import tensorflow as tf
        from ....backend import TensorFlowBackend
        self.tf = tf
        self.device = device
        cls = _controlled(TensorFlowBackend)

        def put_like(_b, a, like):
            with tf.device(device):
                return tf.constant(a)
        cls._put_like = put_like
        self.B = cls()
        self.name = f"tensorflow:{device}"

    def put(self, a):
        with self.tf.device(self.device):
            return self.tf.constant(np.array(a))

    def get(self, t):
        if t.dtype == self.tf.bfloat16:
            t = self.tf.bitcast(t, self.tf.int16)
        return np.asarray(t.numpy())

    @contextlib.contextmanager
    def scope(self):
        with self.tf.device(self.device):
            yield

    def sync(self):
        pass

def _wire(payload):
    return {k: v for k, v in payload.items() if not k.startswith("_")}

def run_case(side, scheme, xs, shape, draw_seed=1234):
    """Two ranks, ``len(xs)`` steps, error feedback on.  Returns one dict of
    numpy arrays per step: every payload part per rank, the new residuals, the
    accumulated input (for tie diagnosis) and the aggregate."""
    B = side.B
    n = int(np.prod(shape))
    draws = np.random.default_rng(draw_seed)
    uniform = lambda k: side.put(draws.random(int(k), dtype=f32))  # noqa: E731
    out = []
    with side.scope():
        residuals = [side.put(np.zeros(n, f32)) for _ in xs[0]]
        for s, per_rank in enumerate(xs):
            rec, payloads = {}, []
            for r, x in enumerate(per_rank):
                xt = side.put(x)
                rec[f"r{r}.acc"] = side.get(xt + residuals[r])
                ctx = EncodeContext(key="w", step=s + 1, rank=r, size=len(per_rank), uniform=uniform,
                                    shared_seed=1000 + s, shape=tuple(shape), state={})
                payload, residuals[r] = encode_with_residual(B, scheme, xt, residuals[r], ctx)
                for part, t in payload.items():
                    rec[f"r{r}.{part}"] = side.get(t)
                rec[f"r{r}.residual"] = side.get(residuals[r])
                payloads.append(payload)
            if scheme.transport == "allreduce":
                red = payloads[0]["reduce"]
                for p in payloads[1:]:
                    red = red + p["reduce"]
                local = {k: v for k, v in payloads[0].items() if k.startswith("_")}
                agg = scheme.decode_reduced(B, red, n, local)
            else:
                agg = scheme.aggregate(B, [_wire(p) for p in payloads], n)
            rec["aggregate"] = side.get(agg)
            side.sync()
            out.append(rec)
    return out

def run_powersgd(side, scheme, xs, shape, seed=99):
    """PowerSGD's rounds for two ranks with a host-made initial Q; records the
    aggregate and the residuals (both invariant to the sign of P's columns)."""
    B = side.B
    n, m = scheme.matrix_shape(tuple(shape))
    q = side.put((np.random.default_rng(seed).random((m, scheme.rank), dtype=f32) - f32(0.5)))
    out = []
    with side.scope():
        residuals = [side.put(np.zeros(n * m, f32)) for _ in xs[0]]
        for s, per_rank in enumerate(xs):
            rec = {}
            accs = [side.put(x) + residuals[r] for r, x in enumerate(per_rank)]
            firsts = [scheme.first_round(B, a, q, tuple(shape)) for a in accs]
            p_sum = firsts[0][0]
            for p, _ in firsts[1:]:
                p_sum = p_sum + p
            if s == 0:
                rec["p_sum"] = side.get(p_sum)
            seconds = [scheme.second_round(B, p_sum, mat) for _, mat in firsts]
            q_sum = seconds[0][1]
            for _, ql in seconds[1:]:
                q_sum = q_sum + ql
            for r, ((p, ql), acc) in enumerate(zip(seconds, accs)):
                agg, sent = scheme.finish(B, p, ql, q_sum)
                residuals[r] = acc - sent
                rec[f"r{r}.residual"] = side.get(residuals[r])
                if r == 0:
                    rec["aggregate"] = side.get(agg)
            q = q_sum / float(len(per_rank))
            side.sync()
            out.append(rec)
    return out
