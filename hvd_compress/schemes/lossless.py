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

The payload is one zstd frame of the byte planes taken block by block
(:data:`PLANE_BLOCK` elements: four planes of that block, then the next), so a
decode un-shuffles each block while its planes are still in cache.
"""
from __future__ import annotations

import threading

import numpy as np

from .base import Scheme, check_range, register


def _kernels():
    """The fused kernel library (the C byte shuffle), or None: numpy shuffles then."""
    from ..kernels import native
    return native.load()


#: elements per block of the byte planes: each block of the tensor is shuffled into its own
#: four planes (128 KiB each, zstd's largest block), so a decode can read one block's planes
#: into a buffer that stays in the L2 cache and un-shuffle them from there
PLANE_BLOCK = 1 << 17

_scratch = threading.local()


def planes_buffer(nbytes: int) -> np.ndarray:
    """This thread's byte-plane buffer of ``nbytes`` (kept: a fresh 64 MB array
    per call would fault in all of its pages every call)."""
    buf = getattr(_scratch, "planes", None)
    if buf is None or buf.size < nbytes:
        buf = _scratch.planes = np.empty(max(nbytes, 1), np.uint8)
    return buf[:nbytes]


def compressor(level: int):
    """This thread's zstd compressor at ``level`` (kept: its context is reused)."""
    import zstandard
    kept = getattr(_scratch, "compressors", None)
    if kept is None:
        kept = _scratch.compressors = {}
    if level not in kept:
        kept[level] = zstandard.ZstdCompressor(level=level)
    return kept[level]


def decompressor():
    """This thread's zstd decompressor (kept: its context is reused)."""
    import zstandard
    d = getattr(_scratch, "decompressor", None)
    if d is None:
        d = _scratch.decompressor = zstandard.ZstdDecompressor()
    return d


def _numpy_planes(values: np.ndarray) -> np.ndarray:
    """The blocked byte planes of contiguous fp32 ``values`` by numpy (no kernels)."""
    n = values.size
    b = values.view(np.uint8).reshape(-1, 4)
    full = n - n % PLANE_BLOCK
    head = b[:full].reshape(-1, PLANE_BLOCK, 4).transpose(0, 2, 1).reshape(-1)
    return np.concatenate([head, np.ascontiguousarray(b[full:].T).reshape(-1)])


def shuffle_planes(values: np.ndarray) -> np.ndarray:
    """The byte planes of fp32 ``values``, block by block of :data:`PLANE_BLOCK`
    elements (in a kept buffer where the kernels run)."""
    values = np.ascontiguousarray(values.astype(np.float32, copy=False)).reshape(-1)
    lib = _kernels()
    if lib is None:
        return _numpy_planes(values)
    planes = planes_buffer(4 * values.size)
    lib.hvdc_byte_shuffle(values.ctypes.data, values.size, PLANE_BLOCK, planes.ctypes.data)
    return planes


def shuffle_compress(values: np.ndarray, level: int) -> np.ndarray:
    blob = compressor(level).compress(shuffle_planes(values))
    return np.frombuffer(blob, dtype=np.uint8)


def _size_error(got, numel):
    return ValueError(f"Lossless payload decodes to {got} bytes or more; expected {4 * numel}")


def _read_exactly(reader, view, got_before, numel):
    """Fill ``view`` from zstd's ``reader`` (ValueError where the payload runs short)."""
    got = 0
    while got < len(view):
        step = reader.readinto(view[got:])
        if not step:
            raise _size_error(got_before + got, numel)
        got += step


def decompress_planes(blob, numel: int) -> np.ndarray:
    """zstd's output, the byte planes of ``numel`` floats, read whole into a kept buffer."""
    planes = planes_buffer(4 * numel)
    reader = decompressor().stream_reader(blob)
    _read_exactly(reader, memoryview(planes), 0, numel)
    if reader.read(1):
        raise _size_error(4 * numel + 1, numel)
    return planes


def unshuffle_blocks(blob, numel: int, add_block):
    """Decode ``blob`` one plane block at a time: each block's planes are read into a
    kept buffer of ``4 * PLANE_BLOCK`` bytes (in the L2 cache) and handed to
    ``add_block(planes, lo, m)`` (``m`` elements from ``lo``) before the next is read."""
    buf = planes_buffer(4 * min(numel, PLANE_BLOCK))
    reader = decompressor().stream_reader(blob)
    for lo in range(0, numel, PLANE_BLOCK):
        m = min(PLANE_BLOCK, numel - lo)
        _read_exactly(reader, memoryview(buf)[:4 * m], 4 * lo, numel)
        add_block(buf, lo, m)
    if reader.read(1):
        raise _size_error(4 * numel + 1, numel)


def shuffle_decompress(blob: np.ndarray, numel: int) -> np.ndarray:
    out = np.empty(numel, np.float32)
    lib = _kernels()

    def place(planes, lo, m):
        if lib is None:
            out[lo:lo + m] = np.ascontiguousarray(planes[:4 * m].reshape(4, m).T).view(np.float32).reshape(-1)
        else:
            lib.hvdc_byte_unshuffle_add(planes.ctypes.data, m, 1, 0.0, 0, out[lo:].ctypes.data)

    unshuffle_blocks(np.ascontiguousarray(blob), numel, place)
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
