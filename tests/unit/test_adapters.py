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


def test_torch_adapter_builds_the_optimizers_parameter_list_once_per_optimizer():
    """Every tensor's call needs the optimizer's [(name, shape)]; it is built once per
    optimizer and parameter count, not once per call (O(tensors^2) a step)."""
    pytest.importorskip("torch")
    from types import SimpleNamespace
    from hvd_compress.adapters.torch_adapter import TorchAdapter
    built = []

    def caller_of(optimizer):
        def params():
            built.append(optimizer)
            return [(n, ()) for n in optimizer._parameter_names.values()]
        return SimpleNamespace(optimizer=optimizer, params=params)
    adapter = TorchAdapter()
    first = SimpleNamespace(_parameter_names={1: "a", 2: "b"})
    for _ in range(3):
        assert adapter._params_of(caller_of(first)) == [("a", ()), ("b", ())]
    first._parameter_names[3] = "c"  # a parameter group added: built again
    assert len(adapter._params_of(caller_of(first))) == 3
    second = SimpleNamespace(_parameter_names={1: "x"})
    assert adapter._params_of(caller_of(second)) == [("x", ())]
    assert built == [first, first, second]
