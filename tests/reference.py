"""An independent numpy reference of every scheme's math.

Nothing here imports or calls ``hvd_compress``: the formulas below are written
from the papers / the scheme docstrings, so tests that compare the library
against this module compare two independent implementations.

API
---
``sent(scheme, config, x, uniform=None, indices=None)``
    The dense float32 contribution a rank sends after encoding the flat float32
    ``x`` (``x`` already includes the error-feedback residual).  ``uniform``:
    the U[0,1) draws the scheme makes -- one array (a single draw call), a list
    of arrays (consumed in call order, e.g. DGC's 1-element offset draw and then
    a stochastic ``values=`` quantizer's k draws), or a callable ``n -> array``.
    Random-K takes ``indices`` (the shared-seed coordinates) instead.
``aggregate(scheme, sents)``
    The combination over ranks, before Horovod's op scaling: a float32 sum in
    rank order (SignSGD: the sign of the sum of signs, a majority vote; FP16:
    a float16 sum, as the collective forms it).
``payload_bytes(scheme, config, numel, kept=None)``
    Bytes one rank hands to collectives: values + indices + scales, +4 for the
    1-element fp32 placeholder of allgather-transport schemes, +4 for the
    length of every variable-length part.  ``kept`` is the kept count of the
    variable-size sparsifiers (Threshold, DGC).
``simulate(scheme, config, grads, error_feedback, op="average", uniform_fn=None, indices_fn=None)``
    Several steps on several ranks with error feedback; see its docstring.

Numerics (what is exact and what is not)
----------------------------------------
* Element-wise fp32 math is done in fp32 in the same operation order as the
  schemes' documented formulas, so casts, Int8, TernGrad, sign schemes,
  Top-K, Random-K, Threshold and DGC match an fp32 implementation bit for bit
  (Top-K up to ties in magnitude).
* Reductions whose result is a float (QSGD's L2 norm, EFSignSGD's mean |x|,
  OneBit's two means) are computed here in float64 and rounded once to fp32;
  a framework reduces in fp32 in its own order, so compare those with a
  relative tolerance of a few ulp of the scale (QSGD codes may also differ by
  one level at the rare element sitting on a rounding boundary).
* Sums across ranks done by Horovod's own allreduce (casts, Random-K) are
  formed in the collective's order; ``aggregate`` sums in rank order.
"""
from __future__ import annotations

import ast
import math
from typing import Callable, List, Optional, Sequence

import numpy as np

f32 = np.float32

ALLREDUCE = {"NoCompression", "FP16", "RandomK"}
ALLGATHER = {"BF16", "Int8", "QSGD", "TernGrad", "SignSGD", "EFSignSGD", "OneBit",
             "TopK", "Threshold", "DGC"}
SCHEMES = sorted(ALLREDUCE | ALLGATHER)
STOCHASTIC = {"QSGD", "TernGrad"}
SPARSIFIERS = {"TopK", "Threshold", "DGC"}
VARIABLE_SIZE = {"Threshold", "DGC"}
#: values= quantizers a sparsifier accepts in this reference
VALUE_SCHEMES = {"NoCompression", "FP16", "BF16", "Int8", "QSGD", "TernGrad", "SignSGD", "EFSignSGD", "OneBit"}

DEFAULTS = {
    "Int8": {"block_size": None},
    "QSGD": {"levels": 127},
    "TopK": {"ratio": 0.01, "values": None, "index_coding": "auto"},
    "RandomK": {"ratio": 0.01},
    "Threshold": {"tau": 1e-3, "values": None},
    "DGC": {"ratio": 0.001, "sample_ratio": 0.01, "values": None},
}


def _name(scheme):
    """Accept a name, or anything with a ``name`` attribute (a scheme instance)."""
    name = scheme if isinstance(scheme, str) else getattr(scheme, "name", type(scheme).__name__)
    if name == "none":
        name = "NoCompression"
    if name not in SCHEMES:
        raise ValueError(f"reference: unknown scheme {name!r}; known: {SCHEMES}")
    return name


