"""Everything hvd_compress knows about Horovod's private internals, in one place.

Horovod's Compression interface passes ``compress`` the gradient tensor and
nothing else, yet error feedback needs to know *which parameter* a gradient
belongs to (residuals follow the parameter across steps) and every side
collective needs a name that is the same on all ranks.  Horovod keeps that
knowledge in local variables and private attributes of its own frames, so
this module reads them, and nothing else in the package does.  Each reader
states the Horovod 0.28.1 code it relies on; :func:`check_version` warns
when a different Horovod is imported, since these are not public APIs.

What is read:

* **PyTorch** -- ``DistributedOptimizer._allreduce_grad_async(self, p)`` and
  ``_grouped_allreduce_grad_async(self, ps)`` call ``compress``; ``self`` has
  ``_parameter_names`` (param -> unique name; Horovod itself refuses
  duplicate names and unnamed parameters) and ``process_set``.  ``p`` is a
  local of the caller (a comprehension variable in the grouped path, which
  Python 3.12 inlines into the function frame: either frame is accepted).
* **TensorFlow** -- ``allreduce_grads(grads, vars, ...)`` (built by
  ``_make_cached_allreduce_grads_fn``) serves ``DistributedGradientTape``, the
  legacy and the Keras ``DistributedOptimizer`` (with or without
  ``backward_passes_per_step``, whose helpers pass the filtered ``vars``).
  ``allreduce(tensor, ..., process_set=...)`` passes the very tensor object
  that is in ``grads`` to ``compress``, so the variable is found by identity
  (``grads[j] is tensor``), not by a comprehension's loop index.  Autograph
  renames the functions (``tf__allreduce_grads``), so frames are matched by
  module and locals, never by function name.
* **Keras** -- ``horovod.tensorflow.keras`` and its ``callbacks`` module bind
  ``K`` by ``from keras import backend as K`` and hand it to every callback
  they build; :func:`use_tf_keras_in_horovod_callbacks` rebinds it to
  tf_keras' backend.

What elastic TensorFlow needs of Horovod's internals is in
:mod:`hvd_compress.integration.elastic_internals`.
"""
from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

#: the Horovod release line whose internals this module was written against
TESTED_HOROVOD = "0.28."
_MAX_DEPTH = 80
#: the package whose frames the readers skip (:func:`_frames`)
_OWN_PACKAGE = __name__.split(".")[0]
_version_checked = False
_warned_fallbacks: set = set()


def check_version():
    """Warn once if the imported Horovod is not the release line these readers
    were written against (the readers may then silently find no names)."""
    global _version_checked
    if _version_checked:
        return
    _version_checked = True
    version = getattr(sys.modules.get("horovod"), "__version__", None)
    if version is not None and not str(version).startswith(TESTED_HOROVOD):
        warnings.warn(f"hvd_compress reads Horovod internals written against Horovod {TESTED_HOROVOD}x; found "
                      f"Horovod {version}. If parameter names are not found, residuals fall back to shape-based "
                      f"keys (a warning names each one)", RuntimeWarning, stacklevel=2)


