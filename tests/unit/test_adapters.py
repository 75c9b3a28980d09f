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


def test_a_plain_dense_phase_hands_the_gradient_over_as_is():
    """Only a phase that sends the gradient unchanged (NoCompression, no memory),
    in force at this step, for an optimizer's parameter whose gradient Horovod's
    allreduce takes as it is (contiguous float32), skips the call and transport."""
    torch = pytest.importorskip("torch")
    from hvd_compress import NoCompression, TopK
    from hvd_compress.adapters.base import CallerInfo
    from hvd_compress.adapters.torch_adapter import TorchAdapter
    from hvd_compress.compressor import Phase
    from hvd_compress.feedback.memory import MomentumMemory, ResidualMemory
    adapter, info = TorchAdapter(), CallerInfo("w", None, 0, 2, owns_input=True)
    dense = [Phase(0, NoCompression().scheme, None, "allgather")]
    grad = torch.ones(4, 5)
    assert adapter._passes_through(dense, 1, info, grad)
    assert not adapter._passes_through(dense, 1, CallerInfo(None, None, 0, 2), grad)  # a direct call
    assert not adapter._passes_through(dense, 1, info, grad.half())
    assert not adapter._passes_through(dense, 1, info, grad.t())  # Horovod refuses non-contiguous tensors
    momentum = [Phase(0, NoCompression().scheme, MomentumMemory(0.9, error_feedback=False), "allgather")]
    assert not adapter._passes_through(momentum, 1, info, grad)
    # a lossy phase, then its residual flushed for one step, then plain
    scheduled = [Phase(0, TopK(0.1).scheme, ResidualMemory(), "allgather"),
                 Phase(4, NoCompression().scheme, ResidualMemory(), "allgather"),
                 Phase(5, NoCompression().scheme, None, "allgather")]
    assert [adapter._passes_through(scheduled, step, info, grad) for step in range(1, 8)] == [False] * 5 + [True] * 2
