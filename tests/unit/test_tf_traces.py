"""hvd_compress.adapters.tf_traces without Horovod: state made during a retrace, and
keys that follow the variable whatever list it comes in.  Under horovodrun,
tests/horovod/test_drop_in_tf.py runs the same through Horovod's TF paths."""
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvd_compress.adapters.tf_traces import VariableKeys, state_variable  # noqa: E402


def _retraced_step(make):
    """A tf.function that makes state for each new input length through ``make``
    (length -> variable), called with lengths 2, 2, 3: the third call retraces."""
    store = {}

    @tf.function
    def step(x):
        n = x.shape[0]
        if n not in store:
            store[n] = make(n)
        return store[n].assign_add(x)
    return [step(tf.ones([n])).numpy().tolist() for n in (2, 2, 3)]


def test_state_variable_can_be_made_by_a_retrace():
    assert _retraced_step(lambda n: state_variable(lambda: tf.zeros([n]), tf.float32)) == \
        [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0, 1.0]]


def test_init_scope_variable_made_by_a_retrace_is_refused():
    """What state_variable avoids: TF refuses a variable made under init_scope by a retrace."""
    def under_init_scope(n):
        with tf.init_scope():
            return tf.Variable(tf.zeros([n]), trainable=False)
    with pytest.raises(ValueError, match="singleton tf.Variables"):
        _retraced_step(under_init_scope)


def test_state_variable_holds_strings_and_initial_values():
    v = state_variable("", tf.string, name="hvdc_plan")
    assert v.numpy() == b"" and not v.trainable
    assert state_variable(tf.constant([1.0, 2.0]), tf.float32).numpy().tolist() == [1.0, 2.0]


def test_state_variable_raises_the_error_of_its_thread():
    with pytest.raises((ValueError, TypeError)):
        state_variable(lambda: tf.zeros([2]), tf.int64)


def test_one_thread_makes_every_state_variable_and_outlives_an_error():
    import threading

    from hvd_compress.backend import tf_backend
    state_variable(0, tf.int64)
    maker = tf_backend._MAKER._thread
    assert maker is not threading.current_thread() and maker.daemon
    with pytest.raises((ValueError, TypeError)):
        state_variable(lambda: tf.zeros([2]), tf.int64)
    made = [state_variable(i, tf.int64) for i in range(3)]  # a trace's variables, one after another
    assert [int(v.numpy()) for v in made] == [0, 1, 2]
    assert tf_backend._MAKER._thread is maker and maker.is_alive()


def test_keys_follow_the_variable_whatever_list_it_comes_in():
    a, b, c, d = (tf.Variable(tf.zeros([n])) for n in (1, 2, 1, 2))  # all named Variable:0
    keys = VariableKeys()
    first = keys.keys_for([a, b, c])
    assert first == ["Variable:0#0", "Variable:0#1", "Variable:0#2"]
    assert keys.keys_for([c, a]) == [first[2], first[0]]  # a subset, reordered: the same keys
    # new ones get free keys: the name itself (once among the new), then the first free name#k
    assert keys.keys_for([d, b]) == ["Variable:0", first[1]]
    e = tf.Variable(0.0)
    assert keys.keys_for([e]) == ["Variable:0#3"]
    assert keys.key_of(d) == "Variable:0" and keys.key_of(tf.Variable(0.0)) is None


def test_keys_keep_unrepeated_names_and_never_reuse_a_key():
    keys = VariableKeys()
    w = tf.Variable(0.0, name="w")
    assert keys.keys_for([w]) == ["w:0"]
    del w
    gc.collect()
    w2 = tf.Variable(0.0, name="w")  # another model's variable of the same name
    assert keys.keys_for([w2]) == ["w:0#0"]
    u, v = tf.Variable(0.0, name="u"), tf.Variable(0.0, name="v")
    assert keys.keys_for([u, v, u]) == ["u:0", "v:0", "u:0"]  # one variable twice: one key
