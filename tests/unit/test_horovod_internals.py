"""Unit tests of hvd_compress.integration.horovod_internals's pure parts and of collective
names; the frame readers are exercised under horovodrun
(tests/horovod/test_drop_in_tf.py, test_drop_in_torch.py)."""
import importlib.util
import sys
import types
import warnings
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from hvd_compress.integration import horovod_internals
from hvd_compress.cross_rank import collective_name

NAMES = st.lists(st.sampled_from(["Variable:0", "Variable_0", "a/b:0", "a_b:0", "dense/kernel:0", "x"]),
                 max_size=12)


@given(NAMES)
def test_unique_keys_are_unique_and_keep_unrepeated_names(names):
    keys = horovod_internals.unique_keys(names)
    assert len(keys) == len(names) and len(set(keys)) == len(keys)
    for name, key in zip(names, keys):
        assert key == name if names.count(name) == 1 else key.startswith(name + "#")


def test_unique_keys_number_repeats_in_list_order():
    assert horovod_internals.unique_keys(["Variable:0", "w:0", "Variable:0"]) == ["Variable:0#0", "w:0", "Variable:0#1"]


@given(NAMES)
def test_collective_names_are_distinct_for_distinct_keys(names):
    keys = sorted(set(horovod_internals.unique_keys(names)) | set(names))
    made = {collective_name(k, "idx") for k in keys}
    assert len(made) == len(keys)
    for name in made:  # usable as a TF op name
        assert all(c.isalnum() or c in "_.-" for c in name), name


def test_collective_name_unchanged_for_safe_keys():
    assert collective_name("layer1.weight", "val") == "hvdc.layer1.weight.val"


def test_fallback_key_warning_once_names_the_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        horovod_internals.warn_fallback_key("anon:3x4#0", "torch")
        horovod_internals.warn_fallback_key("anon:3x4#0", "torch")
    assert len(caught) == 1 and "anon:3x4#0" in str(caught[0].message)


def test_version_check_warns_for_another_horovod(monkeypatch):
    fake = type(sys)("horovod")
    fake.__version__ = "0.99.0"
    monkeypatch.setitem(sys.modules, "horovod", fake)
    monkeypatch.setattr(horovod_internals, "_version_checked", False)
    with pytest.warns(RuntimeWarning, match="0.99.0"):
        horovod_internals.check_version()


def test_finders_outside_horovod_find_nothing():
    assert horovod_internals.find_torch_caller().optimizer is None
    caller = horovod_internals.find_tf_caller(object())
    assert caller.variables is None and caller.key is None


# --- use_tf_keras_in_horovod_callbacks: Horovod's Keras callbacks on tf_keras ------------------
@pytest.fixture
def horovod_keras(monkeypatch):
    """horovod.tensorflow.keras and its callbacks module, their ``K`` restored after the test."""
    pytest.importorskip("tf_keras")
    pytest.importorskip("horovod.tensorflow.keras",
                        reason="Horovod with TensorFlow is not installed (scripts/install.sh --no-horovod)")
    import horovod.tensorflow.keras as hvd_keras
    from horovod.tensorflow.keras import callbacks as hvd_callbacks
    for module in (hvd_keras, hvd_callbacks):
        monkeypatch.setattr(module, "K", module.K)
    return hvd_keras, hvd_callbacks


def test_use_tf_keras_rebinds_the_backend_of_horovods_keras_modules_once(horovod_keras):
    import tf_keras
    for module in horovod_keras:  # as Horovod 0.28.1 leaves them under TF 2.21: Keras 3's backend
        assert not hasattr(module.K, "constant") and not hasattr(module.K, "get_value"), module.K
    assert horovod_internals.use_tf_keras_in_horovod_callbacks() is True
    for module in horovod_keras:
        assert isinstance(module.K, horovod_internals.TFKerasBackendForHorovod)
        assert module.K.get_value is tf_keras.backend.get_value and module.K.constant is tf_keras.backend.constant
    backend = horovod_keras[1].K
    assert horovod_internals.use_tf_keras_in_horovod_callbacks() is False
    assert horovod_keras[1].K is backend


def test_use_tf_keras_leaves_a_keras2_backend_alone(horovod_keras):
    import tf_keras
    for module in horovod_keras:
        module.K = tf_keras.backend
    assert horovod_internals.use_tf_keras_in_horovod_callbacks() is False
    assert all(module.K is tf_keras.backend for module in horovod_keras)


def test_use_tf_keras_without_tf_keras_says_what_to_install(horovod_keras, monkeypatch):
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # import tf_keras raises ImportError
    with pytest.raises(ImportError, match=r"needs the tf_keras package.*pip install 'tf_keras~="):
        horovod_internals.use_tf_keras_in_horovod_callbacks()
    assert not hasattr(horovod_keras[1].K, "constant")  # nothing rebound


def test_use_tf_keras_under_keras3_says_to_set_the_legacy_switch(horovod_keras, monkeypatch):
    from types import SimpleNamespace

    import tensorflow as tf
    monkeypatch.setattr(tf, "keras", SimpleNamespace(__name__="keras._tf_keras.keras"))
    with pytest.raises(RuntimeError, match="TF_USE_LEGACY_KERAS=1 before TensorFlow is imported"):
        horovod_internals.use_tf_keras_in_horovod_callbacks()
    assert not hasattr(horovod_keras[1].K, "constant")


