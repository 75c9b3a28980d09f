"""PyTorch's per-parameter state store: plain tensors in a
:class:`~hvd_compress.adapters.param_state.StateTable`, made at first use on
the gradient's device, and their checkpoint (plain tensors, no pickles)."""
from __future__ import annotations

import torch

from ..backend import backend_for
from .param_state import RESIDUAL, MemoryView, StateTable


class TorchStore:
    """The state of every parameter (:class:`hvd_compress.protocols.StateStore`)."""

    def __init__(self):
        self.B = backend_for(torch.zeros(0))
        self.reset()

    def reset(self):
        """Forget every parameter's state."""
        #: parameter key -> its ParamState
        self.params = StateTable()

    def get_memory(self, name, key, numel, like):
        """Error-feedback state ``name`` ("residual", "momentum") of a tensor."""
        state = self.params.of(key)
        value = state.get_memory(name)
        if value is None or value.numel() != numel or value.device != like.device:
            value = torch.zeros(numel, dtype=torch.float32, device=like.device)
            state.set_memory(name, value)
        return value

    def set_memory(self, name, key, value):
        self.params.of(key).set_memory(name, value)
        return None

    def get_state(self, key, name, init):
        """Scheme state that persists across steps (PowerSGD's Q)."""
        scheme_state = self.params.of(key).scheme
        if name not in scheme_state:
            scheme_state[name] = init()
        return scheme_state[name]

    def set_state(self, key, name, value):
        self.params.of(key).scheme[name] = value
        return None

    def workspace(self, key):
        """Scratch buffers of one parameter, reused from step to step."""
        return self.params.of(key).workspace

    def next_step(self, key):
        state = self.params.of(key)
        state.step = (state.step or 0) + 1
        return state.step

    def record_bytes(self, comp, key, scheme, numel, nbytes):
        comp.stats.record(key, scheme.name, 4 * numel, nbytes)

    def state_dict(self):
        return torch_state_dict(self.params)

    def load_state_dict(self, state):
        """Replace every parameter's state by ``state``; returns True (replaced, not merged)."""
        self.reset()
        torch_load_state_dict(self.params, state)
        return True


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
