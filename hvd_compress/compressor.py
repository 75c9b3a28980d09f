"""The Horovod Compression object: a scheme plus error feedback and transport.

``Compressor`` implements Horovod's two-method interface::

    tensor_to_allreduce, ctx = compressor.compress(grad)
    grad = compressor.decompress(allreduced, ctx)

and works unchanged with the stock ``hvd.DistributedOptimizer`` (PyTorch),
``hvd.DistributedGradientTape`` and the TF/Keras ``DistributedOptimizer``.

How it rides on a stock optimizer
---------------------------------
* **Allreduce schemes** (casts, Random-K, PowerSGD factors) hand their payload
  to Horovod's own allreduce; Horovod's ``op``, ``gradient_predivide_factor``
  and process set apply as usual.
* **Allgather schemes** (Top-K, quantizers with per-rank scales, sign votes)
  launch named, asynchronous allgathers of their payload inside ``compress``
  and return a 1-element fp32 *placeholder* of value 1.0 to Horovod's
  allreduce.  Whatever scaling Horovod applies (Average, Sum, pre/post-scale
  factors) lands on the placeholder: after the allreduce it holds
  ``size * total_scale``, so ``decompress`` multiplies the summed payloads by
  ``placeholder / size`` and Horovod's meaning of ``op`` is kept exactly.

Keying
------
Error-feedback residuals must follow the *parameter*, not the tensor object
(``zero_grad(set_to_none=True)`` makes a new tensor every step) and not the
hook order (it differs between ranks).  Horovod passes only the tensor, so
the adapters read the parameter's name from the calling Horovod frame
(``_parameter_names[p]`` in torch; the variable's name in TF).  The same name
names every side collective, so they agree on all ranks whatever order the
hooks fire in.  Where no name can be found (a direct call, Horovod's grouped
TF path), a fallback key is built from the shape and its occurrence count in
the step; see :meth:`hvd_compress.adapters.torch_adapter.TorchAdapter._fallback_key`.
"""
from __future__ import annotations

import json
import types
from typing import Any, NamedTuple

from .backend import backend_for
from .feedback.memory import ResidualMemory
from .feedback.momentum_check import check_construction, check_optimizer_momentum
from .cross_rank import stable_hash
from .protocols import Memory as MemoryProtocol
from .schemes.base import Scheme
from .byte_counts import CompressionStats

#: called with each compressor at its first ``compress``.  :mod:`hvd_compress.integration.elastic`
#: adds its ``note_use`` here: a step may come before the elastic state exists (Horovod's own
#: TF2 examples run one to build the variables), and ``register`` adopts what the compressor
#: holds by then.  A hook list, so that this layer needs nothing of the one above it.
FIRST_USE_HOOKS: list = []


def encode_with_residual(B, scheme, x, residual, encode_context):
    """Plain error feedback around ``scheme.encode``, as a pure function of the residual
    passed in; returns (payload, new_residual).  The transports keep their state in the
    compressor's memory instead (``transports.base.encode_with_feedback``); this form is
    the reference the tests and the GPU check drive by hand.

    ``acc = x + residual``; the scheme sends ``sent``; the residual becomes
    ``acc - sent``, so over any number of steps
    ``sum(sent) + residual == sum(x)``: nothing is lost.  ``residual=None``
    means no error feedback.
    """
    if residual is None:
        payload, _ = scheme.encode(B, x, encode_context)
        return payload, None
    payload, state = encode_with_memory(B, scheme, x, {"residual": residual}, encode_context, ResidualMemory())
    return payload, state["residual"]


def encode_with_memory(B, scheme, x, state, encode_context, memory):
    """``memory.compensate`` -> ``scheme.encode`` -> ``memory.update``;
    returns (payload, new_state)."""
    state = dict(state)
    acc = memory.compensate(B, x, state)
    payload, sent = scheme.encode(B, acc, encode_context)
    return payload, memory.update(B, acc, sent, state)


