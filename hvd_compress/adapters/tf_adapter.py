"""TensorFlow side: state in ``tf.Variable``s, side collectives by Horovod's
TF allgather, the variable's name read from Horovod's frames.

Horovod always traces ``compress`` inside a ``tf.function`` (and inside a
``tf.cond`` on the world size), so Python here runs once per trace.  All
state therefore lives in variables made once per key outside every trace
(:mod:`hvd_compress.adapters.tf_store`; :mod:`hvd_compress.adapters.tf_traces`:
keys that follow the ``tf.Variable``, compressors rebuilt by a retrace) and is
updated with ``assign`` ops that the outputs depend on; counters are read in
the graph, not in Python.
"""
from __future__ import annotations

import tensorflow as tf

from ..codecs.providers import TFCodecs
from ..integration import horovod_internals
from ..integration.fingerprint import compare, describe_side
from ..transports import RESOLVED, ResolvedPending
from ..transports.base import Roles, pending_fields
from .base import AdapterBase, CallerInfo, SecondRounds
from .param_state import OWNED_CHUNK_SUFFIX
from .tf_collectives import TFCollectives
from .tf_store import TFStore, tf_checkpoint_slot, tracked_variable  # noqa: F401  (tf_checkpoint_slot re-exported)
from .tf_traces import VariableKeys, note_traced_graph


