"""Unit tests of :mod:`hvd_compress.integration.fingerprint`: the per-rank descriptions
and the error that names what differs (the collective itself is exercised
under horovodrun in tests/testing/test_mismatch.py)."""
import pytest

import hvd_compress as hc
from hvd_compress.integration.fingerprint import ConfigMismatchError, compare, describe_side

PARAMS = [("layer.weight", (32, 16)), ("layer.bias", (32,))]


def test_identical_sides_pass():
    comp = hc.TopK(0.01)
    compare([describe_side(comp, PARAMS, 2), describe_side(hc.TopK(0.01), list(reversed(PARAMS)), 2)])


def test_scheme_difference_is_named():
    with pytest.raises(ConfigMismatchError, match="compression differs"):
        compare([describe_side(hc.TopK(0.01), PARAMS, 2), describe_side(hc.TopK(0.02), PARAMS, 2)])


def test_extra_missing_and_reshaped_parameters_are_named():
    other = [("layer.weight", (16, 32)), ("extra.weight", (8, 4))]
    with pytest.raises(ConfigMismatchError) as e:
        compare([describe_side(hc.Int8(), PARAMS, 2), describe_side(hc.Int8(), other, 2)])
    msg = str(e.value)
    assert "rank 1 has parameters rank 0 lacks: extra.weight" in msg
    assert "rank 1 lacks parameters rank 0 has: layer.bias" in msg
    assert "parameter layer.weight has shape [32, 16] on rank 0 and [16, 32] on rank 1" in msg


def test_huge_parameter_lists_travel_as_a_digest_only(monkeypatch):
    import hvd_compress.integration.fingerprint as fp
    monkeypatch.setattr(fp, "MAX_LISTED_PARAMS_BYTES", 10)
    blob = describe_side(hc.Int8(), PARAMS, 2)
    assert b"layer.weight" not in blob
    with pytest.raises(ConfigMismatchError, match="parameters differs"):
        compare([blob, describe_side(hc.Int8(), PARAMS[:1], 2)])
