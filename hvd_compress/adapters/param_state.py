"""What hvd_compress keeps for one parameter between steps, on one rank.

The state stores (:class:`hvd_compress.protocols.StateStore`) keep one
:class:`ParamState` per parameter key; transports reach it through the
store's ``get_memory``/``set_memory`` and ``get_state``/``set_state``, by the
slot names of :mod:`hvd_compress.feedback.memory`.  The values are plain
tensors in PyTorch and ``tf.Variable``s in TensorFlow; each adapter has one
pair of functions that turns its states into a checkpoint and back.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator

from ..feedback.memory import OWNED_CHUNK_RESIDUAL, RESIDUAL  # noqa: F401  (the slot names, re-exported)

#: how checkpoints and ``residuals`` views name the owner's residual: the key plus this
OWNED_CHUNK_SUFFIX = "#owned_chunk"


@dataclass(slots=True)
class ParamState:
    """Per-parameter state.  Every field starts empty and is created at the
    first step that needs it, on the device and dtype of the gradient."""

    #: error feedback: what compression has left out and not sent yet, flat
    #: float32 (Seide et al. 2014); what the memory adds to the next gradient
    residual: Any = None
    #: the memory's other state by name (the velocity "momentum" of DGC's and
    #: of the momentum memory), flat float32 like the residual
    memory: Dict[str, Any] = field(default_factory=dict)
    #: this tensor's communications so far (an int in PyTorch, an int64
    #: tf.Variable in TensorFlow); schedules and the seeded draws read it
    step: Any = None
    #: scheme state kept across steps, by name (PowerSGD's warm-started Q).
    #: Random draws need none: they are seeded by (seed, key, rank, step)
    scheme: Dict[str, Any] = field(default_factory=dict)
    #: two-phase transport: the residual of the chunk this rank owns and re-encodes
    owned_chunk_residual: Any = None
    #: scratch buffers reused from step to step (what fused kernels will need),
    #: by name; never checkpointed: they hold nothing between steps
    workspace: Dict[str, Any] = field(default_factory=dict)

    def get_memory(self, name):
        """A memory state by the name the memory uses (None until set)."""
        if name == RESIDUAL:
            return self.residual
        if name == OWNED_CHUNK_RESIDUAL:
            return self.owned_chunk_residual
        return self.memory.get(name)

    def set_memory(self, name, value):
        if name == RESIDUAL:
            self.residual = value
        elif name == OWNED_CHUNK_RESIDUAL:
            self.owned_chunk_residual = value
        else:
            self.memory[name] = value


class StateTable(Dict[str, ParamState]):
    """Parameter key -> its :class:`ParamState`."""

    def of(self, key) -> ParamState:
        state = self.get(key)
        if state is None:
            state = self[key] = ParamState()
        return state


class MemoryView(MutableMapping):
    """``{key: value}`` of one memory state over a table, for reading (and
    setting) what is kept without knowing the layout.  The residual view also
    lists each two-phase owner's residual under ``key + OWNED_CHUNK_SUFFIX``."""

    def __init__(self, table: StateTable, name: str):
        self.table, self.name = table, name

    def _entries(self) -> Iterator:
        for key, state in self.table.items():
            value = state.get_memory(self.name)
            if value is not None:
                yield key, value
            if self.name == RESIDUAL and state.owned_chunk_residual is not None:
                yield key + OWNED_CHUNK_SUFFIX, state.owned_chunk_residual

    def _locate(self, key):
        if self.name == RESIDUAL and key.endswith(OWNED_CHUNK_SUFFIX):
            return key[:-len(OWNED_CHUNK_SUFFIX)], OWNED_CHUNK_RESIDUAL
        return key, self.name

    def __getitem__(self, key):
        owner, name = self._locate(key)
        value = self.table[owner].get_memory(name) if owner in self.table else None
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key, value):
        owner, name = self._locate(key)
        self.table.of(owner).set_memory(name, value)

    def __delitem__(self, key):
        owner, name = self._locate(key)
        self[key]  # noqa: B018  (KeyError where absent)
        self.table[owner].set_memory(name, None)

    def __iter__(self):
        return (key for key, _ in self._entries())

    def __len__(self):
        return sum(1 for _ in self._entries())


class StepView(MutableMapping):
    """``{key: communications so far}`` over a table."""

    def __init__(self, table: StateTable):
        self.table = table

    def __getitem__(self, key):
        state = self.table.get(key)
        if state is None or state.step is None:
            raise KeyError(key)
        return state.step

    def __setitem__(self, key, value):
        self.table.of(key).step = value

    def __delitem__(self, key):
        self[key]  # noqa: B018
        self.table[key].step = None

    def __iter__(self):
        return (key for key, state in self.table.items() if state.step is not None)

    def __len__(self):
        return sum(1 for _ in self)