class TFAdapter(AdapterBase):
    def __init__(self):
        store = TFStore()
        super().__init__(Roles(B=store.B, collectives=TFCollectives(), store=store, codecs=TFCodecs(store),
                               rounds=SecondRounds()))

    def reset(self):
        """Zero every state variable in place where there are residuals: they
        stay tracked by ``state_module`` (and restorable), and traced steps
        keep using them; else start again from the empty state."""
        if self.roles.store.reset():
            self.forget_in_flight()
            #: the state key of each tf.Variable seen
            self._variable_keys = VariableKeys()

    @property
    def state_module(self):
        """The ``tf.Module`` tracking every state variable (``tf_checkpointable``)."""
        return self.roles.store.module

    # the tracked dicts of the state: {key: tf.Variable}
    @property
    def residuals(self):
        return self.roles.store.module.residuals

    @property
    def memories(self):
        return self.roles.store.module.memories

    def _caller_info(self, tensor):
        import horovod.tensorflow as hvd
        note_traced_graph()  # this trace holds ps.rank() and ps.size(): elastic Horovod retraces it
        caller = horovod_internals.find_tf_caller(tensor)
        ps = caller.process_set if caller.process_set is not None else hvd.global_process_set
        if caller.variables is None:
            return CallerInfo(None, ps, ps.rank(), ps.size(), None)
        keys = self._variable_keys.keys_for(caller.variables)
        params = [(k, tuple(v.shape.as_list())) for k, v in zip(keys, caller.variables)]
        if caller.index is None:
            # Horovod's gradient list was found but not this gradient in it
            key = self._fallback_key(tensor, tuple(tensor.shape.as_list()))
            horovod_internals.warn_fallback_key(key, "TensorFlow")
        else:
            key = keys[caller.index]
        return CallerInfo(key, ps, ps.rank(), ps.size(), params)

    def key_of(self, variable):
        """The state key of ``variable`` (for ``state_dict()`` entries such as
        ``residual/<key>``), or None if no gradient of it has been compressed."""
        return self._variable_keys.key_of(variable)

    def _pin_shape(self, tensor, info):
        # Keras' DistributedOptimizer(sparse_as_dense=True) densifies an
        # Embedding's IndexedSlices into a tensor of shape (None, d), though
        # the gradient of a variable has the variable's shape.  Every scheme
        # needs the element count when the graph is built (Top-K's k, the
        # payload sizes), so take the shape from the variable Horovod is
        # reducing for; tf.ensure_shape checks it when the step runs.
        if tensor.shape.is_fully_defined() or info.key is None:
            return tensor
        known = dict(info.params or []).get(info.key)
        if known is None or None in known or not tensor.shape.is_compatible_with(known):
            return tensor  # B.numel raises the error that names the tensor
        return tf.ensure_shape(tensor, known)

    def _check_fingerprint(self, comp, info):
        """Run once, eagerly, while the first trace is being built: every rank
        traces the same step function at its first call, so every rank gets
        here together.  Doing it in the graph instead would let mismatched
        payload collectives start alongside the check and hang."""
        if self._fingerprint_checked:
            return None
        import horovod.tensorflow as hvd
        import numpy as np
        blob = describe_side(comp, info.params or [], info.size)
        with tf.init_scope():
            mine = tf.constant(np.frombuffer(blob, dtype=np.uint8))
            gathered = hvd.allgather(mine, name="hvdc.fingerprint", process_set=info.process_set,
                                     ignore_name_scope=True).numpy()
            lengths = hvd.allgather(tf.constant([len(blob)], tf.int32), name="hvdc.fingerprint.len",
                                    process_set=info.process_set, ignore_name_scope=True).numpy()
        self._fingerprint_checked = True
        compare(np.split(gathered, np.cumsum(lengths)[:-1]))
        return None

    def _fallback_key(self, tensor, shape):
        # Graph tensor names are deterministic for the same program on every rank.
        try:
            return "tensor:" + tensor.name
        except AttributeError:
            return "anon:" + "x".join(map(str, shape))

    def _var(self, tracked, key, init, dtype):
        return tracked_variable(tracked, key, init, dtype)

    def _resolved_branch(self, call, tag, phase):
        """A ``tf.switch_case`` branch that runs ``phase`` for this call, its
        collectives named with ``tag``, and returns (the aggregated dense sum,
        whether the op's scaling applies to it)."""
        def run():
            out, pending = self._compress_with(phase, call.renamed(f"{call.key}{tag}"))
            dense = pending.transport.resolve_now(pending, out)
            return dense, tf.constant(1.0 if phase.scheme.apply_op_scale else 0.0)
        return run

    def _compress_scheduled(self, phases, call):
        """Graph mode: the phase is chosen at run time by ``tf.switch_case`` on
        the step variable.  Each branch runs its own collectives (all ranks
        take the same branch: the step is the same everywhere) and returns the
        aggregated sum, so nothing crosses from compress to decompress but a
        dense tensor; Horovod's placeholder still supplies the op's scaling."""
        starts = tf.constant([phase.start for phase in phases[1:]], tf.int64)
        index = tf.reduce_sum(tf.cast(tf.cast(call.step, tf.int64) - 1 >= starts, tf.int32))

        dense, apply_scale = tf.switch_case(index, [self._resolved_branch(call, f"@{i}", phase)
                                                    for i, phase in enumerate(phases)])
        pending = ResolvedPending(transport=RESOLVED, dense=dense, apply_scale=apply_scale, **pending_fields(call))
        return self.B.identity_with_deps(tf.ones([1], tf.float32), [dense]), pending

    # --- elastic Horovod (eager, between steps) -----------------------------------------
    def _owned_chunks(self):
        """{key: (residual variable, owned chunk variable)} of the two-phase tensors."""
        out = {}
        for key, v in self.residuals.items():
            if key.endswith(OWNED_CHUNK_SUFFIX):
                base = key[:-len(OWNED_CHUNK_SUFFIX)]
                out[base] = (self.residuals.get(base), v)
        return out

    def residual_mass(self, rank, size):
        owned = self._owned_chunks()
        tensors, sumsq = 0, 0.0
        for key, v in self.residuals.items():
            if key.endswith(OWNED_CHUNK_SUFFIX):
                continue
            r = v.numpy().astype("float64")
            if key in owned:
                r = fold_into(r, owned[key][1].numpy(), rank, size, key)
            s = float((r * r).sum())
            if s > 0:
                tensors, sumsq = tensors + 1, sumsq + s
        return tensors, sumsq

    def fold_owned_chunks(self, rank, size):
        for key, (residual, owned) in self._owned_chunks().items():
            residual.assign(fold_into(residual.numpy(), owned.numpy(), rank, size, key))
            # the next trace cuts chunks for the new world: a new variable of the new chunk size
            del self.residuals[key + OWNED_CHUNK_SUFFIX]
            self.roles.store.params.of(key).owned_chunk_residual = None

    def step_counts(self):
        return {key: int(v.numpy()) for key, v in self.state_module.steps.items()}

    def set_step_counts(self, steps):
        tracked = self.state_module.steps
        for key, v in tracked.items():
            v.assign(int(steps.get(key, 0)))
        for key, step in steps.items():
            if key not in tracked:
                tracked_variable(tracked, key, int(step), tf.int64)


def fold_into(residual, owned, rank, size, key="?"):
    """numpy: ``residual`` plus the two-phase ``owned`` chunk residual at the
    place of chunk ``rank`` of ``size`` (see torch_adapter.folded_residual)."""
    import numpy as np
    residual = np.array(residual, copy=True)
    numel = residual.size
    chunk = -(-numel // size)
    if owned.size != chunk:
        raise RuntimeError(f"hvd_compress: the two-phase residual of {key!r} has {owned.size} elements, not the "
                           f"{chunk} of a chunk of {numel} elements over {size} ranks: it cannot be folded back, "
                           f"which would drop its gradient mass")
    start, stop = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
    residual[start:stop] += owned[:stop - start]
    return residual
