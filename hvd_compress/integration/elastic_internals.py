"""What elastic Horovod in TensorFlow needs of Horovod 0.28.1's internals,
beside :mod:`hvd_compress.integration.horovod_internals` (whose version check covers it):

* :func:`retrace_after_reset` drops the traced allreduce functions Horovod
  caches per compression and the traces of every ``tf.function`` holding
  hvd_compress's ops, so a step after a membership change traces
  hvd_compress's graph again for the new world;
* :func:`tf_elastic_run` is Horovod's TF ``hvd.elastic.run`` with a failure
  test that also knows named collectives (:func:`is_tf_collective_failure`),
  and :func:`use_tf_elastic_run_in_horovod` installs it.
"""
from __future__ import annotations

from . import horovod_internals  # noqa: F401  (its import warns on an untested Horovod)


def retrace_after_reset(compression, state):
    """Elastic TF: make the next step trace hvd_compress's graph again for the
    new world (its rank, size and two-phase chunk shapes are fixed when a step
    is traced, while Horovod's own ops read the size at run time).

    Horovod 0.28.1 keeps one ``tf.function`` per (name, devices, compression,
    ...) in the closure dict ``cache`` of ``_make_cached_allreduce_grads_fn``
    (wrapped by ``horovod.tensorflow.util._cache``: keys ``(args, eager)``); ``DistributedGradientTape``
    asks for it at every construction, the Keras ``DistributedOptimizer`` keeps
    it as ``_allreduce_grads``.  The entries made with ``compression`` are
    dropped and made again, the state's optimizer (if it holds one of them)
    gets the new one, and a Keras model's ``train_function`` is dropped so
    that ``fit`` traces anew.  Every other live ``tf.function`` with a trace
    that holds hvd_compress's ops (a module-level step of the user's around a
    ``DistributedGradientTape``) drops its traces, so its next call traces
    again for the new world (:func:`hvd_compress.adapters.tf_traces.functions_holding_our_ops`)."""
    import horovod.tensorflow as hvd_tf
    wrapper = hvd_tf._make_cached_allreduce_grads_fn
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
    cache = cells["cache"].cell_contents if "cache" in cells else None
    if not isinstance(cache, dict):
        raise RuntimeError("hvd_compress.elastic: Horovod's TF allreduce-function cache is not where Horovod 0.28.1 "
                           "keeps it; a step traced before the reset would keep the old world's sizes")
    optimizer = getattr(state, "optimizer", None)
    for key in [k for k in cache if any(arg is compression for arg in k[0])]:
        old = cache.pop(key)
        new = wrapper(*key[0])
        if optimizer is not None and getattr(optimizer, "_allreduce_grads", None) is old:
            optimizer._allreduce_grads = new
        helper = getattr(optimizer, "_agg_helper", None)
        if helper is not None and getattr(helper, "_allreduce_grads", None) is old:
            helper._allreduce_grads = new
    model = getattr(state, "model", None)
    if model is not None and hasattr(model, "train_function"):
        model.train_function = None
    from ..adapters.tf_traces import drop_traces, functions_holding_our_ops
    for function in functions_holding_our_ops():  # the user's own steps among them
        drop_traces(function)


#: text by which a TensorFlow error is a failed Horovod collective: the op types that name Horovod's
#: unnamed collectives, the text of every collective pending when Horovod shuts down after a peer fails,
#: and the prefix of hvd_compress's own collectives' names (hvdc.)
_TF_COLLECTIVE_FAILURE_MARKERS = ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast",
                                  "Horovod has been shut down", "{{node hvdc.")


def is_tf_collective_failure(error) -> bool:
    """Whether a TensorFlow error is a Horovod collective failing (a peer gone)."""
    message = getattr(error, "message", None) or str(error)
    return any(marker in message for marker in _TF_COLLECTIVE_FAILURE_MARKERS)


def tf_elastic_run(func):
    """``hvd.elastic.run`` for TensorFlow that rolls back after a failed
    collective whatever its name.

    Horovod 0.28.1's ``horovod.tensorflow.elastic.run`` turns a
    ``tf.errors.UnknownError`` into ``HorovodInternalError`` (restore the last
    commit, reset, go on) only when its message holds ``HorovodAllreduce``,
    ``HorovodAllgather`` or ``HorovodBroadcast``: the names Horovod gives
    collectives called without ``name=``.  A failure in a named collective
    (``hvd.allreduce(t, name="loss")``; every collective of hvd_compress, whose
    names are deterministic: ``{{node hvdc.topk...}}``; Horovod's own ops
    inside a traced step are reported by node name too) is *swallowed*: the
    wrapped function returns None as if training had finished, and the script
    goes on to its next collective with a dead peer.  This wrapper turns every
    Horovod collective failure (:func:`is_tf_collective_failure`) into
    ``HorovodInternalError`` and lets any other error propagate, around
    Horovod's own ``run_fn`` and reset."""
    import functools

    import tensorflow as tf
    from horovod.common import elastic as hvd_common_elastic
    from horovod.common.exceptions import HorovodInternalError
    from horovod.tensorflow import elastic as hvd_tf_elastic

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as e:
            if is_tf_collective_failure(e):
                raise HorovodInternalError(e) from e
            raise

    return hvd_common_elastic.run_fn(wrapper, hvd_tf_elastic._reset)


def use_tf_elastic_run_in_horovod():
    """Make ``hvd.elastic.run`` (``horovod.tensorflow.elastic.run`` and
    ``horovod.tensorflow.keras.elastic.run``) :func:`tf_elastic_run` for the
    functions decorated from now on; idempotent.  Called by
    ``hvd_compress.elastic.register`` with a TensorFlow state."""
    import horovod.tensorflow.elastic as hvd_tf_elastic
    modules = [hvd_tf_elastic]
    try:
        import horovod.tensorflow.keras.elastic as hvd_keras_elastic
        modules.append(hvd_keras_elastic)
    except ImportError:  # no Keras
        pass
    for module in modules:
        module.run = tf_elastic_run
