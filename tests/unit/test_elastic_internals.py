"""Unit tests of hvd_compress.integration.elastic_internals's failure test and TF
elastic run; the elastic jobs run them for real (tests/testing/test_elastic_jobs.py)."""
import types

import pytest

from hvd_compress.integration import elastic_internals


_NAMED_FAILURE = ("Graph execution error:\n\nDetected at node hvdc.named.sum defined at (most recent call last):\n"
                  "...Horovod has been shut down. This was caused by an exception on one of the ranks or an "
                  "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
                  "execution.\n\t [[{{node hvdc.named.sum}}]] [Op:__inference_step_12]")


def test_a_named_collective_failure_is_recognised_where_horovods_test_misses_it():
    stock_markers = ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast")  # horovod.tensorflow.elastic.run
    assert not any(m in _NAMED_FAILURE for m in stock_markers)  # Horovod 0.28.1 swallows this one
    assert elastic_internals.is_tf_collective_failure(types.SimpleNamespace(message=_NAMED_FAILURE))
    assert elastic_internals.is_tf_collective_failure(
        types.SimpleNamespace(message="[[{{node HorovodAllreduce_grads_0}}]] Connection reset by peer"))
    assert not elastic_internals.is_tf_collective_failure(
        types.SimpleNamespace(message="Graph execution error: Detected at node loss/div: Input is not invertible"))


def test_tf_elastic_run_turns_a_named_collective_failure_into_a_rollback(monkeypatch):
    """The wrapped function's UnknownError from a named collective reaches Horovod's run_fn as
    HorovodInternalError (restore, reset, run again); any other error propagates."""
    tf = pytest.importorskip("tensorflow")
    hvd_elastic = pytest.importorskip("horovod.tensorflow.elastic")
    import horovod.common.elastic as common_elastic
    from horovod.common.exceptions import HorovodInternalError
    seen = {}

    def fake_run_fn(func, reset):  # Horovod's loop, reduced to one catch
        def loop(state):
            try:
                return func(state)
            except HorovodInternalError as e:
                seen["rolled_back"] = e
                return "restored"
        return loop

    monkeypatch.setattr(common_elastic, "run_fn", fake_run_fn)
    raised = {"error": tf.errors.UnknownError(None, None, _NAMED_FAILURE)}

    def train(state):
        raise raised["error"]

    assert elastic_internals.tf_elastic_run(train)(object()) == "restored"
    assert isinstance(seen["rolled_back"], HorovodInternalError)
    raised["error"] = tf.errors.UnknownError(None, None, "Detected at node loss/div: not a collective")
    with pytest.raises(tf.errors.UnknownError, match="not a collective"):
        elastic_internals.tf_elastic_run(train)(object())
    monkeypatch.setattr(hvd_elastic, "run", hvd_elastic.run)  # restored after the test
    keras_elastic = pytest.importorskip("horovod.tensorflow.keras.elastic")
    monkeypatch.setattr(keras_elastic, "run", keras_elastic.run)
    elastic_internals.use_tf_elastic_run_in_horovod()
    assert hvd_elastic.run is elastic_internals.tf_elastic_run and keras_elastic.run is elastic_internals.tf_elastic_run
