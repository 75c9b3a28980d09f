"""Elastic Horovod: a compressor's per-rank state follows commits, rollbacks
and membership changes.

In a Horovod elastic script, one line after building the state::

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)
    hvd_compress.elastic.register(state, compression)

(``hvd.elastic.TensorFlowKerasState`` likewise; ``register(state)`` adopts
every compressor used so far, such as one built inside a traced step).  A
compressor may run steps before it is registered (Horovod's TF2 examples run
one before the state exists): ``register`` adopts its residuals and counters.
A ``state.commit()`` or a reset while a compressor in use is not registered
raises :class:`~hvd_compress.compressor.ElasticNotRegistered`, naming the call
to add.  From then on:

* ``state.commit()`` snapshots the compressor's state on this rank
  (error-feedback residuals, momentum velocities, step counters, PowerSGD's Q,
  Auto's plan: what :meth:`hvd_compress.Compressor.state_dict` holds) in host memory,
  without broadcasting it: residuals belong to one rank, and rank 0's copied
  to everybody would multiply its gradient mass.  Each rank also shares a few
  numbers (its process id, how many residual tensors it holds and their
  squared norm) by one allgather named ``hvdc.elastic.mass``;
* ``state.restore()`` (after a ``HorovodInternalError``) rolls the compressor
  back to the last commit, as Horovod rolls the model back;
* after a reset (``HostsUpdatedInterrupt``, or a failure), before anything
  else runs: each rank folds its two-phase stage-2 residual (the chunk it
  owned) back into its own stage-1 residual at that chunk's place, so the
  sum of residuals over the survivors is unchanged and the chunks can be cut
  again for the new number of ranks; in-flight bookkeeping is dropped; the
  configuration fingerprint is agreed again at the next exchange (a joining
  worker built differently gets ``ConfigMismatchError`` on every rank);
  ``Auto()`` measures and plans again for the new world (PyTorch only:
  :func:`register` refuses ``Auto()`` with a TensorFlow state, naming the
  fixed schemes that are allowed there).  Surviving
  ranks keep their residuals: they are keyed by parameter name, not by rank.
  TensorFlow: hvd_compress's traced graph holds the rank and the number of
  ranks, so every ``tf.function`` whose trace holds hvd_compress's ops
  (Horovod's cached allreduce function, a Keras model's ``train_function``,
  a module-level step of your own) drops its traces and traces again at its
  next call (:func:`hvd_compress.integration.elastic_internals.retrace_after_reset`),
  before any reset callback of yours runs.
* ``state.sync()`` broadcasts only what must be equal on every rank: the
  per-tensor step counters (schedules and seeded draws read them), so that a
  joining worker continues the survivors' count.  Joining workers start with
  zero residuals.

TensorFlow: Horovod 0.28.1's ``hvd.elastic.run`` treats a failed collective
as a fault (restore, reset) only if its message names one of Horovod's default
collective names, and otherwise swallows it, returning as if training had
finished; hvd_compress's collectives are named.  :func:`register` with a
TensorFlow state therefore makes ``hvd.elastic.run`` :func:`run`, which
recognises every Horovod collective failure, for the training functions
decorated after it.

A reset after a failed worker is bounded: if Horovod's shutdown and init do
not finish within ``HVDC_ELASTIC_RESET_TIMEOUT_S`` (default: twice
``HOROVOD_GLOO_TIMEOUT_SECONDS`` plus 60 s), the worker ends with a clear error
instead of waiting forever (:mod:`hvd_compress.integration.elastic_watchdog`).

What a departing rank held in its residuals at its last commit is lost with
it.  At the first commit after the change, the survivors find which process
ids are gone, add the tensors and norm those ranks reported at the last commit
to ``compression.stats.lost()`` and log one line (rank 0).  Nothing else is
lost: the folded residuals of the survivors carry the rest.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import uuid
import weakref

from ..compressor import FIRST_USE_HOOKS, Compressor, ElasticNotRegistered
from .elastic_watchdog import ResetWatchdog
from .elastic_watchdog import bound_s as reset_bound_s

log = logging.getLogger("hvd_compress.elastic")

#: this worker process, across resets (Horovod renumbers ranks at a reset)
PROCESS_ID = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

#: names of the collectives issued here (deterministic, the same on every rank)
MASS_COLLECTIVE = "hvdc.elastic.mass"
STEPS_COLLECTIVE = "hvdc.elastic.steps"


def run(func):
    """``hvd.elastic.run`` for TensorFlow that rolls back after a failed
    collective whatever its name (Horovod 0.28.1's own swallows the failure of
    a named collective, such as every one hvd_compress issues, and returns as
    if training had finished): see
    :func:`hvd_compress.integration.elastic_internals.tf_elastic_run`.  :func:`register` with
    a TensorFlow state makes ``hvd.elastic.run`` this one for the functions
    decorated after it; use ``@hvd_compress.elastic.run`` for one decorated
    before."""
    from .elastic_internals import tf_elastic_run
    return tf_elastic_run(func)


def register(state, compression=None):
    """Make ``compression`` follow ``state``'s commit / restore / sync and
    Horovod's resets; returns the :class:`ElasticCompression` handler (a list
    of them when ``compression`` is None).

    ``state``: a Horovod elastic state (``hvd.elastic.TorchState``,
    ``hvd.elastic.TensorFlowKerasState``, ...); ``compression``: the
    hvd_compress compressor given to the optimizer, or None for every
    hvd_compress compressor this process has used so far (for a compressor
    built inside a traced step, as in Horovod's own TF2 examples).  Register
    each compressor once.  A compressor used before ``register`` is adopted:
    its residuals and step counters so far are this state's, as of now."""
    if compression is not None:
        return ElasticCompression(state, compression)
    used = [c for c in list(_USED) if getattr(c, "_elastic", None) is None]
    if not used:
        raise ValueError("hvd_compress.elastic.register(state): no hvd_compress compressor has compressed a "
                         "tensor in this process yet; pass the one given to the optimizer: "
                         "hvd_compress.elastic.register(state, compression)")
    return [ElasticCompression(state, c) for c in sorted(used, key=lambda c: c._first_use)]


#: compressors that have compressed a tensor in this process, in the order of their first use
_USED = weakref.WeakSet()
_USE_ORDER = itertools.count()


def note_use(compression):
    """Called at a compressor's first ``compress``: remember it for
    ``register(state)``, and in an elastic job (``HOROVOD_ELASTIC=1``) make
    Horovod's states refuse a commit, restore or reset while it is not
    registered (:func:`_refuse_unregistered`)."""
    compression._first_use = next(_USE_ORDER)
    _USED.add(compression)
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        _guard_horovod_states()


FIRST_USE_HOOKS.append(note_use)


def unregistered_in_use():
    """The compressors used in this process and registered with no elastic state."""
    return [c for c in list(_USED) if getattr(c, "_elastic", None) is None]


def _refuse_unregistered(what):
    """Raise :class:`~hvd_compress.compressor.ElasticNotRegistered` if a
    compressor in use is not registered: ``what`` (a commit, a restore, a
    membership change) would leave its residuals and step counters behind."""
    unregistered = unregistered_in_use() if os.environ.get("HOROVOD_ELASTIC") == "1" else []
    if unregistered:
        raise ElasticNotRegistered(
            f"elastic Horovod (HOROVOD_ELASTIC=1): {what} with {unregistered[0]!r} not registered with the elastic "
            f"state; its error-feedback residuals and step counters would not follow it. Call "
            f"hvd_compress.elastic.register(state, compression) after building hvd.elastic.TorchState / "
            f"TensorFlowKerasState / KerasState (register(state) adopts every compressor used so far)")


_GUARDED = []


def _guard_horovod_states():
    """Wrap ``horovod.common.elastic.State.commit`` and ``on_reset`` (every
    elastic state's, once per process) so that they refuse to run while a
    compressor in use is not registered.  ``on_reset`` follows every
    restore and every membership change in Horovod's ``run``."""
    if _GUARDED:
        return
    from horovod.common.elastic import State
    commit, on_reset = State.commit, State.on_reset

    def guarded_commit(self):
        _refuse_unregistered("state.commit()")
        return commit(self)

    def guarded_on_reset(self):
        _refuse_unregistered("a reset (state.restore() or a membership change)")
        return on_reset(self)

    State.commit, State.on_reset = guarded_commit, guarded_on_reset
    _GUARDED.append((commit, on_reset))


def _framework_of(state):
    module = type(state).__module__
    for cls in type(state).__mro__:
        if cls.__module__.startswith("horovod.torch"):
            return "torch"
        if cls.__module__.startswith(("horovod.tensorflow", "horovod.keras", "horovod._keras")):
            return "tensorflow"
    raise ValueError(f"state must be a Horovod elastic state of PyTorch or TensorFlow (hvd.elastic.TorchState, "
                     f"hvd.elastic.TensorFlowKerasState); got {type(state).__name__} from {module}")


class _HorovodOps:
    """The three collectives the handler issues, in one framework's Horovod
    module (``horovod.torch`` or ``horovod.tensorflow``), imported when first
    used so that neither framework is a dependency of the other."""

    def __init__(self, module):
        self.module = module

    def _hvd(self):
        import importlib
        return importlib.import_module(self.module)

    def rank_and_size(self):
        hvd = self._hvd()
        return int(hvd.rank()), int(hvd.size())

    def allgather_object(self, obj, name):
        return self._hvd().allgather_object(obj, name=name)

    def broadcast_object(self, obj, name):
        return self._hvd().broadcast_object(obj, root_rank=0, name=name)


#: bounds the survivors' reset after a failed worker (see elastic_watchdog)
_RESET_WATCHDOG = ResetWatchdog()


def watch_reset_after_failure():
    """Arm the reset bound when the state is restored after a failed collective
    (Horovod's ``run`` restores while it handles the ``HorovodInternalError``);
    a restore called otherwise starts no clock."""
    from horovod.common.exceptions import HorovodInternalError
    if isinstance(sys.exc_info()[1], HorovodInternalError):
        _RESET_WATCHDOG.arm()


def departed_mass(before, after_ids):
    """What the processes in ``before`` ({process id: (tensors, squared
    norm)}, at the last commit) that are not in ``after_ids`` held:
    ``(ranks, tensors, squared norm)``."""
    gone = [pid for pid in before if pid not in set(after_ids)]
    return len(gone), sum(int(before[p][0]) for p in gone), sum(float(before[p][1]) for p in gone)


def _check_registration(state, compression):
    """The framework of ``state``, once ``state`` and ``compression`` are shown
    to be a pair :func:`register` accepts; a clear error otherwise."""
    from horovod.common.elastic import State
    if not isinstance(state, State):
        raise ValueError(f"state must be a Horovod elastic state (hvd.elastic.TorchState, "
                         f"hvd.elastic.TensorFlowKerasState); got {state!r}")
    if not isinstance(compression, Compressor):
        raise ValueError(f"compression must be an hvd_compress compressor (e.g. hvd_compress.TopK(0.01)); "
                         f"got {compression!r}")
    if getattr(compression, "_elastic", None) is not None:
        raise ValueError(f"{compression!r} is already registered with an elastic state; register each "
                         f"compressor once")
    framework = _framework_of(state)
    reset_bound_s()  # a malformed HVDC_ELASTIC_RESET_TIMEOUT_S / HOROVOD_GLOO_TIMEOUT_SECONDS: an error now
    if framework == "tensorflow" and getattr(compression, "replan_after_reset", None) is not None:
        raise ValueError(f"compression={compression!r}: hvd_compress.Auto under elastic Horovod is supported in "
                         f"PyTorch only (hvd.elastic.TorchState). In TensorFlow its plan and calibration live "
                         f"in the traced step and are not re-planned for a new number of workers; allowed "
                         f"with hvd.elastic.TensorFlowKerasState: a fixed scheme (e.g. hvd_compress.TopK(0.01), "
                         f"Int8(), PowerSGD(4)) or a Policy of fixed schemes")
    return framework


class ElasticCompression:
    """The handler :func:`register` installs; see the module docstring."""

    def __init__(self, state, compression):
        self.framework = _check_registration(state, compression)
        if self.framework == "tensorflow":
            from .elastic_internals import use_tf_elastic_run_in_horovod
            use_tf_elastic_run_in_horovod()
        self.ops = _HorovodOps("horovod.torch" if self.framework == "torch" else "horovod.tensorflow")
        self.compression = compression
        self.state = state
        #: the compressor's state_dict() at the last commit, or at register: what a compressor used
        #: before register holds belongs to the state from now (None: never used, i.e. empty)
        self._saved = compression.state_dict() if compression.adapters else None
        #: (rank, size) at which the current two-phase chunks were cut, and at the last commit
        self._world = self.ops.rank_and_size()
        self._saved_world = self._world
        #: {process id: (residual tensors, squared norm)} of every rank at the last commit
        self.members = {}
        compression._elastic = self
        save, restore, sync = state.save, state.restore, state.sync

        def save_with_compression():
            self.share_mass()  # the collective first: if it fails, nothing is half-saved
            save()
            self.save()

        def restore_with_compression():
            watch_reset_after_failure()
            restore()
            self.restore()

        def sync_with_compression():
            self.sync()
            sync()

        # instance attributes: State.commit() calls self.save()
        object.__setattr__(state, "save", save_with_compression)
        object.__setattr__(state, "restore", restore_with_compression)
        object.__setattr__(state, "sync", sync_with_compression)
        # first: the user's own reset callbacks may run a step (Horovod's Keras example fits one batch),
        # which must see the residuals folded and the traced functions dropped
        callbacks = getattr(state, "_reset_callbacks", None)
        if isinstance(callbacks, list):
            callbacks.insert(0, self.on_reset)
        else:
            state.register_reset_callbacks([self.on_reset])

    # --- the adapters that hold state ----------------------------------------------------
    def _adapters(self):
        return list(self.compression.adapters.values())

    # --- commit -------------------------------------------------------------------
    def share_mass(self):
        """Allgather (process id, residual tensors, squared norm) of every rank;
        count what ranks present at the previous commit and gone now held."""
        rank, size = self._world
        tensors, sumsq = 0, 0.0
        for adapter in self._adapters():
            n, s = adapter.residual_mass(rank, size)
            tensors, sumsq = tensors + n, sumsq + s
        gathered = self.ops.allgather_object((PROCESS_ID, tensors, sumsq), MASS_COLLECTIVE)
        now = {pid: (n, s) for pid, n, s in gathered}
        if self.members:
            ranks, lost_tensors, lost_sumsq = departed_mass(self.members, list(now))
            if ranks:
                self.compression.stats.record_lost(ranks, lost_tensors, lost_sumsq)
                if self.ops.rank_and_size()[0] == 0:
                    log.warning("hvd_compress.elastic: %d rank(s) left holding %d error-feedback residual "
                                "tensor(s) of norm %.6g at their last commit; that gradient mass is lost "
                                "(compression.stats.lost())", ranks, lost_tensors, math.sqrt(lost_sumsq))
        self.members = now

    def save(self):
        self._saved = self.compression.state_dict()
        self._saved_world = self._world

    # --- rollback ----------------------------------------------------------------------
    def restore(self):
        if self._saved is None:
            self.compression.reset_state()
        else:
            self.compression.load_state_dict(self._saved, allow_other_rank=True)
        # the restored two-phase residuals were cut for the world of that commit
        self._world = self._saved_world

    # --- membership change -------------------------------------------------------------------
    def on_reset(self):
        """After Horovod's shutdown and init, before the next sync (local only:
        joining workers do not run this)."""
        _RESET_WATCHDOG.disarm()
        rank, size = self._world
        for adapter in self._adapters():
            adapter.fold_owned_chunks(rank, size)
            adapter.forget_in_flight()
        replan = getattr(self.compression, "replan_after_reset", None)
        if replan is not None:
            replan()
        if self.framework == "tensorflow":
            from .elastic_internals import retrace_after_reset
            retrace_after_reset(self.compression, self.state)
        self._world = self.ops.rank_and_size()

    def sync(self):
        """Rank 0's step counters to every rank (run by survivors and joiners alike)."""
        mine = {}
        for name, adapter in sorted(self.compression.adapters.items()):
            mine[name] = adapter.step_counts()
        agreed = self.ops.broadcast_object(mine, STEPS_COLLECTIVE)
        for name in sorted(set(agreed) | set(mine)):
            self.compression.adapter_for(name).set_step_counts(agreed.get(name, {}))
        self._world = self.ops.rank_and_size()
