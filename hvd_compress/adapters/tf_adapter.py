"""TensorFlow side: state in ``tf.Variable``s, side collectives by Horovod's
TF allgather, the variable's name read from Horovod's frames.

Horovod always traces ``compress`` inside a ``tf.function`` (and inside a
``tf.cond`` on the world size), so Python here runs once per trace.  All
state therefore lives in variables made once per key outside every trace
(:mod:`hvd_compress.adapters.tf_traces`: keys that follow the ``tf.Variable``, state
that a retrace may add, compressors rebuilt by a retrace) and is updated with
``assign`` ops that the outputs depend on; counters are read in the graph, not
in Python.
"""
from __future__ import annotations

from dataclasses import replace

import tensorflow as tf

from ..integration import horovod_internals
from .base import AdapterBase, CallerInfo, pair_swap_min_bytes
from ..backend import backend_for
from ..integration.fingerprint import compare, describe_side
from .param_state import OWNED_CHUNK_RESIDUAL, OWNED_CHUNK_SUFFIX, RESIDUAL
from ..transports import RESOLVED, ResolvedPending
from .tf_traces import VariableKeys, state_variable
from ..transports.base import pending_fields


class TFAdapter(AdapterBase):
    def __init__(self):
        self.B = backend_for(tf.zeros([0]))
        super().__init__()

    def reset(self):
        if getattr(self, "residuals", None):
            for v in list(self.residuals.values()) + [v for store in self.memories.values() for v in store.values()]:
                v.assign(tf.zeros_like(v))
            for v in self.steps.values():
                v.assign(0)
            return
        super().reset()
        self.fingerprint_checked = False
        # The state lives in dicts tracked by one tf.Module, created before any
        # variable: a tf.train.Checkpoint restored before the first trace then
        # holds its values as deferred restorations, and TF applies each one
        # when the variable is created and put in its dict (at the first trace).
        module = tf.Module(name="hvd_compress_state")
        module.residuals, module.memories, module.steps, module.scheme_state = {}, {}, {}, {}
        self.state_module = module
        self.residuals = module.residuals  # the tracking wrappers, not the dicts assigned
        self.memories = module.memories
        self.steps = module.steps
        self.scheme_vars = module.scheme_state
        self.byte_counters = {}
        self.call_counters = {}
        self.scheme_index = {}
        self.scheme_names = {}
        self.variable_keys = VariableKeys()

    def caller_info(self, tensor):
        import horovod.tensorflow as hvd
        caller = horovod_internals.find_tf_caller(tensor)
        ps = caller.process_set if caller.process_set is not None else hvd.global_process_set
        if caller.variables is None:
            return CallerInfo(None, ps, ps.rank(), ps.size(), None)
        keys = self.keys_for(caller.variables)
        params = [(k, tuple(v.shape.as_list())) for k, v in zip(keys, caller.variables)]
        if caller.index is None:
            # Horovod's gradient list was found but not this gradient in it
            key = self.fallback_key(tensor, tuple(tensor.shape.as_list()))
            horovod_internals.warn_fallback_key(key, "TensorFlow")
        else:
            key = keys[caller.index]
        return CallerInfo(key, ps, ps.rank(), ps.size(), params)

    def keys_for(self, variables):
        """The state key of each variable in a list Horovod reduces (:class:`~hvd_compress.adapters.tf_traces.VariableKeys`)."""
        return self.variable_keys.keys_for(variables)

    def key_of(self, variable):
        """The state key of ``variable`` (for ``state_dict()`` entries such as
        ``residual/<key>``), or None if no gradient of it has been compressed."""
        return self.variable_keys.key_of(variable)

    def pin_shape(self, tensor, info):
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

    def check_fingerprint(self, comp, info):
        """Run once, eagerly, while the first trace is being built: every rank
        traces the same step function at its first call, so every rank gets
        here together.  Doing it in the graph instead would let mismatched
        payload collectives start alongside the check and hang."""
        if self.fingerprint_checked:
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
        self.fingerprint_checked = True
        compare(np.split(gathered, np.cumsum(lengths)[:-1]))
        return None

    def fallback_key(self, tensor, shape):
        # Graph tensor names are deterministic for the same program on every rank.
        try:
            return "tensor:" + tensor.name
        except AttributeError:
            return "anon:" + "x".join(map(str, shape))

    def _var(self, store, key, init, dtype):
        v = store.get(key)
        if v is None:  # created once, outside every trace
            v = state_variable(init, dtype, name="hvdc_" + "".join(c if c.isalnum() else "_" for c in key))
            store[key] = v
        return v

    def resolved_branch(self, call, tag, phase):
        """A ``tf.switch_case`` branch that runs ``phase`` for this call, its
        collectives named with ``tag``, and returns (the aggregated dense sum,
        whether the op's scaling applies to it)."""
        def run():
            out, pending = self._compress_with(phase, replace(call, coll_key=f"{call.key}{tag}"))
            dense = self.resolve_now(call.comp, out, pending)
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

        dense, apply_scale = tf.switch_case(index, [self.resolved_branch(call, f"@{i}", phase)
                                                    for i, phase in enumerate(phases)])
        pending = ResolvedPending(transport=RESOLVED, dense=dense, apply_scale=apply_scale, **pending_fields(call))
        return self.B.identity_with_deps(tf.ones([1], tf.float32), [dense]), pending

    def next_step(self, key):
        state = self.params.of(key)
        if state.step is None:
            state.step = self._var(*tf_checkpoint_slot(self.state_module, "step", key), 0, tf.int64)
        return state.step.assign_add(1)

    def _memory_variable(self, name, key, init):
        """The variable of memory state ``name`` of ``key``: the one in its
        ParamState, else the one at its checkpoint slot (a restored one), else a
        new one put there."""
        state = self.params.of(key)
        variable = state.get_memory(name)
        if variable is None:
            variable = self._var(*tf_checkpoint_slot(self.state_module, "memory", key, name), init, tf.float32)
            state.set_memory(name, variable)
        return variable

    def get_memory(self, name, key, numel, like):
        return self._memory_variable(name, key, lambda: tf.zeros([numel])).read_value()

    def set_memory(self, name, key, value):
        return self.params.of(key).get_memory(name).assign(value)

    def residual_variable(self, key):
        """The residual ``tf.Variable`` of ``key`` (a fused encode updates it in place)."""
        return self.params.of(key).get_memory(RESIDUAL)

    def fused_codec(self, scheme, memory, x):
        from ..kernels import native
        if not native.enabled():  # HVDC_KERNELS=0: no import of the op library at all
            return None
        from ..codecs.tf_fused import codec_for
        return codec_for(scheme, memory, x, self)

    def fused_momentum(self, memory, key, numel, x, ws, out):
        # One op (the torch path's C kernel) updates the velocity variable in
        # place and returns d; as TF ops (u * m + x, the finite check, the
        # assign) the same step cost 5x the codec's own pass (bench micro).
        from ..kernels.tf_native import load
        u = self._memory_variable("momentum", key, lambda: tf.zeros([numel]))
        return load().hvdc_momentum(x=x, u=u.handle, n=int(numel), m=memory.momentum, nesterov=memory.nesterov)

    def seed_for(self, base, step):
        return tf.constant(base % 1_000_000_007, tf.int64) * 1_000_003 + tf.cast(step, tf.int64)

    def allgather(self, tensor, name, process_set):
        import horovod.tensorflow as hvd
        return hvd.allgather(tensor, name=name, process_set=process_set, ignore_name_scope=True)

    def allgather_fixed(self, tensor, name, process_set, rank, size):
        """Between 2 ranks, where ``HVDC_PAIR_SWAP_MIN_BYTES`` is set and the
        payload's static size is that large, it travels as a Sum reduce-scatter of
        a ``[2, n/4]`` int32 tensor whose row of the peer holds this rank's bytes
        and whose own row is zeros, as in torch
        (:meth:`hvd_compress.adapters.torch_adapter.TorchAdapter.allgather_fixed` says why)."""
        n, at_least = tensor.shape.num_elements(), pair_swap_min_bytes()
        if (size != 2 or at_least is None or n is None or tensor.shape.rank == 0 or tensor.dtype == tf.bool
                or n * tensor.dtype.size < at_least):
            return self.allgather(tensor, name, process_set)
        import horovod.tensorflow as hvd
        itemsize, nbytes = tensor.dtype.size, n * tensor.dtype.size
        flat = tf.reshape(tensor, [-1])
        mine = flat if tensor.dtype == tf.uint8 else tf.reshape(tf.bitcast(flat, tf.uint8), [-1])
        words = -(-nbytes // 4)
        mine_words = tf.bitcast(tf.reshape(tf.pad(mine, [[0, 4 * words - nbytes]]), [words, 4]), tf.int32)
        zeros = tf.zeros([words], tf.int32)
        rows = tf.stack([zeros, mine_words] if rank == 0 else [mine_words, zeros])
        received = hvd.reducescatter(rows, op=hvd.Sum, name=name, process_set=process_set, ignore_name_scope=True)
        peer = tf.reshape(tf.bitcast(received, tf.uint8), [-1])[:nbytes]
        both = tf.concat([mine, peer] if rank == 0 else [peer, mine], 0)
        if tensor.dtype != tf.uint8:
            both = tf.bitcast(tf.reshape(both, [2 * n, itemsize]) if itemsize > 1 else both, tensor.dtype)
        return tf.reshape(both, [2 * tensor.shape[0]] + tensor.shape.as_list()[1:])

    def allreduce_sum(self, tensor, name, process_set):
        import horovod.tensorflow as hvd
        return hvd.allreduce(tensor, op=hvd.Sum, name=name, process_set=process_set, ignore_name_scope=True)

    def alltoall(self, tensor, name, process_set):
        import horovod.tensorflow as hvd
        return hvd.alltoall(tensor, name=name, process_set=process_set, ignore_name_scope=True)

    def get_state(self, key, name, init):
        scheme_state = self.params.of(key).scheme
        if name not in scheme_state:
            scheme_state[name] = self._var(*tf_checkpoint_slot(self.state_module, "scheme", key, name), init,
                                           tf.float32)
        return scheme_state[name].read_value()

    def set_state(self, key, name, value):
        return self.params.of(key).scheme[name].assign(value)

    def wait(self, handle):
        return handle

    def nbytes(self, tensor):
        n = tensor.shape.num_elements()
        if n is not None:
            return n * tensor.dtype.size
        return tf.cast(tf.size(tensor), tf.int64) * tensor.dtype.size

    def dynamic_length(self, tensor):
        return tf.size(tensor)

    def record_bytes(self, comp, key, scheme, numel, nbytes):
        # Variables, all three: this runs when the step is traced (under a
        # schedule, once for every branch, one after another), while only the
        # branch that runs may set the bytes, count the call and name its scheme.
        counter = self._var(self.byte_counters, key, 0, tf.int64)
        counter.assign(tf.cast(nbytes, tf.int64))
        calls = self._var(self.call_counters, key, 0, tf.int64)
        calls.assign_add(1)
        names = self.scheme_names.setdefault(key, [])
        if scheme.name not in names:
            names.append(scheme.name)
        which = self._var(self.scheme_index, key, 0, tf.int32)
        which.assign(names.index(scheme.name))
        comp.stats.record(key, lambda: names[int(which.numpy())], 4 * numel, counter, calls=calls)

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
            self.params.of(key).owned_chunk_residual = None

    def forget_in_flight(self):
        self.pending_rounds = []
        self.fingerprint_checked = False

    def step_counts(self):
        return {key: int(v.numpy()) for key, v in self.steps.items()}

    def set_step_counts(self, steps):
        for key, v in self.steps.items():
            v.assign(int(steps.get(key, 0)))
        for key, step in steps.items():
            if key not in self.steps:
                self._var(self.steps, key, int(step), tf.int64)

    # --- checkpoints ----------------------------------------------------------------
    def checkpointable(self):
        return self.state_module

    def state_dict(self):
        out = {f"residual/{k}": v.numpy() for k, v in self.residuals.items()}
        out.update({f"step/{k}": v.numpy() for k, v in self.steps.items()})
        out.update({f"memory/{n}/{k}": v.numpy() for n, store in self.memories.items() for k, v in store.items()})
        out.update({f"scheme/{k}": v.numpy() for k, v in self.scheme_vars.items()})
        return out

    def load_state_dict(self, state):
        for name, value in state.items():
            kind, _, key = name.partition("/")
            if kind == "memory":
                memory_name, _, key = key.partition("/")
                store, key = tf_checkpoint_slot(self.state_module, "memory", key, memory_name)
            elif kind in ("residual", "step", "scheme"):
                store = {"residual": self.residuals, "step": self.steps, "scheme": self.scheme_vars}[kind]
            else:
                raise ValueError(f"unknown entry {name!r} in the TF state of hvd_compress")
            if key in store:
                store[key].assign(value)
            else:  # the ParamState picks it up from its slot at the first use
                self._var(store, key, value, tf.int64 if kind == "step" else tf.float32)


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
