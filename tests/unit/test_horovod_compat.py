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