TRANSPORTS = ("allgather", "two_phase", "auto")


class Phase(NamedTuple):
    start: int
    scheme: Scheme
    memory: Any
    transport: str


def supports_two_phase(scheme):
    """Two-phase exchange needs equal-size payload chunks."""
    return scheme.transport == "allgather" and not scheme.variable_parts


def _check_memory_suits_scheme(scheme, memory):
    """DGC's momentum factor masking zeroes the momentum wherever an element
    was sent.  PowerSGD's rank-r approximation sends every element, so the
    momentum would be discarded at every step and ``momentum=`` silently do
    nothing: refuse it.  DGC's clipping alone (``momentum=0``) is fine."""
    from .feedback.memory import DGCMemory
    if isinstance(memory, DGCMemory) and memory.momentum > 0 and scheme.transport == "powersgd":
        raise ValueError(f"memory=DGCMemory(momentum={memory.momentum}) cannot be used with {scheme!r}: DGC's "
                         f"momentum factor masking resets the momentum wherever an element was sent, and a "
                         f"low-rank approximation sends every element, so the momentum would be dropped at "
                         f"every step; use DGCMemory(momentum=0, clip_norm=...) for clipping alone, or keep the "
                         f"momentum in the optimizer")


def _horovod_rank_and_size():
    """(rank, size) of an initialised Horovod already imported here, else None."""
    import sys
    for mod in ("horovod.torch", "horovod.tensorflow"):
        hvd = sys.modules.get(mod)
        try:
            if hvd is not None and hvd.is_initialized():
                return int(hvd.rank()), int(hvd.size())
        except Exception:  # noqa: BLE001 - a half-initialised Horovod: no tag
            continue
    return None


def _inside_tf_trace():
    """True while TensorFlow (if it is loaded at all) traces a tf.function."""
    import sys
    tf = sys.modules.get("tensorflow")
    try:
        return bool(tf is not None and tf.inside_function())
    except AttributeError:  # a half-imported TensorFlow
        return False


class ElasticNotRegistered(RuntimeError):
    """An elastic Horovod job uses a compressor that was not registered with
    its elastic state (:func:`hvd_compress.integration.elastic.register`)."""


