"""Lossless coding of dense tensors: byte shuffle + zstandard.

Floats are poor material for general-purpose compressors: sign and exponent
bytes repeat, mantissa bytes are close to random.  Shuffling the bytes of
every float into four planes (all first bytes, all second bytes, ...) puts the
repetitive planes together, and zstd then squeezes those.  Expect about
1.1-1.3x on real gradients and more on tensors with many exact zeros (1.2-2x
is the range usually quoted for lossless coding of gradients; dense fp32 noise
sits at its low end).  The codec runs on the host
(zstandard has no GPU kernel), so on GPUs this scheme pays a device-to-host
copy; use it where the link, not PCIe, is the bottleneck and exactness is
required.  Collet & Kucherawy, RFC 8878 (Zstandard); the shuffle is blosc's.

The payload is one zstd frame per block of :data:`PLANE_BLOCK` elements (the
four byte planes of that block), concatenated: the kernels shuffle one block into
a buffer that stays in the L2 cache and compress it from there straight into
the payload, and decode one frame into that buffer and un-shuffle it into the
output: no whole-tensor plane buffer is written or read, and beyond zstd's work
the tensor is read once and the output written once.
"""
from __future__ import annotations

import threading

import numpy as np

from .base import Scheme, check_range, register


def _kernels():
    """The fused kernel library (the C byte shuffle), or None: numpy shuffles then."""
    from ..kernels import native
    return native.load()


def native_coder():
    """``(kernels, zstd)`` where both the kernels and a zstd library load, else None:
    python-zstandard codes block by block then."""
    lib = _kernels()
    if lib is None:
        return None
    from ..kernels import zstd_api
    z = zstd_api.load()
    return None if z is None else (lib, z)


#: elements per block: each block of the tensor is shuffled into its own four planes
#: (128 KiB each, zstd's largest block) and compressed as its own zstd frame, so the
#: planes of one block stay in the L2 cache between the shuffle and zstd
PLANE_BLOCK = 1 << 17

_scratch = threading.local()


def planes_buffer(nbytes: int) -> np.ndarray:
    """This thread's byte-plane buffer of ``nbytes`` (kept: a fresh array per call
    would fault in all of its pages every call)."""
    buf = getattr(_scratch, "planes", None)
    if buf is None or buf.size < nbytes:
        buf = _scratch.planes = np.empty(max(nbytes, 1), np.uint8)
    return buf[:nbytes]


def compressor(level: int):
    """This thread's python-zstandard compressor at ``level`` (kept: its context is reused)."""
    import zstandard
    kept = getattr(_scratch, "compressors", None)
    if kept is None:
        kept = _scratch.compressors = {}
    if level not in kept:
        kept[level] = zstandard.ZstdCompressor(level=level)
    return kept[level]


def decompressor():
    """This thread's python-zstandard decompressor (kept: its context is reused)."""
    import zstandard
    d = getattr(_scratch, "decompressor", None)
    if d is None:
        d = _scratch.decompressor = zstandard.ZstdDecompressor()
    return d


def shuffle_planes(values: np.ndarray) -> np.ndarray:
    """The byte planes of fp32 ``values``, block by block of :data:`PLANE_BLOCK`
    elements (numpy: the fallback's and the benchmarks' layout of the payload's content)."""
    b = np.ascontiguousarray(values.astype(np.float32, copy=False)).reshape(-1).view(np.uint8).reshape(-1, 4)
    n = b.shape[0]
    full = n - n % PLANE_BLOCK
    head = b[:full].reshape(-1, PLANE_BLOCK, 4).transpose(0, 2, 1).reshape(-1)
    return np.concatenate([head, np.ascontiguousarray(b[full:].T).reshape(-1)])


def blocks(numel: int):
    """``(lo, m)``: the first element and the length of each block."""
    return [(lo, min(PLANE_BLOCK, numel - lo)) for lo in range(0, numel, PLANE_BLOCK)]


def encode_into(coder, x_address: int, numel: int, level: int, out_address: int, cap: int) -> int:
    """The payload of the ``numel`` floats at ``x_address`` written at ``out_address``
    (``cap`` bytes, at least ``zstd.bound``); returns its length."""
    lib, z = coder
    scratch = planes_buffer(4 * min(numel, PLANE_BLOCK))
    size = lib.hvdc_lossless_encode(x_address, numel, PLANE_BLOCK, level, z.table, z.context("C"),
                                    scratch.ctypes.data, out_address, cap)
    if size < 0:
        raise RuntimeError(f"zstd failed to compress {numel} floats into {cap} bytes")
    return size


