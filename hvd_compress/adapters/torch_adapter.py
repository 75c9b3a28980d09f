"""PyTorch side: the parameter's name read from the stock optimizer's frame,
the roles every transport is handed (Horovod's async collectives, state in
plain tensors, the fused CPU codecs), and second rounds deferred to the
first ``decompress`` of a step."""
from __future__ import annotations

import torch

from ..codecs.providers import TorchCodecs
from ..integration import horovod_internals
from ..integration.fingerprint import compare, describe_side
from ..transports.base import Roles
from .base import AdapterBase, CallerInfo, DeferredRounds
from .param_state import RESIDUAL, MemoryView, StepView
from .torch_collectives import PairSwap, TorchCollectives  # noqa: F401  (PairSwap re-exported)
from .torch_store import TorchStore, folded_residual, torch_load_state_dict, torch_state_dict  # noqa: F401


class AdasumNotSupported(ValueError):
    pass


class TorchAdapter(AdapterBase):
    def __init__(self):
        store = TorchStore()
        super().__init__(Roles(B=store.B, collectives=TorchCollectives(), store=store,
                               codecs=TorchCodecs(store), rounds=DeferredRounds()))
        #: (optimizer, its parameter count, its [(name, shape)]): :meth:`_params_of`
        self._params_cache = None

    def forget_in_flight(self):
        super().forget_in_flight()
        #: anonymous keys of same-shape tensors still in flight (``_fallback_key``)
        self._in_flight = {}

    # views of the per-parameter state by kind: {key: value}
    @property
    def residuals(self):
        return MemoryView(self.roles.store.params, RESIDUAL)

    @property
    def memories(self):
        params = self.roles.store.params
        names = sorted({name for state in params.values() for name in state.memory})
        return {name: MemoryView(params, name) for name in names}

    @property
    def steps(self):
        return StepView(self.roles.store.params)

    def _caller_info(self, tensor):
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
            key = self._fallback_key(tensor, tuple(tensor.shape))
            horovod_internals.warn_fallback_key(key, "torch")
        return CallerInfo(key, ps, ps.rank(), ps.size(), self._params_of(caller), owns_input=True)

    def _horovod_takes_as_is(self, tensor):
        # Horovod refuses a non-contiguous tensor ("Tensor is required to be
        # contiguous"): a channels_last gradient keeps the flattening copy
        return tensor.dtype == torch.float32 and tensor.is_contiguous()

    def _params_of(self, caller):
        """The optimizer's ``[(name, shape)]``, built once per optimizer and
        parameter count: every tensor's call needs it (the round's count), and
        building it anew each call costs O(tensors^2) a step (21 ms a step on
        a 161-tensor ResNet-50 here)."""
        optimizer, count = caller.optimizer, len(caller.optimizer._parameter_names)
        cached = self._params_cache
        if cached is None or cached[0] is not optimizer or cached[1] != count:
            cached = self._params_cache = (optimizer, count, caller.params())
        return cached[2]

    def _check_fingerprint(self, comp, info):
        # Blocking is safe here: it is the first collective every rank issues
        # for this compressor, under one fixed name.
        if self._fingerprint_checked:
            return None
        import horovod.torch as hvd
        blob = describe_side(comp, info.params or [], info.size)
        mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        gathered = hvd.allgather(mine, name="hvdc.fingerprint", process_set=info.process_set)
        lengths = hvd.allgather(torch.tensor([mine.numel()], dtype=torch.int32), name="hvdc.fingerprint.len",
                                process_set=info.process_set)
        self._fingerprint_checked = True
        compare([b.numpy().tobytes() for b in torch.split(gathered, lengths.tolist())])
        return None

    def _fallback_key(self, tensor, shape):
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

    # --- elastic Horovod ---------------------------------------------------------
    def residual_mass(self, rank, size):
        tensors, sumsq = 0, 0.0
        for key, state in self.roles.store.params.items():
            if state.residual is None and state.owned_chunk_residual is None:
                continue
            folded = folded_residual(state.residual, state.owned_chunk_residual, rank, size, key)
            s = float(folded.double().square().sum())
            if s > 0:
                tensors, sumsq = tensors + 1, sumsq + s
        return tensors, sumsq

    def fold_owned_chunks(self, rank, size):
        for key, state in self.roles.store.params.items():
            if state.owned_chunk_residual is not None:
                state.residual = folded_residual(state.residual, state.owned_chunk_residual, rank, size, key)
                state.owned_chunk_residual = None

    def step_counts(self):
        return {key: int(state.step) for key, state in self.roles.store.params.items() if state.step is not None}

    def set_step_counts(self, steps):
        params = self.roles.store.params
        for key, state in params.items():
            state.step = None
        for key, step in steps.items():
            params.of(key).step = int(step)