def _cfg(name, config):
    out = dict(DEFAULTS.get(name, {}))
    out.update(config or {})
    return out


def parse_values(values):
    """The ``values=`` quantizer as ``(name, config)`` or None.

    Accepts None, ``(name, config)``, a repr string such as
    ``"Int8(block_size=None)"`` (what ``Scheme.config()`` reports), or an object
    with ``name`` and ``config()`` (a scheme instance: only its name and
    constructor arguments are read, never its math)."""
    if values is None:
        return None
    if isinstance(values, tuple) and len(values) == 2:
        return _name(values[0]), dict(values[1] or {})
    if isinstance(values, str):
        call = ast.parse(values.strip(), mode="eval").body
        if isinstance(call, ast.Name):
            return _name(call.id), {}
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            raise ValueError(f"reference: cannot parse values={values!r}")
        return _name(call.func.id), {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    if hasattr(values, "config") and hasattr(values, "name"):
        return _name(values.name), dict(values.config())
    raise ValueError(f"reference: cannot interpret values={values!r}")


def k_for(ratio, numel):
    """Kept count of ratio-based sparsifiers: ceil(ratio * n), at least 1, at
    most n (0 for an empty tensor)."""
    if numel == 0:
        return 0
    return max(1, min(numel, int(math.ceil(ratio * numel))))


INDEX_CODES = ("raw", "bitmap", "elias_fano")


def index_code_bytes(code, numel, k):
    """Bytes of k sorted indices into numel elements in each index code:
    raw int32 (int64 past 2**31 elements); a bitmap of numel bits; Elias-Fano
    with L = floor(log2(n/k)) low bits an index packed at fixed width and the
    high parts in unary (k ones and n >> L zeros, plus one)."""
    if code == "raw":
        return k * (4 if numel < 2**31 else 8)
    if code == "bitmap":
        return -(-numel // 8)
    if code == "elias_fano":
        low = max(0, int(math.floor(math.log2(numel / k)))) if k else 0
        return -(-(k * low) // 8) + -(-(k + (numel >> low) + 1) // 8)
    raise ValueError(f"reference: unknown index code {code!r}")


def topk_index_bytes(numel, k, index_coding="auto"):
    """Top-K's indices travel in the smallest code (ties: the simpler code)."""
    codes_ = INDEX_CODES if index_coding in (None, "auto") else (index_coding,)
    return min(index_code_bytes(c, numel, k) for c in codes_)


# --- primitives ---------------------------------------------------------------------------
def bf16_round(x):
    """fp32 -> bf16 -> fp32 with round-to-nearest-even on the fp32 bit pattern
    (NaN stays a quiet NaN)."""
    x = np.ascontiguousarray(x, dtype=f32)
    bits = x.view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
    out = (rounded & 0xFFFFFFFF).astype(np.uint32).view(f32).copy()
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.float32("nan")
    return out


def bf16_bits(x):
    """The int16 bit pattern of bf16(x) (what BF16 puts on the wire)."""
    return (bf16_round(x).view(np.uint32) >> 16).astype(np.uint16).view(np.int16)


def _draws(uniform):
    """A function n -> fp32 array of U[0,1) draws, from the accepted forms."""
    if uniform is None:
        def none(n):
            raise ValueError("reference: this scheme is stochastic; pass uniform=")
        return none
    if callable(uniform):
        return lambda n: np.asarray(uniform(n), dtype=f32).reshape(-1)[:n]
    if isinstance(uniform, (list, tuple)):
        queue = [np.asarray(u, dtype=f32).reshape(-1) for u in uniform]

        def pop(n):
            u = queue.pop(0)
            if u.size < n:
                raise ValueError(f"reference: a draw of {n} values was given only {u.size}")
            return u[:n]
        return pop
    arr = np.asarray(uniform, dtype=f32).reshape(-1)
    return lambda n: arr[:n]


def _check_x(x):
    x = np.asarray(x)
    if x.dtype != f32:
        x = x.astype(f32)
    return x.reshape(-1)


# --- one scheme's encoding --------------------------------------------------------------------
def _int8(x, block_size):
    n = x.size
    block = max(1, n if block_size is None else min(block_size, n))
    nb = max(1, -(-n // block))  # an empty tensor still has one scale
    xb = np.concatenate([x, np.zeros(nb * block - n, f32)]).reshape(nb, block)
    amax = np.max(np.abs(xb), axis=1)
    with np.errstate(invalid="ignore"):
        # an all-zero block gets scale 1; a NaN/Inf amax stays (non-finite values propagate)
        scale = np.where(amax == 0, f32(1.0), amax / f32(127.0)).astype(f32)
        q = np.clip(np.round(xb / scale[:, None]), f32(-127), f32(127)).astype(f32)
    return (q * scale[:, None]).reshape(-1)[:n].astype(f32), q.reshape(-1)[:n], scale


def _qsgd(x, levels, draw):
    n = x.size
    norm = f32(np.sqrt(np.sum(x.astype(np.float64) ** 2)))
    safe = f32(1.0) if norm == 0 else norm
    level = (np.abs(x) / safe) * f32(levels)
    q = np.floor(level + draw(n))
    q = (np.clip(q, f32(0), f32(levels)) * np.sign(x)).astype(f32)
    return (q * (safe / f32(levels))).astype(f32), q, norm


def _terngrad(x, draw):
    n = x.size
    s = np.max(np.abs(x)) if n else f32(0)
    safe = s if s > 0 else f32(1.0)
    keep = (draw(n) < np.abs(x) / safe).astype(f32)
    t = keep * np.sign(x)
    return (t * s).astype(f32), t, s


def _sign(x):
    """+1 where x >= 0 (zero votes +), else -1."""
    return np.where(x >= 0, f32(1.0), f32(-1.0)).astype(f32)


def _efsign(x):
    scale = f32(np.sum(np.abs(x.astype(np.float64))) / x.size) if x.size else f32("nan")
    return (_sign(x) * scale).astype(f32), scale


def _onebit(x):
    pos = x >= 0
    npos, nneg = int(pos.sum()), int((~pos).sum())
    x64 = x.astype(np.float64)
    mpos = f32(x64[pos].sum() / max(npos, 1))
    mneg = f32(x64[~pos].sum() / max(nneg, 1))
    return np.where(pos, mpos, mneg).astype(f32), (mpos, mneg)


def _int8_bytes(n, cfg):
    block = max(1, n if cfg["block_size"] is None else min(cfg["block_size"], n))
    return n + 4 * max(1, -(-n // block))  # at least one scale


#: the dense schemes, by name: ``(sent(x, cfg, draw), nbytes(n, cfg))`` -- the float32
#: contribution of flat float32 ``x`` (``draw(n)``: the scheme's U[0,1) draws), and the
#: bytes of its parts for ``n`` elements (no placeholder).  A new element-wise scheme is
#: one entry here plus its name in ALLGATHER or ALLREDUCE (docs/design/adding_a_scheme.md); as a
#: sparsifier's ``values=`` it is then checked too.
DENSE = {
    "NoCompression": (lambda x, cfg, draw: x.copy(), lambda n, cfg: 4 * n),
    "FP16": (lambda x, cfg, draw: x.astype(np.float16).astype(f32), lambda n, cfg: 2 * n),
    "BF16": (lambda x, cfg, draw: bf16_round(x), lambda n, cfg: 2 * n),
    "Int8": (lambda x, cfg, draw: _int8(x, cfg["block_size"])[0], _int8_bytes),
    "QSGD": (lambda x, cfg, draw: _qsgd(x, cfg["levels"], draw)[0], lambda n, cfg: n + 4),
    "TernGrad": (lambda x, cfg, draw: _terngrad(x, draw)[0], lambda n, cfg: -(-n // 4) + 4),
    "SignSGD": (lambda x, cfg, draw: _sign(x), lambda n, cfg: -(-n // 8)),
    "EFSignSGD": (lambda x, cfg, draw: _efsign(x)[0], lambda n, cfg: -(-n // 8) + 4),
    "OneBit": (lambda x, cfg, draw: _onebit(x)[0], lambda n, cfg: -(-n // 8) + 8),
}


def topk_indices(x, ratio):
    """Indices of the k = k_for(ratio, n) largest |x| (ties broken by position)."""
    k = k_for(ratio, x.size)
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


def threshold_indices(x, tau):
    return np.nonzero(np.abs(x) >= f32(tau))[0]


def dgc_indices(x, ratio, sample_ratio, u_offset):
    """DGC's selection: the ks-th largest |x| of a strided sample from a random
    offset (``u_offset`` is the single U[0,1) draw) is the threshold."""
    n = x.size
    a = np.abs(x)
    if n == 0:
        return np.zeros(0, np.int64)
    m = min(n, max(k_for(sample_ratio, n), 256))
    stride = max(1, n // m)
    offset = int((f32(np.asarray(u_offset, f32).reshape(-1)[0]) * f32(stride)).astype(np.int64))
    sample_idx = np.clip(np.arange(m, dtype=np.int64) * stride + offset, 0, n - 1)
    sample = a[sample_idx]
    ks = k_for(ratio, m)
    thr = np.sort(sample)[m - ks]
    return np.nonzero(a >= thr)[0]


def _dense_sent(name, cfg, x, draw, indices=None):
    return _encode(name, cfg, x, draw, indices)[0]


def _encode(name, cfg, x, draw, indices=None):
    """(dense sent, kept count or None)."""
    out = _encode_dense(name, cfg, x, draw, indices)
    if isinstance(out, tuple):
        return out
    return out, None


def _encode_dense(name, cfg, x, draw, indices=None):
    if name in DENSE:
        return DENSE[name][0](x, cfg, draw)
    if name == "RandomK":
        if indices is None:
            raise ValueError("reference: RandomK needs indices= (the shared-seed coordinates)")
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.zeros(x.size, f32)
        np.add.at(out, idx, x[idx])
        return out
    if name in SPARSIFIERS:
        if name == "TopK":
            idx = topk_indices(x, cfg["ratio"]) if indices is None else np.asarray(indices, np.int64)
        elif name == "Threshold":
            idx = threshold_indices(x, cfg["tau"])
        else:
            idx = dgc_indices(x, cfg["ratio"], cfg["sample_ratio"], draw(1) if x.size else None)
        vals = x[idx]
        values = parse_values(cfg.get("values"))
        if values is not None:
            vname, vcfg = values
            vals = _dense_sent(vname, _cfg(vname, vcfg), vals, draw)
        out = np.zeros(x.size, f32)
        out[idx] = vals
        return out, int(idx.size)
    raise ValueError(f"reference: no math for {name}")


def sent(scheme, config, x, uniform=None, indices=None):
    """Dense fp32 contribution of one rank for flat ``x`` (see the module docstring)."""
    name = _name(scheme)
    return _encode(name, _cfg(name, config), _check_x(x), _draws(uniform), indices)[0]


def kept_indices(scheme, config, x, uniform=None, indices=None):
    """The coordinates a sparsifier keeps (sorted)."""
    name = _name(scheme)
    cfg = _cfg(name, config)
    x = _check_x(x)
    if name == "TopK":
        return topk_indices(x, cfg["ratio"])
    if name == "Threshold":
        return threshold_indices(x, cfg["tau"])
    if name == "DGC":
        return dgc_indices(x, cfg["ratio"], cfg["sample_ratio"], _draws(uniform)(1) if x.size else None)
    if name == "RandomK":
        return np.sort(np.asarray(indices, np.int64))
    raise ValueError(f"reference: {name} is not a sparsifier")


def codes(scheme, config, x, uniform=None):
    """The integer codes and float scales of the quantizers, for part-level checks:
    Int8 -> (q, scale per block); QSGD -> (signed level, norm); TernGrad ->
    (t in {-1,0,1}, max|x|); SignSGD -> (bit,); EFSignSGD -> (bit, scale);
    OneBit -> (bit, (mean+, mean-))."""
    name = _name(scheme)
    cfg = _cfg(name, config)
    x = _check_x(x)
    draw = _draws(uniform)
    bit = (x >= 0).astype(np.int32)
    if name == "Int8":
        _, q, scale = _int8(x, cfg["block_size"])
        return q, scale
    if name == "QSGD":
        _, q, norm = _qsgd(x, cfg["levels"], draw)
        return q, norm
    if name == "TernGrad":
        _, t, s = _terngrad(x, draw)
        return t, s
    if name == "SignSGD":
        return (bit,)
    if name == "EFSignSGD":
        return bit, _efsign(x)[1]
    if name == "OneBit":
        return bit, _onebit(x)[1]
    raise ValueError(f"reference: {name} has no codes")


# --- combination over ranks ------------------------------------------------------------------
def aggregate(scheme, sents: Sequence[np.ndarray]) -> np.ndarray:
    """Combination of the ranks' contributions (no op scaling)."""
    name = _name(scheme)
    if name == "FP16":
        acc = np.asarray(sents[0], f32).astype(np.float16)
        for s in sents[1:]:
            acc = (acc + np.asarray(s, f32).astype(np.float16)).astype(np.float16)
        return acc.astype(f32)
    acc = np.asarray(sents[0], f32).copy()
    for s in sents[1:]:
        acc = (acc + np.asarray(s, f32)).astype(f32)
    if name == "SignSGD":
        return np.sign(acc).astype(f32)
    return acc


def transport(scheme):
    return "allreduce" if _name(scheme) in ALLREDUCE else "allgather"


def apply_op_scale(scheme):
    """False for the majority vote: Horovod's Average/Sum scaling does not apply."""
    return _name(scheme) != "SignSGD"


# --- bytes on the wire -----------------------------------------------------------------------
def _values_bytes(name, cfg, n):
    """Bytes of a dense quantizer's parts for n elements (no placeholder)."""
    if name in DENSE:
        return DENSE[name][1](n, cfg)
    raise ValueError(f"reference: {name} cannot encode values")


def _values_nparts(name, cfg):
    """Number of parts of a values= quantizer whose length depends on the kept count."""
    if name == "Int8":
        return 2 if cfg["block_size"] is not None else 1
    return 1  # q / t / bits / the value cast itself


def payload_bytes(scheme, config, numel, kept=None) -> int:
    """Bytes one rank hands to collectives (see the module docstring)."""
    name = _name(scheme)
    cfg = _cfg(name, config)
    idx_bytes = 4 if numel < 2**31 else 8
    if name in DENSE:  # allgather adds the 1-element placeholder
        return (0 if name in ALLREDUCE else 4) + _values_bytes(name, cfg, numel)
    if name == "RandomK":
        return 4 * k_for(cfg["ratio"], numel)
    if name in SPARSIFIERS:
        if name == "TopK":
            k = k_for(cfg["ratio"], numel)
        else:
            if kept is None:
                raise ValueError(f"reference: {name} is variable-size; pass kept=")
            k = int(kept)
        values = parse_values(cfg.get("values"))
        if values is None:
            vbytes, nvar = 4 * k, 1
        else:
            vname, vcfg = values
            vcfg = _cfg(vname, vcfg)
            vbytes, nvar = _values_bytes(vname, vcfg, k), _values_nparts(vname, vcfg)
        if name == "TopK":
            total = 4 + topk_index_bytes(numel, k, cfg.get("index_coding", "auto")) + vbytes
        else:
            total = 4 + idx_bytes * k + vbytes
        if name in VARIABLE_SIZE:
            total += 4 * (1 + nvar)  # the lengths of idx and of the variable value parts
        return total
    raise ValueError(f"reference: no byte count for {name}")


# --- multi-step, multi-rank simulation ---------------------------------------------------------
class SimResult(tuple):
    """``(aggregated, residuals)``; also ``.sent[step][rank]`` and ``.nbytes[step][rank]``."""

    def __new__(cls, aggregated, residuals, sent_, nbytes):
        self = super().__new__(cls, (aggregated, residuals))
        self.aggregated, self.residuals, self.sent, self.nbytes = aggregated, residuals, sent_, nbytes
        return self


def op_scale(scheme, aggregated, size, op="average"):
    """Horovod's op applied to the combination.

    Allreduce transport: Horovod multiplies the fp32 sum by 1/size (in double,
    rounded to fp32; fp16 stays fp16).  Allgather transport: the placeholder 1.0
    comes back as ``size * scale``, and the compressor multiplies the summed
    payloads by ``fp32(placeholder) / size`` computed in fp32.  The vote opts out.
    """
    op = op.lower()
    if op not in ("average", "sum"):
        raise ValueError(f"reference: op must be 'average' or 'sum'; got {op!r}")
    scale = 1.0 / size if op == "average" else 1.0
    if not apply_op_scale(scheme):
        return aggregated
    if transport(scheme) == "allreduce":
        if _name(scheme) == "FP16":
            return (aggregated.astype(np.float16).astype(np.float64) * scale).astype(np.float16).astype(f32)
        return (aggregated.astype(np.float64) * scale).astype(f32)
    placeholder = f32(np.float64(size) * scale)
    return (aggregated * (placeholder / f32(size))).astype(f32)


def simulate(scheme, config, grads_per_step_per_rank, error_feedback, op="average",
             uniform_fn: Optional[Callable] = None, indices_fn: Optional[Callable] = None):
    """Error feedback over steps and ranks.

    Args:
        grads_per_step_per_rank: ``grads[step][rank]``, flat float32 arrays.
        error_feedback: keep ``residual = (grad + residual) - sent`` per rank;
            a non-finite residual element is reset to 0 (one bad step does not
            poison later ones).
        op: "average" or "sum" (see :func:`op_scale`).
        uniform_fn: ``uniform_fn(step, rank, n) -> n draws`` for stochastic
            schemes (called once per draw the scheme makes, in call order).
        indices_fn: ``indices_fn(step, numel, k) -> k indices`` for RandomK
            (the same on every rank, like the shared seed).

    Returns a :class:`SimResult`: ``(aggregated, residuals)`` with
    ``aggregated[step]`` the dense result every rank gets after decompress and
    ``residuals[rank]`` the final residual (None without error feedback);
    ``.sent[step][rank]`` and ``.nbytes[step][rank]`` too.
    """
    name = _name(scheme)
    cfg = _cfg(name, config)
    nsteps = len(grads_per_step_per_rank)
    size = len(grads_per_step_per_rank[0]) if nsteps else 0
    residuals: List[Optional[np.ndarray]] = [None] * size
    aggregated, all_sent, all_bytes = [], [], []
    for step, grads in enumerate(grads_per_step_per_rank):
        if len(grads) != size:
            raise ValueError("reference: every step needs one gradient per rank")
        sents, nbytes = [], []
        for rank, g in enumerate(grads):
            g = _check_x(g)
            acc = g if residuals[rank] is None else (g + residuals[rank]).astype(f32)
            draw = None if uniform_fn is None else (lambda n, s=step, r=rank: uniform_fn(s, r, n))
            idx = None
            if name == "RandomK":
                if indices_fn is None:
                    raise ValueError("reference: RandomK needs indices_fn=")
                idx = indices_fn(step, g.size, k_for(cfg["ratio"], g.size))
            s, kept = _encode(name, cfg, acc, _draws(draw), idx)
            if error_feedback:
                r = (acc - s).astype(f32)
                residuals[rank] = np.where(np.isfinite(r), r, f32(0)).astype(f32)
            sents.append(s)
            nbytes.append(payload_bytes(name, cfg, g.size, kept=kept))
        aggregated.append(op_scale(name, aggregate(name, sents), size, op))
        all_sent.append(sents)
        all_bytes.append(nbytes)
    return SimResult(aggregated, residuals, all_sent, all_bytes)
