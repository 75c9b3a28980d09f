"""hvd_compress.adapters.base: the switch of the 2-rank swap (``HVDC_PAIR_SWAP_MIN_BYTES``)."""
import pytest

from hvd_compress.adapters.base import PAIR_SWAP_ENV, pair_swap_min_bytes


def test_pair_swap_is_off_unless_set(monkeypatch):
    monkeypatch.delenv(PAIR_SWAP_ENV, raising=False)
    assert pair_swap_min_bytes() is None
    monkeypatch.setenv(PAIR_SWAP_ENV, " ")
    assert pair_swap_min_bytes() is None
    monkeypatch.setenv(PAIR_SWAP_ENV, "1048576")
    assert pair_swap_min_bytes() == 1048576
    monkeypatch.setenv(PAIR_SWAP_ENV, "0")
    assert pair_swap_min_bytes() == 0


@pytest.mark.parametrize("bad", ["1MiB", "-1", "1.5"])
def test_pair_swap_bad_value_named(monkeypatch, bad):
    monkeypatch.setenv(PAIR_SWAP_ENV, bad)
    with pytest.raises(ValueError, match=f"HVDC_PAIR_SWAP_MIN_BYTES must be a byte count .*{bad!r}"):
        pair_swap_min_bytes()