def test_the_backend_explains_a_hyperparameter_kept_as_a_python_number():
    tf_keras = pytest.importorskip("tf_keras")
    import tensorflow as tf
    backend = horovod_internals.TFKerasBackendForHorovod(tf_keras.backend)
    lr = tf.Variable(0.1)
    backend.set_value(lr, 0.025)
    assert backend.get_value(lr) == pytest.approx(0.025)
    backend.set_value(0.0, 0.0)  # momentum 0 under Horovod's momentum correction: nothing to change
    with pytest.raises(TypeError, match="momentum_correction=False"):
        backend.set_value(0.9, 0.45)


# --- the frame readers on this Python's frames ------------------------------------------
# Python 3.12 inlines comprehensions into the function's frame (PEP 709); up to 3.11
# a comprehension has a frame of its own.  horovod_call_shapes.py replays the calls
# through which Horovod 0.28.1 reaches ``compress``, loaded under Horovod's module name,
# so these tests read the frames this interpreter really makes.
HOROVOD_SHAPES = Path(__file__).with_name("horovod_call_shapes.py")


@pytest.fixture(scope="module")
def hvd_shapes():
    spec = importlib.util.spec_from_file_location("horovod.tensorflow", HOROVOD_SHAPES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__name__ == "horovod.tensorflow"
    return module


class Recorder:
    """A Compression whose ``compress`` asks the frame readers what Horovod is reducing."""

    def __init__(self, find):
        self.find, self.seen = find, []

    def compress(self, tensor):
        self.seen.append((tensor, self.find(tensor)))
        return tensor, None


class Var:  # what the readers use of a tf.Variable
    def __init__(self, name):
        self.name = name


def _torch_parameters(monkeypatch):
    """Factories of a parameter and of a gradient: torch's when installed, else a
    stand-in ``torch`` module (the reader only asks ``isinstance(p, torch.Tensor)``)."""
    try:
        import torch
        return lambda: torch.zeros(2, requires_grad=True), lambda: torch.zeros(2)
    except ImportError:
        fake = types.ModuleType("torch")

        class Tensor:
            grad = None
        fake.Tensor = Tensor
        monkeypatch.setitem(sys.modules, "torch", fake)
        return Tensor, object


@pytest.mark.parametrize("grouped", [False, True], ids=["per_parameter", "grouped"])
def test_torch_reader_finds_the_parameter_and_optimizer(hvd_shapes, monkeypatch, grouped):
    make_param, make_grad = _torch_parameters(monkeypatch)
    params = [make_param() for _ in range(3)]
    for p in params:
        p.grad = make_grad()
    recorder = Recorder(lambda tensor: horovod_internals.find_torch_caller())
    opt = hvd_shapes.TorchDistributedOptimizer([(f"layer{k}.weight", p) for k, p in enumerate(params)],
                                               recorder, process_set="the process set")
    if grouped:
        opt._grouped_allreduce_grad_async(params)
    else:
        for p in params:
            opt._allreduce_grad_async(p)
    assert [caller.optimizer for _, caller in recorder.seen] == [opt] * 3
    assert [caller.key for _, caller in recorder.seen] == ["layer0.weight", "layer1.weight", "layer2.weight"]
    assert recorder.seen[0][1].process_set == "the process set"


@pytest.mark.parametrize("groups", [None, 2, "list"], ids=["ungrouped", "groups=2", "groups=list"])
def test_tf_reader_finds_each_variable_and_numbers_repeated_names(hvd_shapes, groups):
    names = ["Variable:0", "dense/kernel:0", "Variable:0", "dense/bias:0"]
    keys = ["Variable:0#0", "dense/kernel:0", "Variable:0#1", "dense/bias:0"]
    if groups == "list":  # Horovod matches list groups by name, so its names must differ
        names[2] = "Variable_1:0"
        keys = names
    variables = [Var(n) for n in names]
    grads = [object() for _ in variables]
    recorder = Recorder(horovod_internals.find_tf_caller)
    if groups == "list":
        groups = [[variables[3], variables[0]]]  # the rest go one per group
    allreduce_grads = hvd_shapes.make_allreduce_grads_fn(recorder, groups, process_set="the process set")
    assert allreduce_grads(grads, variables) == grads
    found = {id(tensor): caller for tensor, caller in recorder.seen}
    assert [found[id(g)].key for g in grads] == keys
    assert all(caller.process_set == "the process set" and caller.variables == variables
               for caller in found.values())


def test_tf_reader_leaves_a_gradient_it_cannot_place_unkeyed(hvd_shapes):
    """A tensor that is not one of ``grads`` gets no key (the adapter then warns and uses
    a shape key) -- never a loop index, which Python 3.11 keeps in the comprehension's
    frame and 3.12 in the function's."""
    variables = [Var("a:0"), Var("b:0")]
    recorder = Recorder(lambda tensor: horovod_internals.find_tf_caller(object()))
    hvd_shapes.make_allreduce_grads_fn(recorder, None, process_set="ps")([object(), object()], variables)
    assert [caller.key for _, caller in recorder.seen] == [None, None]
    assert all(caller.variables == variables for _, caller in recorder.seen)


def test_keras_reader_finds_the_wrapping_optimizer(hvd_shapes):
    recorder = Recorder(lambda tensor: horovod_internals.find_keras_optimizer())
    keras_opt = hvd_shapes.KerasDistributedOptimizer(hvd_shapes.make_allreduce_grads_fn(recorder, None, "ps"))
    keras_opt._allreduce([object(), object()], [Var("a:0"), Var("b:0")])
    assert [found for _, found in recorder.seen] == [keras_opt, keras_opt]


#: the message of a failed named collective in a traced step (2-rank Gloo job, one rank SIGKILLed)