class Compressor:
    """A Horovod compression object: ``scheme`` + error feedback + transport.

    Args:
        scheme: a :class:`~hvd_compress.schemes.base.Scheme` instance.
        error_feedback: keep the residual ``(grad + residual) - sent`` per
            parameter and add it to the next gradient.  ``None`` uses the
            scheme's default (on for biased schemes such as Top-K, Int8 and
            EF-sign; off for casts and unbiased stochastic quantizers).
        seed: base seed of the private, per-call random generators of
            stochastic schemes; must be equal on all ranks for Random-K.

    The object is hashable by identity, as TF's cached allreduce function
    requires.  One object serves both frameworks.
    """

    def __init__(self, scheme: Scheme, error_feedback=None, seed=0, memory=None, transport="allgather"):
        if not isinstance(scheme, Scheme):
            raise ValueError(f"scheme must be an hvd_compress scheme instance; got {scheme!r}")
        if error_feedback not in (None, True, False):
            raise ValueError(f"error_feedback must be True, False or None (scheme default); got {error_feedback!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}; got {transport!r}")
        if transport != "allgather" and not supports_two_phase(scheme):
            raise ValueError(f"transport={transport!r} needs a fixed-size allgather scheme (Int8, QSGD, TernGrad, "
                             f"BF16, the sign family or TopK); {scheme!r} travels by {scheme.transport}")
        self.transport = transport
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {seed!r}")
        self.scheme = scheme
        if memory is not None and not isinstance(memory, MemoryProtocol):
            raise ValueError(f"memory must be an hvd_compress memory such as MomentumMemory(0.9) or DGCMemory(); "
                             f"got {memory!r}")
        # a memory that keeps no residual (MomentumMemory(error_feedback=False)) runs without error feedback
        memory_ef = getattr(memory, "error_feedback", True) if memory is not None else None
        if error_feedback is None:
            error_feedback = scheme.error_feedback_default if memory is None else memory_ef
        self.error_feedback = error_feedback
        if memory is not None and memory_ef != self.error_feedback:
            raise ValueError(f"memory= {memory!r} {'needs' if memory_ef else 'keeps no residual, so it needs'} "
                             f"error_feedback={memory_ef}; got error_feedback={self.error_feedback}")
        #: what is kept between steps: the residual, and the velocity of momentum-aware
        #: error feedback (None: nothing)
        self.memory = memory if memory is not None else (ResidualMemory() if self.error_feedback else None)
        _check_memory_suits_scheme(scheme, self.memory)
        self.seed = seed
        self.stats = CompressionStats()
        self._adapters = {}
        # combinations measured to train badly are warned about once: QSGD with error
        # feedback here, optimizer momentum at the first compress (momentum_check)
        self._recipe_checked = False
        if type(self) is Compressor:  # a Policy's or Schedule's parts warned when they were built
            check_construction(self)
        # Built while a tf.function was being traced (Horovod's own TF2 examples
        # build the compression inside the step): each retrace builds a new
        # object, which must continue the state of the one before.
        self._built_in_tf_trace = _inside_tf_trace()
        #: the elastic Horovod handler (hvd_compress.elastic.register), or None
        self._elastic = None

    # --- Horovod's interface -----------------------------------------------
    def compress(self, tensor):
        B = backend_for(tensor)
        if not B.is_floating(tensor):
            return tensor, None  # integers and bools always pass through
        if B.name == "tensorflow" and self._built_in_tf_trace:
            from .adapters.tf_traces import owner_across_traces
            owner = owner_across_traces(self, tensor)
            if owner is not self:  # a retrace's compressor: the first one's state, its stats
                self._adapters, self.stats = owner._adapters, owner.stats
                return owner.compress(tensor)
        if not self._recipe_checked:
            self._recipe_checked = True
            check_optimizer_momentum(self, B.name, tensor)
            for hook in FIRST_USE_HOOKS:  # hvd_compress.elastic remembers it for register()
                hook(self)
        return self.adapter_for(B.name).compress(self, tensor)

    def decompress(self, tensor, ctx):
        if ctx is None:  # passthrough, and Horovod's sparse path
            return tensor
        return self.adapter_for(ctx.roles.B.name).decompress(self, tensor, ctx)

    # --- per-tensor plan (overridden by Policy and Schedule) ---------------------
    def plan_for(self, key, numel, shape):
        """``[Phase(start_step, scheme, memory or None, transport), ...]`` for one tensor:
        a single phase here; schedules have several."""
        return [Phase(0, self.scheme, self.memory, self.transport)]

    def config(self):
        return {"scheme": self.scheme.name, "args": self.scheme.config(),
                "error_feedback": self.error_feedback, "seed": self.seed,
                "memory": None if self.memory is None else self.memory.config(), "transport": self.transport}

    def fingerprint(self):
        """Hash of the configuration; ranks must agree on it."""
        return stable_hash(json.dumps(self.config(), sort_keys=True, default=str))

    def __repr__(self):
        momentum = getattr(self.memory, "momentum", 0.0)
        extra = f", momentum={momentum}" if momentum else ""
        if getattr(self.memory, "nesterov", False):
            extra += ", nesterov=True"
        return f"Compressor({self.scheme!r}, error_feedback={self.error_feedback}{extra})"

    # --- state ---------------------------------------------------------------------
    def state_dict(self):
        """Residuals, step counters and scheme state as plain tensors and
        numbers (no pickled objects): save with ``torch.save`` or
        ``safetensors``; TF users checkpoint :meth:`tf_checkpointable`."""
        out = {"config": json.dumps(self.config(), sort_keys=True, default=str)}
        where = _horovod_rank_and_size()
        if where is not None:
            # residuals are per rank: record whose they are (a JSON string, like
            # "config", so the state stays strings and tensors only)
            out["owner"] = json.dumps({"rank": where[0], "world_size": where[1]})
        for name, adapter in self._adapters.items():
            out[name] = adapter.roles.store.state_dict()
        return out

    def load_state_dict(self, state, allow_other_rank=False):
        """Restore :meth:`state_dict`'s output.  Error-feedback residuals belong
        to one rank, so a state saved by another rank (or at another world size)
        is refused: save one checkpoint per rank, not rank 0's for everybody.
        ``allow_other_rank=True`` loads it anyway."""
        cfg = json.dumps(self.config(), sort_keys=True, default=str)
        if state.get("config") != cfg:
            raise ValueError(f"state_dict was saved by a different configuration: {state.get('config')} != {cfg}")
        where = _horovod_rank_and_size()
        owner = json.loads(state["owner"]) if state.get("owner") else {}
        saved = (owner.get("rank"), owner.get("world_size"))
        if not allow_other_rank and where is not None and saved[0] is not None and tuple(saved) != tuple(where):
            raise ValueError(f"state_dict was saved by rank {saved[0]} of {saved[1]}, and this is rank {where[0]} "
                             f"of {where[1]}: error-feedback residuals are per rank, so save and restore one "
                             f"state_dict per rank (or pass allow_other_rank=True)")
        for name, sub in state.items():
            if name not in ("config", "owner"):
                adapter = self.adapter_for(name)
                if adapter.roles.store.load_state_dict(sub):  # the state replaced: what was in flight is stale
                    adapter.forget_in_flight()

    def reset_state(self):
        """Forget residuals and counters (e.g. after an elastic membership change)."""
        for adapter in self._adapters.values():
            adapter.reset()

    def tf_checkpointable(self):
        """A ``tf.Module`` tracking the TF state variables, for ``tf.train.Checkpoint``."""
        return self.adapter_for("tensorflow").state_module

    # --- framework adapters ----------------------------------------------------------
    #: the frameworks a compressor keeps state for, by the names its adapters go under
    FRAMEWORKS = ("torch", "tensorflow")

    @property
    def adapters(self):
        """The framework adapters built so far, by framework name (``"torch"``,
        ``"tensorflow"``), as a read-only mapping.  Each adapter holds that
        framework's per-parameter state: ``residuals``, ``memories``, ``steps``."""
        return types.MappingProxyType(self._adapters)

    def adapter_for(self, framework):
        """The adapter of ``framework`` (``"torch"`` or ``"tensorflow"``), built
        on first use."""
        if framework not in self._adapters:
            self.use_adapter(framework, self._new_adapter(framework))
        return self._adapters[framework]

    def use_adapter(self, framework, adapter):
        """Keep this compressor's ``framework`` state in ``adapter`` from now on
        (an adapter shared with another compressor, or one with other
        collectives, such as a one-rank world); returns ``adapter``."""
        from .adapters.base import AdapterBase
        if framework not in self.FRAMEWORKS:
            raise ValueError(f"framework must be one of {self.FRAMEWORKS}; got {framework!r}")
        if not isinstance(adapter, AdapterBase):
            raise ValueError(f"adapter must be an hvd_compress framework adapter (a subclass of "
                             f"hvd_compress.adapters.base.AdapterBase); got {adapter!r}")
        self._adapters[framework] = adapter
        return adapter

    def _new_adapter(self, framework):
        """A fresh adapter for ``framework``; subclasses with their own adapters override it."""
        if framework == "torch":
            from .adapters.torch_adapter import TorchAdapter
            return TorchAdapter()
        if framework == "tensorflow":
            from .adapters.tf_adapter import TFAdapter
            return TFAdapter()
        raise ValueError(f"framework must be one of {self.FRAMEWORKS}; got {framework!r}")

    # Horovod's TF path caches on the compression object: identity hashing.
    __hash__ = object.__hash__