_MALFORMED = {-1: "a zstd frame is cut short or corrupt", -2: "a frame does not hold its block's bytes",
              -3: "bytes follow the last block's frame"}


def decode_add_into(coder, blob_address: int, size: int, numel: int, out_address: int, first: int, s, scaled: int):
    """Decode the payload at ``blob_address`` (``size`` bytes) into the ``numel`` floats at
    ``out_address``: written (``first``) or added, times ``s`` where ``scaled``."""
    lib, z = coder
    scratch = planes_buffer(4 * min(numel, PLANE_BLOCK))
    got = lib.hvdc_lossless_decode_add(blob_address, size, numel, PLANE_BLOCK, z.table, z.context("D"),
                                       scratch.ctypes.data, first, s, scaled, out_address)
    if got != 0:
        raise ValueError(f"Lossless payload of {size} bytes for {numel} floats: {_MALFORMED.get(got, got)}")


def shuffle_compress(values: np.ndarray, level: int) -> np.ndarray:
    values = np.ascontiguousarray(values.astype(np.float32, copy=False)).reshape(-1)
    coder = native_coder()
    if coder is None:
        planes, c = shuffle_planes(values), compressor(level)
        blob = b"".join(c.compress(planes[4 * lo:4 * (lo + m)]) for lo, m in blocks(values.size))
        return np.frombuffer(blob, dtype=np.uint8)
    cap = coder[1].bound(values.size, PLANE_BLOCK)
    out = np.empty(max(cap, 1), np.uint8)
    return out[:encode_into(coder, values.ctypes.data, values.size, level, out.ctypes.data, cap)]


def _python_frame(blob: memoryview, pos: int, want: int, numel: int):
    """python-zstandard's decode of the frame at ``pos`` (fed 128 KiB at a time, so the
    bytes after it are never copied whole): its content, of ``want`` bytes, and the next frame's position."""
    dobj, parts = decompressor().decompressobj(), []
    while not dobj.eof:
        if pos >= len(blob):
            raise ValueError(f"Lossless payload of {len(blob)} bytes for {numel} floats: {_MALFORMED[-1]}")
        parts.append(dobj.decompress(blob[pos:pos + (1 << 17)]))
        pos += min(1 << 17, len(blob) - pos)
    content = b"".join(parts)
    if len(content) != want:
        raise ValueError(f"Lossless payload of {len(blob)} bytes for {numel} floats: {_MALFORMED[-2]}")
    return content, pos - len(dobj.unused_data)


def _python_decompress(blob: np.ndarray, numel: int, out: np.ndarray):
    """python-zstandard's decode of the frames, one block at a time (no kernels or no zstd library)."""
    view, pos = memoryview(blob), 0
    for lo, m in blocks(numel):
        content, pos = _python_frame(view, pos, 4 * m, numel)
        planes = np.frombuffer(content, np.uint8).reshape(4, m)
        out[lo:lo + m] = np.ascontiguousarray(planes.T).view(np.float32).reshape(-1)
    if pos != blob.size:
        raise ValueError(f"Lossless payload of {blob.size} bytes for {numel} floats: {_MALFORMED[-3]}")


def shuffle_decompress(blob: np.ndarray, numel: int) -> np.ndarray:
    blob = np.ascontiguousarray(blob, dtype=np.uint8).reshape(-1)
    out = np.empty(numel, np.float32)
    coder = native_coder()
    if coder is None:
        _python_decompress(blob, numel, out)
    else:
        decode_add_into(coder, blob.ctypes.data, blob.size, numel, out.ctypes.data, 1, 0.0, 0)
    return out


@register(kind="lossless", compare="lossless", examples={"lossless": "Lossless()"},
          horovod={"Lossless": "Lossless()"}, table={"Lossless()": "zstd(shuffle(x)) (variable)"})
class Lossless(Scheme):
    """Exact compression of dense fp32 gradients (byte shuffle + zstd ``level``).

    The payload is a variable-length byte string travelling by allgather;
    decoding is exact, so no error feedback is needed.  ``level`` 1 is the
    fast end of zstd; higher levels rarely gain on float data.
    """
    error_feedback_default = False
    variable_parts = ("bytes",)

    def __init__(self, level=1):
        check_range("level", level, 1, 22, kind=int)
        self.level = level

    def config(self):
        return {"level": self.level}

    def encode(self, B, x, ctx):
        blob = B.host_call(lambda a: shuffle_compress(a, self.level), x, "uint8")
        return {"bytes": blob}, x

    def decode_one(self, B, payload, numel, ctx=None):
        return B.host_call(lambda b: shuffle_decompress(b, numel), payload["bytes"], "float32", numel)
