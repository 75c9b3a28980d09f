"""PyTorch side: state in plain tensors, side collectives by Horovod's async
allgather, the parameter's name read from the stock optimizer's frame."""
from __future__ import annotations

import torch

from ..integration import horovod_internals
from .base import AdapterBase, CallerInfo, pair_swap_min_bytes
from ..backend import backend_for
from ..integration.fingerprint import compare, describe_side
from .param_state import RESIDUAL, MemoryView, StepView


class AdasumNotSupported(ValueError):
    pass



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


class TorchAdapter(AdapterBase):
    defer_second_rounds = True
    fused_codecs_on_chunks = True
    packs_gathers = True
    #: the 2-rank swap's threshold in bytes chosen at run time (``Auto``'s link
    #: probe, the same on every rank); ``HVDC_PAIR_SWAP_MIN_BYTES`` wins where set
    pair_swap_chosen = None

    def __init__(self):
        self.B = backend_for(torch.zeros(0))
        super().__init__()

    def reset(self):
        super().reset()
        self.fingerprint_checked = False
        self._in_flight = {}
        self._round_keys = set()

    # views of the per-parameter state by kind: {key: value}
    @property
    def residuals(self):
        return MemoryView(self.params, RESIDUAL)

    @property
    def memories(self):
        names = sorted({name for state in self.params.values() for name in state.memory})
        return {name: MemoryView(self.params, name) for name in names}

    @property
    def steps(self):
        return StepView(self.params)

    @property
    def scheme_state(self):
        return {key: state.scheme for key, state in self.params.items()}

    def caller_info(self, tensor):
        import horovod.torch as hvd
        caller = horovod_internals.find_torch_caller()
        if caller.optimizer is not None and horovod_internals.is_adasum(caller.optimizer):
            raise AdasumNotSupported(
                "hvd_compress does not support op=hvd.Adasum: Adasum compresses parameter deltas, not "
                "gradients, and its reduction is not a sum; use op=hvd.Average or hvd.Sum")
        if caller.optimizer is None:
            ps = hvd.global_process_set
            return CallerInfo(None, ps, hvd.rank(), hvd.size())
        ps = caller.process_set
        key = caller.key
        if key is None:  # an optimizer called, but its parameter was not found: say so
            key = self.fallback_key(tensor, tuple(tensor.shape))
            horovod_internals.warn_fallback_key(key, "torch")
        return CallerInfo(key, ps, ps.rank(), ps.size(), caller.params(), owns_input=True)

    def check_fingerprint(self, comp, info):
        # Blocking is safe here: it is the first collective every rank issues
        # for this compressor, under one fixed name.
        if self.fingerprint_checked:
            return None
        import horovod.torch as hvd
        blob = describe_side(comp, info.params or [], info.size)
        mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        gathered = hvd.allgather(mine, name="hvdc.fingerprint", process_set=info.process_set)
        lengths = hvd.allgather(torch.tensor([mine.numel()], dtype=torch.int32), name="hvdc.fingerprint.len",
                                process_set=info.process_set)
        self.fingerprint_checked = True
        compare([b.numpy().tobytes() for b in torch.split(gathered, lengths.tolist())])
        return None

    def fallback_key(self, tensor, shape):
        # A direct hvd.allreduce(t, compression=c) outside an optimizer has no
        # parameter name.  The key is the shape plus the smallest index not held
        # by a tensor of that shape still in flight: repeated synchronous calls
        # of one tensor share "#0" (and its residual and step counter), while
        # several same-shape tensors in flight at once get #0, #1, ... in program
        # order, which Horovod already requires to be the same on every rank.
        base = "anon:" + "x".join(map(str, shape))
        held = self._in_flight.setdefault(base, set())
        n = 0
        while n in held:
            n += 1
        held.add(n)
        return f"{base}#{n}"

    def decompress(self, comp, output, pending):
        try:
            return super().decompress(comp, output, pending)
        finally:
            base, _, n = pending.key.rpartition("#")
            if pending.key.startswith("anon:") and n.isdigit():
                self._in_flight.get(base, set()).discard(int(n))

    def next_step(self, key):
        state = self.params.of(key)
        state.step = (state.step or 0) + 1
        return state.step

    def get_memory(self, name, key, numel, like):
        state = self.params.of(key)
        value = state.get_memory(name)
        if value is None or value.numel() != numel or value.device != like.device:
            value = torch.zeros(numel, dtype=torch.float32, device=like.device)
            state.set_memory(name, value)
        return value

    def set_memory(self, name, key, value):
        self.params.of(key).set_memory(name, value)
        return None

    def seed_for(self, base, step):
        return (base * 1_000_003 + int(step)) & 0x7FFF_FFFF_FFFF_FFFF

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
        import horovod.torch as hvd
        return hvd.alltoall_async(tensor.contiguous(), name=name, process_set=process_set)

    def compressed(self, key, info):
        """Once every tensor the optimizer reduces has been compressed this
        round (the count from its parameter list; unknown: right away), launch
        the two-phase first rounds waiting, together: one alltoall for all.
        The set is the same on every rank (all of the optimizer's tensors), so
        is the batch; tensors never compressed here (sparse gradients) leave
        the batch to the first decompress (:meth:`launch_second_rounds`)."""
        self._round_keys.add(key)
        if info.params and len(self._round_keys) < len(info.params):
            return
        self._round_keys = set()
        waiting = sorted((p for p in self.pending_rounds if getattr(p, "chunk_payloads", None) is not None),
                         key=lambda p: p.key)
        for transport in dict.fromkeys(p.transport for p in waiting):
            transport.launch_first_rounds([p for p in waiting if p.transport is transport])

    def launch_second_rounds(self, pending):
        waiting = sorted(self.pending_rounds, key=lambda p: p.key)
        if not any(p is pending for p in waiting):
            waiting.append(pending)
        self.pending_rounds = []
        self._round_keys = set()
        waiting = [p for p in waiting if not p.second_round_launched]
        # each transport launches its own together (PowerSGD batches its QRs), in key order
        for transport in dict.fromkeys(p.transport for p in waiting):
            transport.launch_second_rounds([p for p in waiting if p.transport is transport])

    def fused_codec(self, scheme, memory, x):
        from ..codecs.torch_fused import codec_for
        return codec_for(scheme, memory, x)

    def lowrank_codec(self, scheme, memory, x):
        from ..codecs.torch_lowrank import codec_for
        return codec_for(scheme, memory, x)

    def fused_momentum(self, memory, key, numel, x, ws, out):
        from ..codecs.torch_fused import apply_momentum
        return apply_momentum(x, self.get_memory("momentum", key, numel, x), memory, ws, out)

    def get_state(self, key, name, init):
        scheme_state = self.params.of(key).scheme
        if name not in scheme_state:
            scheme_state[name] = init()
        return scheme_state[name]

    def set_state(self, key, name, value):
        self.params.of(key).scheme[name] = value
        return None

    def wait(self, handle):
        import horovod.torch as hvd
        if isinstance(handle, PairSwap):
            return handle.result(hvd.synchronize(handle.handle))
        out = hvd.synchronize(handle)
        return out[0] if isinstance(out, tuple) else out  # alltoall also returns the received splits

    def nbytes(self, tensor):
        return tensor.numel() * tensor.element_size()

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

    # --- elastic Horovod ---------------------------------------------------------
    def residual_mass(self, rank, size):
        tensors, sumsq = 0, 0.0
        for key, state in self.params.items():
            if state.residual is None and state.owned_chunk_residual is None:
                continue
            folded = folded_residual(state.residual, state.owned_chunk_residual, rank, size, key)
            s = float(folded.double().square().sum())
            if s > 0:
                tensors, sumsq = tensors + 1, sumsq + s
        return tensors, sumsq

    def fold_owned_chunks(self, rank, size):
        for key, state in self.params.items():
            if state.owned_chunk_residual is not None:
                state.residual = folded_residual(state.residual, state.owned_chunk_residual, rank, size, key)
                state.owned_chunk_residual = None

    def forget_in_flight(self):
        self.pending_rounds = []
        self._in_flight = {}
        self._round_keys = set()
        self.fingerprint_checked = False

    def step_counts(self):
        return {key: int(state.step) for key, state in self.params.items() if state.step is not None}

    def set_step_counts(self, steps):
        for key, state in self.params.items():
            state.step = None
        for key, step in steps.items():
            self.params.of(key).step = int(step)

    # --- checkpoints -----------------------------------------------------------
    def state_dict(self):
        return torch_state_dict(self.params)

    def load_state_dict(self, state):
        self.reset()
        torch_load_state_dict(self.params, state)


