"""PyTorch's side collectives: Horovod's async collectives under the names
the transports give, and the byte packing of payloads (several parts, or
several tensors' payloads, in one collective)."""
from __future__ import annotations

import torch

from .base import pair_swap_min_bytes


class PairSwap:
    """A 2-rank allgather in flight as a reduce-scatter: ``gathered`` holds
    this rank's bytes already, ``handle`` brings the peer's."""
    __slots__ = ("handle", "gathered", "peer_bytes", "nbytes", "peer", "dtype", "shape")

    def __init__(self, handle, gathered, nbytes, peer, dtype, shape):
        self.handle, self.gathered, self.nbytes, self.peer = handle, gathered, nbytes, peer
        self.dtype, self.shape = dtype, shape

    def result(self, received):
        """The allgather's result: both ranks' bytes, in rank order."""
        n = self.nbytes
        self.gathered[self.peer * n:(self.peer + 1) * n] = received.reshape(-1).view(torch.uint8)[:n]
        return self.gathered.view(self.dtype).reshape(2 * self.shape[0], *self.shape[1:])


class TorchCollectives:
    """Horovod's torch collectives (:class:`hvd_compress.protocols.Collectives`)."""
    #: a payload of several fixed-length parts travels as one allgather of its bytes
    packs_gathers = True
    #: the 2-rank swap's threshold in bytes chosen at run time (``Auto``'s link
    #: probe, the same on every rank); ``HVDC_PAIR_SWAP_MIN_BYTES`` wins where set
    pair_swap_chosen = None

    def allgather(self, tensor, name, process_set):
        import horovod.torch as hvd
        return hvd.allgather_async(tensor.contiguous(), name=name, process_set=process_set)

    def allgather_fixed(self, tensor, name, process_set, rank, size):
        """Between 2 ranks, where ``HVDC_PAIR_SWAP_MIN_BYTES`` is set or
        ``pair_swap_chosen`` (:func:`~hvd_compress.adapters.base.pair_swap_min_bytes`) and the payload is
        that large, it travels as a Sum reduce-scatter of a ``[2, n/4]`` int32
        tensor whose row of the peer holds this rank's bytes and whose own row is
        zeros: each rank receives the other's bytes exactly (an integer sum with
        zero), the same bytes each way as the allgather.  Horovod 0.28.1's Gloo
        allgather of 2 ranks posts its send before its receive on the one
        connection they share, and the rank that arrives second queues its
        ready-to-receive notice behind its whole payload, so the two directions
        run one after the other; Gloo's reduce-scatter sends both at once, but
        costs more on a fast link (docs/design/architecture.md, "Two ranks").
        Every rank decides alike: the shape is the same on every rank."""
        nbytes, at_least = self.nbytes(tensor), pair_swap_min_bytes(self.pair_swap_chosen)
        if size != 2 or at_least is None or nbytes < at_least or tensor.dim() == 0:
            return self.allgather(tensor, name, process_set)
        import horovod.torch as hvd
        mine = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        rows = torch.zeros(2, -(-nbytes // 4), dtype=torch.int32, device=tensor.device)
        rows[1 - rank].view(torch.uint8)[:nbytes] = mine
        gathered = torch.empty(2 * nbytes, dtype=torch.uint8, device=tensor.device)
        gathered[rank * nbytes:(rank + 1) * nbytes] = mine
        handle = hvd.reducescatter_async(rows, name=name, op=hvd.Sum, process_set=process_set)
        return PairSwap(handle, gathered, nbytes, 1 - rank, tensor.dtype, tuple(tensor.shape))

    def allreduce_sum(self, tensor, name, process_set):
        import horovod.torch as hvd
        return hvd.allreduce_async(tensor.contiguous(), name=name, op=hvd.Sum, process_set=process_set)

    def alltoall(self, tensor, name, process_set):
        """Equal splits along the first dimension."""
        import horovod.torch as hvd
        return hvd.alltoall_async(tensor.contiguous(), name=name, process_set=process_set)

    def wait(self, handle):
        import horovod.torch as hvd
        if isinstance(handle, PairSwap):
            return handle.result(hvd.synchronize(handle.handle))
        out = hvd.synchronize(handle)
        return out[0] if isinstance(out, tuple) else out  # alltoall also returns the received splits

    def nbytes(self, tensor):
        return tensor.numel() * tensor.element_size()

    def dynamic_length(self, tensor):
        """The element count of a 1-D tensor whose length is data-dependent."""
        return tensor.numel()

    # one collective of bytes for several tensors' payloads (two-phase's batched rounds)
    def to_bytes(self, tensors):
        return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])

    def pack_bytes(self, tensors, ws, name):
        """The tensors' bytes one after another in the workspace buffer ``name``,
        kept and reused: Horovod has read a payload before the next step's
        ``compress`` (as the fused codecs' payload buffers)."""
        n = sum(t.numel() * t.element_size() for t in tensors)
        buf = ws.get(name)
        if buf is None or buf.numel() != n or buf.device != tensors[0].device:
            buf = ws[name] = torch.empty(n, dtype=torch.uint8, device=tensors[0].device)
        return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors], out=buf)

    def bytes_view(self, buf, offset, dtype, n):
        """``n`` elements of ``dtype`` at byte ``offset`` of ``buf``: a view where
        the offset is aligned for the dtype, else a copy."""
        itemsize = _dtype(dtype).itemsize
        piece = buf[offset:offset + n * itemsize]
        return piece.view(_dtype(dtype)) if offset % itemsize == 0 else piece.clone().view(_dtype(dtype))

    def byte_length(self, dtype, n):
        return n * _dtype(dtype).itemsize

    def from_bytes(self, buf, offset, dtype, n):
        """``n`` elements of ``dtype`` at byte ``offset`` of ``buf`` (a copy: the
        offset need not be aligned for the dtype)."""
        return buf[offset:offset + self.byte_length(dtype, n)].clone().view(_dtype(dtype))


def _dtype(name):
    """The torch dtype of a :meth:`hvd_compress.backend.torch_backend.TorchBackend.dtype_name`
    (``float32``, ``uint8``, ...)."""
    return getattr(torch, name)
