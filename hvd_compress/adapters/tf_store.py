"""TensorFlow's per-parameter state store: ``tf.Variable``s made once per
key outside every trace (:func:`~hvd_compress.backend.tf_backend.state_variable`),
tracked by one ``tf.Module`` (the checkpoint's layout, :func:`tf_checkpoint_slot`),
updated by ``assign`` ops the outputs depend on."""
from __future__ import annotations

import numbers

import tensorflow as tf

from ..backend import backend_for
from ..backend.tf_backend import state_variable
from .param_state import OWNED_CHUNK_RESIDUAL, OWNED_CHUNK_SUFFIX, RESIDUAL, StateTable


def tracked_variable(tracked, key, init, dtype):
    """``tracked[key]``, made (outside every trace) and put there if absent."""
    v = tracked.get(key)
    if v is None:  # created once, outside every trace
        v = state_variable(init, dtype, name="hvdc_" + "".join(c if c.isalnum() else "_" for c in key))
        tracked[key] = v
    return v


class _Element:
    """Element ``index`` of a variable, read when the stats are read."""

    def __init__(self, variable, index):
        self.variable, self.index = variable, index

    def numpy(self):
        return self.variable.numpy()[self.index]


class TFStore:
    """The state of every parameter (:class:`hvd_compress.protocols.StateStore`)."""

    def __init__(self):
        self.B = backend_for(tf.zeros([0]))
        #: the tf.Module that tracks every state variable (``tf_checkpointable``),
        #: made by the first :meth:`reset` (the adapter's, when it is built)
        self.module = None
        #: parameter key -> its ParamState
        self.params = StateTable()

    def reset(self):
        """Zero every state variable in place where there are residuals (they
        stay tracked and restorable); else make the empty state.  Returns
        whether the state was made anew."""
        if self.module is not None and self.module.residuals:
            module = self.module
            for v in list(module.residuals.values()) + [v for store in module.memories.values()
                                                         for v in store.values()]:
                v.assign(tf.zeros_like(v))
            for v in module.steps.values():
                v.assign(0)
            return False
        # The state lives in dicts tracked by one tf.Module, created before any
        # variable: a tf.train.Checkpoint restored before the first trace then
        # holds its values as deferred restorations, and TF applies each one
        # when the variable is created and put in its dict (at the first trace).
        module = tf.Module(name="hvd_compress_state")
        module.residuals, module.memories, module.steps, module.scheme_state = {}, {}, {}, {}
        self.module = module
        self.params = StateTable()
        self._latest, self._call_counters, self._scheme_names = {}, {}, {}
        return True

    def next_step(self, key):
        state = self.params.of(key)
        if state.step is None:
            state.step = tracked_variable(*tf_checkpoint_slot(self.module, "step", key), 0, tf.int64)
        # read once: each use of assign_add's lazy result would read the variable again
        return tf.convert_to_tensor(state.step.assign_add(1))

    def memory_variable(self, name, key, init):
        """The variable of memory state ``name`` of ``key``: the one in its
        ParamState, else the one at its checkpoint slot (a restored one), else a
        new one of value ``init`` (a value, or a callable) put there."""
        state = self.params.of(key)
        variable = state.get_memory(name)
        if variable is None:
            variable = tracked_variable(*tf_checkpoint_slot(self.module, "memory", key, name), init, tf.float32)
            state.set_memory(name, variable)
        return variable

    def get_memory(self, name, key, numel, like):
        return self.memory_variable(name, key, lambda: tf.zeros([numel])).read_value()

    def set_memory(self, name, key, value):
        return self.params.of(key).get_memory(name).assign(value)

    def residual_variable(self, key):
        """The residual ``tf.Variable`` of ``key`` (a fused encode updates it in place)."""
        return self.params.of(key).get_memory(RESIDUAL)

    def get_state(self, key, name, init):
        scheme_state = self.params.of(key).scheme
        if name not in scheme_state:
            scheme_state[name] = tracked_variable(*tf_checkpoint_slot(self.module, "scheme", key, name), init,
                                                  tf.float32)
        return scheme_state[name].read_value()

    def set_state(self, key, name, value):
        return self.params.of(key).scheme[name].assign(value)

    def workspace(self, key):
        """Scratch of one parameter (the TF codecs keep nothing between steps)."""
        return self.params.of(key).workspace

    def record_bytes(self, comp, key, scheme, numel, nbytes):
        # Variables: this runs when the step is traced (under a schedule, once
        # for every branch, one after another), while only the branch that runs
        # may set the bytes, count the call and name its scheme.  The bytes and
        # the scheme's index share one variable, set by one op: a model's trace
        # builds these ops for every tensor.
        names = self._scheme_names.setdefault(key, [])
        if scheme.name not in names:
            names.append(scheme.name)
        which = names.index(scheme.name)
        latest = tracked_variable(self._latest, key, [0, 0], tf.int64)  # (bytes, index in names)
        if isinstance(nbytes, numbers.Integral):
            latest.assign(tf.constant([int(nbytes), which], tf.int64))
        else:
            latest.assign(tf.stack([tf.cast(nbytes, tf.int64), tf.constant(which, tf.int64)]))
        calls = tracked_variable(self._call_counters, key, 0, tf.int64)
        calls.assign_add(1)
        comp.stats.record(key, lambda: names[int(latest.numpy()[1])], 4 * numel, _Element(latest, 0), calls=calls)

    # --- checkpoints ----------------------------------------------------------------
    def state_dict(self):
        module = self.module
        out = {f"residual/{k}": v.numpy() for k, v in module.residuals.items()}
        out.update({f"step/{k}": v.numpy() for k, v in module.steps.items()})
        out.update({f"memory/{n}/{k}": v.numpy() for n, store in module.memories.items() for k, v in store.items()})
        out.update({f"scheme/{k}": v.numpy() for k, v in module.scheme_state.items()})
        return out

    def load_state_dict(self, state):
        """Assign ``state`` into the tracked variables (made where absent);
        returns False: merged in place, so traced steps keep their variables."""
        module = self.module
        for name, value in state.items():
            kind, _, key = name.partition("/")
            if kind == "memory":
                memory_name, _, key = key.partition("/")
                store, key = tf_checkpoint_slot(module, "memory", key, memory_name)
            elif kind in ("residual", "step", "scheme"):
                store = {"residual": module.residuals, "step": module.steps, "scheme": module.scheme_state}[kind]
            else:
                raise ValueError(f"unknown entry {name!r} in the TF state of hvd_compress")
            if key in store:
                store[key].assign(value)
            else:  # the ParamState picks it up from its slot at the first use
                tracked_variable(store, key, value, tf.int64 if kind == "step" else tf.float32)
        return False


def tf_checkpoint_slot(module, kind, key, name=None):
    """Where one state variable lives in the ``tf.Module`` that
    ``tf_checkpointable()`` returns, and so in checkpoints: (tracked dict, key
    in it).  ``kind`` is "memory" (``name`` the memory state), "step" or
    "scheme" (``name`` the scheme state).  The layout is what earlier releases
    wrote, so their checkpoints still restore."""
    if kind == "step":
        return module.steps, key
    if kind == "scheme":
        return module.scheme_state, f"{key}/{name}"
    if name == RESIDUAL:
        return module.residuals, key
    if name == OWNED_CHUNK_RESIDUAL:
        return module.residuals, key + OWNED_CHUNK_SUFFIX
    if name not in module.memories:
        module.memories[name] = {}  # assigned through the wrapper, so the inner dict is tracked too
    return module.memories[name], key
