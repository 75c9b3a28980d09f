"""Scheme specs as written on the command line: ``TopK(0.01)``, ``Int8``,
``TopK(0.1, values=BF16())``, and Horovod's own ``none`` / ``hvd_fp16``.

Specs are parsed with :mod:`ast` and only calls of the public factories in
:mod:`hvd_compress` with literal arguments are accepted (no ``eval``).
"""
from __future__ import annotations

import ast

#: Horovod's own compression objects, by spec name
HOROVOD_SPECS = ("none", "hvd_fp16")


def _factories():
    import hvd_compress
    return {name: getattr(hvd_compress, name) for name in hvd_compress.__all__
            if name not in ("Compressor", "none")}


def _build(node, factories):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    if isinstance(node, (ast.Tuple, ast.List)):  # e.g. Auto(exclude=("FP16", "Int8"))
        return tuple(_build(e, factories) for e in node.elts)
    name = None
    if isinstance(node, ast.Name):
        name, args, kwargs = node.id, [], []
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name, args, kwargs = node.func.id, node.args, node.keywords
    if name is None:
        raise ValueError(f"unsupported expression {ast.unparse(node)!r}")
    if name not in factories:
        raise ValueError(f"unknown scheme {name!r}; known: {', '.join(sorted(factories))}, "
                         f"{', '.join(HOROVOD_SPECS)}")
    return factories[name](*[_build(a, factories) for a in args],
                           **{k.arg: _build(k.value, factories) for k in kwargs})


def parse_spec(spec: str):
    """An hvd_compress :class:`~hvd_compress.Compressor` for ``spec``, or the
    string itself for Horovod's own ``none`` / ``hvd_fp16`` (built by
    :func:`horovod_compression` once Horovod is imported)."""
    spec = spec.strip()
    if spec in HOROVOD_SPECS:
        return spec
    try:
        tree = ast.parse(spec, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse scheme spec {spec!r}: {e.msg}") from None
    return _build(tree.body, _factories())


def keyword_args(spec: str) -> dict:
    """The keyword arguments written in ``spec`` (``"Auto(include_sign=True)"``:
    ``{"include_sign": True}``), each a Python literal."""
    node = ast.parse(spec.strip(), mode="eval").body
    if not isinstance(node, ast.Call):
        return {}
    try:
        return {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        raise ValueError(f"the keyword arguments of {spec!r} must be Python literals") from None


def split_specs(text: str):
    """Split a comma-separated list of specs, keeping commas inside parentheses."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            if cur.strip():
                out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def horovod_compression(spec: str, framework: str):
    """``hvd.Compression.none`` / ``.fp16`` of the given framework."""
    if framework == "torch":
        from horovod.torch.compression import Compression
    else:
        from horovod.tensorflow.compression import Compression
    return {"none": Compression.none, "hvd_fp16": Compression.fp16}[spec]


def transport_of(spec: str) -> str:
    if spec in HOROVOD_SPECS:
        return "allreduce"
    return parse_spec(spec).scheme.transport


def payload_nbytes(spec: str, numel: int):
    """``(bytes, exact)``: bytes one rank hands to Horovod for a tensor of
    ``numel`` elements, counted like :class:`hvd_compress.byte_counts.CompressionStats`
    (the 4-byte placeholder and the 4-byte length words included).  For
    data-dependent schemes (DGC, Threshold) the estimate assumes the nominal
    ``ratio`` is kept and ``exact`` is False; Threshold without a ratio gives
    ``(None, False)``."""
    if spec == "none":
        return 4 * numel, True
    if spec == "hvd_fp16":
        return 2 * numel, True
    s = parse_spec(spec).scheme
    extra = 4 if s.transport == "allgather" else 0
    n = s.payload_nbytes(numel)
    if n is not None:
        return n + extra, True
    if hasattr(s, "ratio") and hasattr(s, "kept_nbytes"):
        import math
        k = max(1, min(numel, int(math.ceil(s.ratio * numel))))
        # two variable-length parts (indices, values): one 4-byte length each
        return s.kept_nbytes(numel, k) + extra + 8, False
    return None, False
