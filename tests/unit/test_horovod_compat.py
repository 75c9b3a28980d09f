"""Unit tests of hvd_compress.horovod_compat's pure parts and of collective
names; the frame readers are exercised under horovodrun
(tests/horovod/test_drop_in_tf.py, test_drop_in_torch.py)."""
import sys
import warnings

import pytest
from hypothesis import given, strategies as st

from hvd_compress import horovod_compat
from hvd_compress.naming import collective_name

NAMES = st.lists(st.sampled_from(["Variable:0", "Variable_0", "a/b:0", "a_b:0", "dense/kernel:0", "x"]),
                 max_size=12)


@given(NAMES)
def test_unique_keys_are_unique_and_keep_unrepeated_names(names):
    keys = horovod_compat.unique_keys(names)
    assert len(keys) == len(names) and len(set(keys)) == len(keys)
    for name, key in zip(names, keys):
        assert key == name if names.count(name) == 1 else key.startswith(name + "#")


def test_unique_keys_number_repeats_in_list_order():
    assert horovod_compat.unique_keys(["Variable:0", "w:0", "Variable:0"]) == ["Variable:0#0", "w:0", "Variable:0#1"]


@given(NAMES)
def test_collective_names_are_distinct_for_distinct_keys(names):
    keys = sorted(set(horovod_compat.unique_keys(names)) | set(names))
    made = {collective_name(k, "idx") for k in keys}
    assert len(made) == len(keys)
    for name in made:  # usable as a TF op name
        assert all(c.isalnum() or c in "_.-" for c in name), name


def test_collective_name_unchanged_for_safe_keys():
    assert collective_name("layer1.weight", "val") == "hvdc.layer1.weight.val"


def test_fallback_key_warning_once_names_the_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        horovod_compat.warn_fallback_key("anon:3x4#0", "torch")
        horovod_compat.warn_fallback_key("anon:3x4#0", "torch")
    assert len(caught) == 1 and "anon:3x4#0" in str(caught[0].message)


def test_version_check_warns_for_another_horovod(monkeypatch):
    fake = type(sys)("horovod")
    fake.__version__ = "0.99.0"
    monkeypatch.setitem(sys.modules, "horovod", fake)
    monkeypatch.setattr(horovod_compat, "_version_checked", False)
    with pytest.warns(RuntimeWarning, match="0.99.0"):
        horovod_compat.check_version()


def test_finders_outside_horovod_find_nothing():
    assert horovod_compat.find_torch_caller().optimizer is None
    caller = horovod_compat.find_tf_caller(object())
    assert caller.variables is None and caller.key is None


# --- use_tf_keras_in_horovod_callbacks: Horovod's Keras callbacks on tf_keras ------------------
@pytest.fixture
def horovod_keras(monkeypatch):
    """horovod.tensorflow.keras and its callbacks module, their ``K`` restored after the test."""
    pytest.importorskip("tf_keras")
    import horovod.tensorflow.keras as hvd_keras
    from horovod.tensorflow.keras import callbacks as hvd_callbacks
    for module in (hvd_keras, hvd_callbacks):
        monkeypatch.setattr(module, "K", module.K)
    return hvd_keras, hvd_callbacks


def test_use_tf_keras_rebinds_the_backend_of_horovods_keras_modules_once(horovod_keras):
    import tf_keras
    for module in horovod_keras:  # as Horovod 0.28.1 leaves them under TF 2.21: Keras 3's backend
        assert not hasattr(module.K, "constant") and not hasattr(module.K, "get_value"), module.K
    assert horovod_compat.use_tf_keras_in_horovod_callbacks() is True
    for module in horovod_keras:
        assert isinstance(module.K, horovod_compat.TFKerasBackendForHorovod)
        assert module.K.get_value is tf_keras.backend.get_value and module.K.constant is tf_keras.backend.constant
    backend = horovod_keras[1].K
    assert horovod_compat.use_tf_keras_in_horovod_callbacks() is False
    assert horovod_keras[1].K is backend


def test_use_tf_keras_leaves_a_keras2_backend_alone(horovod_keras):
    import tf_keras
    for module in horovod_keras:
        module.K = tf_keras.backend
    assert horovod_compat.use_tf_keras_in_horovod_callbacks() is False
    assert all(module.K is tf_keras.backend for module in horovod_keras)


def test_use_tf_keras_without_tf_keras_says_what_to_install(horovod_keras, monkeypatch):
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # import tf_keras raises ImportError
    with pytest.raises(ImportError, match=r"needs the tf_keras package.*pip install 'tf_keras~="):
        horovod_compat.use_tf_keras_in_horovod_callbacks()
    assert not hasattr(horovod_keras[1].K, "constant")  # nothing rebound


def test_use_tf_keras_under_keras3_says_to_set_the_legacy_switch(horovod_keras, monkeypatch):
    from types import SimpleNamespace

    import tensorflow as tf
    monkeypatch.setattr(tf, "keras", SimpleNamespace(__name__="keras._tf_keras.keras"))
    with pytest.raises(RuntimeError, match="TF_USE_LEGACY_KERAS=1 before TensorFlow is imported"):
        horovod_compat.use_tf_keras_in_horovod_callbacks()
    assert not hasattr(horovod_keras[1].K, "constant")


def test_the_backend_explains_a_hyperparameter_kept_as_a_python_number():
    tf_keras = pytest.importorskip("tf_keras")
    import tensorflow as tf
    backend = horovod_compat.TFKerasBackendForHorovod(tf_keras.backend)
    lr = tf.Variable(0.1)
    backend.set_value(lr, 0.025)
    assert backend.get_value(lr) == pytest.approx(0.025)
    backend.set_value(0.0, 0.0)  # momentum 0 under Horovod's momentum correction: nothing to change
    with pytest.raises(TypeError, match="momentum_correction=False"):
        backend.set_value(0.9, 0.45)
