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
    """Only a phase that sends the gradient unchanged (NoCompression) with no
    memory, or with a velocity alone that the fused pass writes into the
    gradient, in force at this step, for an optimizer's parameter whose
    gradient Horovod's allreduce takes as it is (contiguous float32), skips the
    call and transport."""
    torch = pytest.importorskip("torch")
    from hvd_compress import NoCompression, TopK
    from hvd_compress.adapters.base import CallerInfo
    from hvd_compress.adapters.torch_adapter import TorchAdapter
    from hvd_compress.codecs.torch_fused import fuses
    from hvd_compress.compressor import Phase
    from hvd_compress.feedback.memory import DGCMemory, MomentumMemory, ResidualMemory
    adapter, info = TorchAdapter(), CallerInfo("w", None, 0, 2, owns_input=True)
    plain = NoCompression().scheme
    dense = [Phase(0, plain, None, "allgather")]
    grad = torch.ones(4, 5)
    assert adapter._handed_over_as_is(dense, 1, info, grad) is dense[0]
    assert adapter._handed_over_as_is(dense, 1, CallerInfo(None, None, 0, 2), grad) is None  # a direct call
    assert adapter._handed_over_as_is(dense, 1, info, grad.half()) is None
    assert adapter._handed_over_as_is(dense, 1, info, grad.t()) is None  # Horovod refuses non-contiguous tensors
    velocity = [Phase(0, plain, MomentumMemory(0.9, error_feedback=False), "allgather")]
    assert adapter._handed_over_as_is(velocity, 1, info, grad) is (velocity[0] if fuses(grad) else None)
    assert adapter._handed_over_as_is(velocity, 1, CallerInfo("w", None, 0, 2), grad) is None  # not Horovod's buffer
    for memory in (MomentumMemory(0.9), ResidualMemory(), DGCMemory(0.9)):  # a residual to keep
        assert adapter._handed_over_as_is([Phase(0, plain, memory, "allgather")], 1, info, grad) is None
    # a lossy phase, then its residual flushed for one step, then plain
    scheduled = [Phase(0, TopK(0.1).scheme, ResidualMemory(), "allgather"),
                 Phase(4, plain, ResidualMemory(), "allgather"), Phase(5, plain, None, "allgather")]
    assert [adapter._handed_over_as_is(scheduled, step, info, grad) for step in range(1, 8)] == (
        [None] * 5 + [scheduled[2]] * 2)


def test_the_velocity_handed_over_is_momentum_sgds():
    """The fused pass leaves in the gradient what momentum SGD steps with
    (``u = m u + g``; Nesterov ``g + m u``) and keeps ``u``."""
    torch = pytest.importorskip("torch")
    from hvd_compress.codecs.providers import TorchCodecs
    from hvd_compress.codecs.torch_fused import fuses
    from hvd_compress.adapters.torch_store import TorchStore
    from hvd_compress.feedback.memory import MOMENTUM, MomentumMemory
    g = torch.arange(6, dtype=torch.float32)
    if not fuses(g):
        pytest.skip("the kernels are off here (HVDC_KERNELS=0 or no compiler): the eager path runs")
    for nesterov in (False, True):
        store = TorchStore()
        codecs, u = TorchCodecs(store), torch.zeros(6)
        memory = MomentumMemory(0.9, nesterov=nesterov, error_feedback=False)
        for step in range(3):
            grad = g + step
            want_u = 0.9 * u + grad
            want = grad + 0.9 * want_u if nesterov else want_u
            codecs.fused_momentum(memory, "w", 6, grad, store.workspace("w"), grad)
            torch.testing.assert_close(grad, want)
            u = store.get_memory(MOMENTUM, "w", 6, grad)
            torch.testing.assert_close(u, want_u)
