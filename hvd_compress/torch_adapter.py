"""PyTorch side: state in plain tensors, side collectives by Horovod's async
allgather, the parameter's name read from the stock optimizer's frame."""
from __future__ import annotations

import torch

from . import horovod_compat
from .adapter import AdapterBase, CallerInfo
from .backend import backend_for
from .fingerprint import compare, describe_side


class AdasumNotSupported(ValueError):
    pass


class TorchAdapter(AdapterBase):
    defer_second_rounds = True

    def __init__(self):
        self.B = backend_for(torch.zeros(0))
        super().__init__()

    def reset(self):
        super().reset()
        self.fingerprint_checked = False
        self.residuals = {}
        self.memories = {}
        self.steps = {}
        self._in_flight = {}

    def caller_info(self, tensor):
        import horovod.torch as hvd
        caller = horovod_compat.find_torch_caller()
        if caller.optimizer is not None and horovod_compat.is_adasum(caller.optimizer):
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
            horovod_compat.warn_fallback_key(key, "torch")
        return CallerInfo(key, ps, ps.rank(), ps.size(), caller.params())

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
        self.steps[key] = self.steps.get(key, 0) + 1
        return self.steps[key]

    def _store(self, name):
        return self.residuals if name == "residual" else self.memories.setdefault(name, {})

    def get_memory(self, name, key, numel, like):
        store = self._store(name)
        r = store.get(key)
        if r is None or r.numel() != numel or r.device != like.device:
            r = torch.zeros(numel, dtype=torch.float32, device=like.device)
            store[key] = r
        return r

    def set_memory(self, name, key, value):
        self._store(name)[key] = value
        return None

    def seed_for(self, base, step):
        return (base * 1_000_003 + int(step)) & 0x7FFF_FFFF_FFFF_FFFF

    def allgather(self, tensor, name, process_set):
        import horovod.torch as hvd
        return hvd.allgather_async(tensor.contiguous(), name=name, process_set=process_set)

    def allreduce_sum(self, tensor, name, process_set):
        import horovod.torch as hvd
        return hvd.allreduce_async(tensor.contiguous(), name=name, op=hvd.Sum, process_set=process_set)

    def alltoall(self, tensor, name, process_set):
        import horovod.torch as hvd
        return hvd.alltoall_async(tensor.contiguous(), name=name, process_set=process_set)

    def launch_second_rounds(self, pending):
        waiting = sorted(self.pending_rounds, key=lambda p: p.key)
        if not any(p is pending for p in waiting):
            waiting.append(pending)
        self.pending_rounds = []
        for p in waiting:
            if not p.second_round_launched:
                p.transport.launch_second_round(p)

    def get_state(self, key, name, init):
        st = self.scheme_state.setdefault(key, {})
        if name not in st:
            st[name] = init()
        return st[name]

    def set_state(self, key, name, value):
        self.scheme_state.setdefault(key, {})[name] = value
        return None

    def wait(self, handle):
        import horovod.torch as hvd
        out = hvd.synchronize(handle)
        return out[0] if isinstance(out, tuple) else out  # alltoall also returns the received splits

    def nbytes(self, tensor):
        return tensor.numel() * tensor.element_size()

    # --- checkpoints -----------------------------------------------------------
    def state_dict(self):
        out = {}
        for k, v in self.residuals.items():
            out[f"residual/{k}"] = v.detach().clone()
        for name, store in self.memories.items():
            for k, v in store.items():
                out[f"memory/{name}/{k}"] = v.detach().clone()
        for k, v in self.steps.items():
            out[f"step/{k}"] = torch.tensor(v, dtype=torch.int64)
        for k, st in self.scheme_state.items():
            for name, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"scheme/{k}/{name}"] = v.detach().clone()
        return out

    def load_state_dict(self, state):
        self.reset()
        for name, v in state.items():
            kind, _, rest = name.partition("/")
            if kind == "residual":
                self.residuals[rest] = v.clone()
            elif kind == "memory":
                name, _, key = rest.partition("/")
                self.memories.setdefault(name, {})[key] = v.clone()
            elif kind == "step":
                self.steps[rest] = int(v)
            elif kind == "scheme":
                key, _, field = rest.rpartition("/")
                self.scheme_state.setdefault(key, {})[field] = v.clone()
            else:
                raise ValueError(f"unknown entry {name!r} in the torch state of hvd_compress")