def unique_keys(names: Sequence[str]) -> List[str]:
    """State keys for a list of variable names, unique even when names repeat.

    ``tf.Variable``s made without a name are all called ``Variable:0``; two
    such variables must never share a residual or a collective name.  A name
    that occurs once is its own key (so checkpoints keep readable keys); every
    occurrence of a repeated name becomes ``name#k``, k counting occurrences
    in list order.  The list is the optimizer's variable list, in the same
    order on every rank, so the keys agree across ranks.  ``#`` cannot occur
    in a TensorFlow name, so a suffixed key never equals another variable's name.
    """
    seen, counts = {}, {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    out = []
    for n in names:
        if counts[n] == 1:
            out.append(n)
        else:
            k = seen.get(n, 0)
            seen[n] = k + 1
            out.append(f"{n}#{k}")
    return out


def warn_fallback_key(key, framework):
    """Warn once per key when a gradient's parameter could not be identified."""
    if key in _warned_fallbacks:
        return
    _warned_fallbacks.add(key)
    warnings.warn(f"hvd_compress could not find the {framework} parameter this gradient belongs to in Horovod's "
                  f"call frames; its error-feedback state and collective names use the fallback key {key!r}, "
                  f"which is only the same on every rank if tensors of this shape are reduced in the same order",
                  RuntimeWarning, stacklevel=4)


def _frames():
    """The callers' frames, innermost first, without this package's own: they
    hold neither Horovod's optimizer nor its locals, and reading a frame's
    ``f_locals`` builds a dict of them (Python 3.11) for nothing."""
    f = sys._getframe(2)
    for _ in range(_MAX_DEPTH):
        if f is None:
            return
        if not _is_own_module(f.f_globals.get("__name__")):
            yield f
        f = f.f_back


def _is_own_module(name) -> bool:
    return isinstance(name, str) and (name == _OWN_PACKAGE or name.startswith(_OWN_PACKAGE + "."))


# --- PyTorch -------------------------------------------------------------------------
def is_adasum(opt) -> bool:
    """Horovod builds the Adasum optimizer as ``type(<wrapped class name>,
    (wrapped class,), dict(_DistributedAdasumOptimizer.__dict__))``, so neither
    the class name nor the MRO shows it; its methods are the same objects."""
    return _is_adasum_class(type(opt))


@functools.lru_cache(maxsize=256)  # asked at every tensor's call; the answer is the class's
def _is_adasum_class(cls) -> bool:
    try:
        from horovod.torch.optimizer import _DistributedAdasumOptimizer
    except ImportError:  # pragma: no cover - other Horovod layouts
        return False
    return cls.__dict__.get("_allreduce_grad_async") is \
        _DistributedAdasumOptimizer.__dict__.get("_allreduce_grad_async")


def _is_torch_distributed_optimizer(owner) -> bool:
    return hasattr(owner, "_parameter_names") and (hasattr(owner, "process_set") or is_adasum(owner))


@dataclass
class TorchCaller:
    optimizer: Any  # Horovod's DistributedOptimizer, or None for a direct hvd.allreduce call
    param: Any  # the parameter whose gradient is being compressed, when found

    @property
    def process_set(self):
        return self.optimizer.process_set

    @property
    def key(self) -> Optional[str]:
        return self.optimizer._parameter_names.get(self.param) if self.param is not None else None

    def params(self) -> List[Tuple[str, tuple]]:
        return [(name, tuple(p.shape)) for p, name in self.optimizer._parameter_names.items()]

    def optimizer_momentum(self) -> float:
        """The wrapped torch optimizer's momentum (SGD ``momentum``, Adam's
        ``betas[0]``), the largest over parameter groups; 0.0 when it has none."""
        out = 0.0
        for group in getattr(self.optimizer, "param_groups", []):
            m = group.get("momentum", 0.0) or 0.0
            betas = group.get("betas")
            if betas:
                m = max(m, betas[0])
            out = max(out, float(m))
        return out


def find_torch_caller() -> TorchCaller:
    """The Horovod torch optimizer that called ``compress``, and the parameter."""
    import torch
    param = None
    for f in _frames():
        loc = f.f_locals
        if param is None and isinstance(loc.get("p"), torch.Tensor):
            param = loc["p"]
        owner = loc.get("self")
        if owner is not None and _is_torch_distributed_optimizer(owner):
            return TorchCaller(owner, param)
    return TorchCaller(None, None)


# --- TensorFlow ------------------------------------------------------------------------
@dataclass
class TFCaller:
    process_set: Any  # None when not found (the global process set is meant)
    variables: Optional[list]  # the variables Horovod is reducing, in its order
    index: Optional[int]  # position of this gradient's variable in ``variables``
    keys: Optional[List[str]] = None  # unique_keys of the variables' names, in the same order

    @property
    def key(self) -> Optional[str]:
        return None if self.index is None else self.keys[self.index]

    def params(self):
        if self.variables is None:
            return None
        return [(k, tuple(v.shape.as_list())) for k, v in zip(self.keys, self.variables)]


def _index_of(tensor, grads) -> Optional[int]:
    for j, g in enumerate(grads or ()):
        if g is tensor:
            return j
    return None


def find_tf_caller(tensor) -> TFCaller:
    """Process set, variable list and this gradient's index, from Horovod's TF frames."""
    process_set = None
    for f in _frames():
        if f.f_globals.get("__name__") != "horovod.tensorflow":
            continue
        loc = f.f_locals
        if process_set is None and "process_set" in loc:
            process_set = loc["process_set"]
        variables = loc.get("vars")
        if variables is not None and "grads" in loc:
            variables = list(variables)
            # By identity only: a loop index ``i`` is no evidence -- Python 3.11 keeps the
            # comprehension's ``i`` in a frame of its own, 3.12+ in this one (PEP 709),
            # and in the ``groups`` path ``i`` counts groups, not variables.
            index = _index_of(tensor, loc["grads"])
            return TFCaller(process_set, variables, index, unique_keys([v.name for v in variables]))
    return TFCaller(process_set, None, None)


def keras_optimizer_momentum(optimizer) -> float:
    """Momentum of the optimizer that Horovod's Keras/legacy wrapper wraps
    (``momentum`` of SGD, ``beta_1`` of Adam); 0.0 when none is visible."""
    out = 0.0
    for attr in ("momentum", "beta_1", "_momentum"):
        value = getattr(optimizer, attr, None)
        if value is None:
            continue
        try:
            value = float(value() if callable(value) else value)
        except (TypeError, ValueError):
            try:
                value = float(value.numpy())
            except Exception:  # noqa: BLE001 - a symbolic hyperparameter: not visible
                continue
        out = max(out, value)
    return out


def find_keras_optimizer():
    """Horovod's Keras (or legacy TF) ``DistributedOptimizer`` on the call chain,
    or None (``DistributedGradientTape`` and direct calls have none).  It sits
    above ``allreduce_grads`` -- Keras' ``minimize`` -> ``_compute_gradients``
    -> ``_allreduce`` in ``horovod._keras`` (about 50 frames up in a traced
    ``model.fit``) -- where :func:`find_tf_caller` has already stopped."""
    for f in _frames():
        if f.f_globals.get("__name__", "").startswith("horovod."):
            owner = f.f_locals.get("self")
            if owner is not None and hasattr(owner, "_allreduce_grads"):
                return owner
    return None


#: the functions Horovod 0.28.1's Keras callbacks call on the backend they were given
_KERAS2_BACKEND_FUNCTIONS = ("get_value", "set_value", "constant", "variable")


class TFKerasBackendForHorovod:
    """``tf_keras.backend`` as Horovod's Keras callbacks are given it by
    :func:`use_tf_keras_in_horovod_callbacks`: every name is tf_keras', except
    that :meth:`set_value` explains instead of failing obscurely on a Python
    number.  tf_keras' optimizers keep ``momentum`` as a Python float (fixed
    when the step is traced), which Horovod's momentum correction cannot
    change."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def set_value(self, x, value):
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            if float(value) == float(x):
                return  # nothing to change (momentum 0 under Horovod's momentum correction)
            raise TypeError(f"Horovod's Keras callback tried to change a hyperparameter that the optimizer keeps "
                            f"as a Python number ({x!r} -> {float(value)!r}), which a traced step never reads "
                            f"again: tf_keras' optimizers keep momentum that way.  Pass "
                            f"momentum_correction=False to LearningRateWarmupCallback / "
                            f"LearningRateScheduleCallback, or use a tf.keras.optimizers.legacy optimizer, whose "
                            f"momentum is a variable")
        return self._backend.set_value(x, value)

    def __repr__(self):
        return f"TFKerasBackendForHorovod({self._backend.__name__})"


def use_tf_keras_in_horovod_callbacks():
    """Make Horovod's Keras callbacks work with the tf_keras that ``tf.keras``
    is under ``TF_USE_LEGACY_KERAS=1``; call it before building them.

    Horovod 0.28.1's ``horovod.tensorflow.keras.callbacks`` (and
    ``horovod.tensorflow.keras`` itself) do ``from keras import backend as
    K`` and pass ``K`` to every callback they build.  Under TensorFlow 2.16
    and later that ``keras`` is Keras 3, whose backend has no ``get_value``,
    ``set_value`` or ``constant``, so ``MetricAverageCallback`` fails at the
    first epoch end (``module 'keras.backend' has no attribute 'constant'``)
    and ``LearningRateWarmupCallback`` / ``LearningRateScheduleCallback`` at
    the first batch, whatever the compression.  This rebinds both modules'
    ``K`` to tf_keras' backend (:class:`TFKerasBackendForHorovod`), the Keras 2
    of the model and optimizer that Horovod's Keras ``DistributedOptimizer``
    needs anyway.

    Idempotent, and a no-op (returns False) where ``K`` already is a Keras 2
    backend; returns True when it rebound ``K``.  Raises ImportError when
    tf_keras is not installed, and RuntimeError when ``tf.keras`` is Keras 3
    (``TF_USE_LEGACY_KERAS=1`` was not set before TensorFlow was imported).
    Callbacks built before the call keep the backend they were given.
    """
    import horovod.tensorflow.keras as hvd_keras
    from horovod.tensorflow.keras import callbacks as hvd_callbacks
    modules = (hvd_keras, hvd_callbacks)
    if all(_is_keras2_backend(getattr(m, "K", None)) for m in modules):
        return False
    import tensorflow as tf
    try:
        import tf_keras
    except ImportError as err:
        raise ImportError(f"use_tf_keras_in_horovod_callbacks needs the tf_keras package (Keras 2 for TensorFlow; "
                          f"Horovod's Keras callbacks and DistributedOptimizer need Keras 2): install the one that "
                          f"matches TensorFlow {tf.__version__}, e.g. pip install 'tf_keras~="
                          f"{'.'.join(tf.__version__.split('.')[:2])}.0' (scripts/install.sh does)") from err
    keras_name = getattr(tf.keras, "__name__", "")
    if not keras_name.startswith("tf_keras"):
        raise RuntimeError(f"tf.keras is Keras 3 here ({keras_name}), and Horovod 0.28.1's Keras integration "
                           f"needs Keras 2: set the environment variable TF_USE_LEGACY_KERAS=1 before TensorFlow is "
                           f"imported (tf.keras is then tf_keras), and build the model and optimizer with tf.keras, "
                           f"never 'import keras'")
    backend = TFKerasBackendForHorovod(tf_keras.backend)
    for m in modules:
        m.K = backend
    return True


def _is_keras2_backend(backend) -> bool:
    return backend is not None and all(hasattr(backend, f) for f in _KERAS2_BACKEND_FUNCTIONS)


# The adapters import this module from their first compress call, when Horovod
# is already imported: warn now if it is not the release these readers know.
check_version()