def folded_residual(residual, owned, rank, size, key="?"):
    """``residual`` (flat, the whole tensor) plus the two-phase ``owned``
    chunk residual at the place of chunk ``rank`` of ``size`` (chunks of
    ``ceil(numel / size)`` elements, the last one zero-padded): a new tensor."""
    if owned is None:
        return residual
    numel = residual.numel()
    chunk = -(-numel // size)
    if owned.numel() != chunk:
        raise RuntimeError(f"hvd_compress: the two-phase residual of {key!r} has {owned.numel()} elements, not "
                           f"the {chunk} of a chunk of {numel} elements over {size} ranks: it cannot be folded "
                           f"back, which would drop its gradient mass")
    start, stop = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
    out = residual.clone()
    out[start:stop] += owned[:stop - start]
    return out


def torch_state_dict(table):
    """The states as ``{"<kind>/<key>[/<name>]": tensor}``: plain tensors (no
    pickled objects), for ``torch.save`` or safetensors."""
    out = {}
    for key, value in MemoryView(table, RESIDUAL).items():
        out[f"residual/{key}"] = value.detach().clone()
    for key, state in table.items():
        for name, value in state.memory.items():
            out[f"memory/{name}/{key}"] = value.detach().clone()
    for key, state in table.items():
        if state.step is not None:
            out[f"step/{key}"] = torch.tensor(state.step, dtype=torch.int64)
    for key, state in table.items():
        for name, value in state.scheme.items():
            if isinstance(value, torch.Tensor):
                out[f"scheme/{key}/{name}"] = value.detach().clone()
    return out


def torch_load_state_dict(table, entries):
    """The inverse of :func:`torch_state_dict`, into an empty table."""
    for entry, value in entries.items():
        kind, _, rest = entry.partition("/")
        if kind == "residual":
            MemoryView(table, RESIDUAL)[rest] = value.clone()
        elif kind == "memory":
            name, _, key = rest.partition("/")
            table.of(key).set_memory(name, value.clone())
        elif kind == "step":
            table.of(rest).step = int(value)
        elif kind == "scheme":
            key, _, name = rest.rpartition("/")
            table.of(key).scheme[name] = value.clone()
        else:
            raise ValueError(f"unknown entry {entry!r} in the torch state of hvd_compress")


def _dtype(name):
    """The torch dtype of a :meth:`hvd_compress.backend.torch_backend.TorchBackend.dtype_name` (``float32``, ``uint8``, ...)."""
    return getattr(torch, name)
