"""hvd_compress.elastic's bookkeeping on emulated ranks (tests/unit/in_process_world.py):
folding two-phase stage-2 residuals back before the world changes keeps the
conservation law among the survivors, the departed rank's mass is what it held,
and step counters round-trip.  The real elastic jobs are in tests/testing/test_elastic_jobs.py."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.elastic import departed_mass
from hvd_compress.adapters.param_state import OWNED_CHUNK_SUFFIX
from hvd_compress.adapters.torch_adapter import folded_residual
from hvd_compress.transports import TwoRoundPending
from in_process_world import InProcessAdapter, World


def _grad(rank_id, step, numel):
    rng = np.random.default_rng(1000 * rank_id + step)
    return rng.standard_normal(numel).astype(np.float32)


def _steps(comps, adapters, world, ids, step0, steps, numel, grad_sum):
    """``steps`` exchanges (op Sum: the placeholder is reduced to ``size``) on
    the ranks ``comps``; returns the sum of what was applied, in float64."""
    applied = np.zeros(numel)
    for step in range(step0, step0 + steps):
        world.posted.clear()
        grads = [_grad(i, step, numel) for i in ids]
        for i, g in zip(ids, grads):
            grad_sum[i] = grad_sum.get(i, 0) + g.astype(np.float64)
        started = [comp.compress(torch.from_numpy(g.copy())) for comp, g in zip(comps, grads)]
        for adapter, (_, pending) in zip(adapters, started):
            if isinstance(pending, TwoRoundPending):
                adapter.roles.rounds.launch(pending)
        got = [comp.decompress(torch.full((1,), float(world.size)), pending)
               for comp, (_, pending) in zip(comps, started)]
        for g in got[1:]:
            assert g.numpy().tobytes() == got[0].numpy().tobytes(), "replicas differ"
        applied += got[0].numpy().astype(np.float64)
    return applied


def _folded(adapter, rank, size):
    state = adapter.roles.store.params["w"]
    return folded_residual(state.residual, state.owned_chunk_residual, rank, size).numpy().astype(np.float64)


@pytest.mark.parametrize("make", [lambda: hvd_compress.Int8(transport="two_phase"),
                                  lambda: hvd_compress.TopK(0.2, transport="two_phase")],
                         ids=["Int8", "TopK"])
@pytest.mark.parametrize("numel", [10, 37])
def test_fold_keeps_conservation_when_a_rank_leaves_and_one_joins(make, numel):
    """3 ranks, rank 2 leaves (2 ranks), a new one joins (3 ranks): sum(applied) +
    survivors' residuals + the departed rank's residual == sum(gradients), with
    chunks cut for 3, then 2, then 3 ranks."""
    grad_sum = {}
    world = World(3)
    comps = [make() for _ in range(3)]
    adapters = [InProcessAdapter(world, r) for r in range(3)]
    for comp, adapter in zip(comps, adapters):
        comp.use_adapter("torch", adapter)
    applied = _steps(comps, adapters, world, [0, 1, 2], 0, 4, numel, grad_sum)
    assert all(a.roles.store.params["w"].owned_chunk_residual is not None for a in adapters)
    # the departed rank's residual at the change, folded as its mass was reported
    departed = _folded(adapters[2], 2, 3)
    tensors, sumsq = adapters[2].residual_mass(2, 3)
    assert tensors == 1 and math.isclose(sumsq, float(np.square(departed).sum()), rel_tol=1e-6)

    # the change: the survivors fold with the old layout, then run in a world of 2
    for rank in (0, 1):
        before = _folded(adapters[rank], rank, 3)
        adapters[rank].fold_owned_chunks(rank, 3)
        adapters[rank].forget_in_flight()
        assert adapters[rank].roles.store.params["w"].owned_chunk_residual is None
        np.testing.assert_array_equal(adapters[rank].roles.store.params["w"].residual.numpy().astype(np.float64), before)
    world2 = World(2)
    for rank in (0, 1):
        adapters[rank].world, adapters[rank].rank = world2, rank
    applied += _steps(comps[:2], adapters[:2], world2, [0, 1], 4, 3, numel, grad_sum)

    # a new rank joins with nothing kept; the survivors fold their 2-rank chunks
    for rank in (0, 1):
        adapters[rank].fold_owned_chunks(rank, 2)
    world3 = World(3)
    joiner = make()
    joiner.use_adapter("torch", InProcessAdapter(world3, 2))
    for rank in (0, 1):
        adapters[rank].world = world3
    members = [comps[0], comps[1], joiner]
    member_adapters = [c.adapters["torch"] for c in members]
    applied += _steps(members, member_adapters, world3, [0, 1, 3], 7, 3, numel, grad_sum)

    kept = sum(_folded(a, r, 3) for r, a in enumerate(member_adapters))
    total = sum(grad_sum.values())
    np.testing.assert_allclose(applied + kept + departed, total, rtol=0, atol=1e-4)
    # and the departed rank's residual is not nothing: the check above can fail without it
    assert np.abs(departed).max() > 1e-3


def test_fold_is_needed_a_new_chunk_size_would_otherwise_drop_the_owned_residual():
    """Without the fold, the 2-rank world's chunk (5 elements of 10, was 4 at 3
    ranks) does not fit the owned residual; folding refuses a layout it does not
    match instead of dropping the mass."""
    residual, owned = torch.zeros(10), torch.ones(4)
    np.testing.assert_array_equal(folded_residual(residual, owned, 1, 3).numpy(),
                                  [0, 0, 0, 0, 1, 1, 1, 1, 0, 0])
    # the last owner's chunk is zero-padded: only its first 2 elements are in the tensor
    np.testing.assert_array_equal(folded_residual(residual, owned, 2, 3).numpy(), [0] * 8 + [1, 1])
    with pytest.raises(RuntimeError, match="cannot be folded back"):
        folded_residual(residual, owned, 0, 2)


def test_residual_mass_counts_nonzero_residuals_and_owned_chunks():
    world = World(2)
    comp = hvd_compress.TopK(0.2, transport="two_phase")
    adapter = InProcessAdapter(world, 0)
    comp.use_adapter("torch", adapter)
    adapter.roles.store.params.of("a").residual = torch.tensor([3.0, 0.0, 0.0, 0.0])
    adapter.roles.store.params.of("a").owned_chunk_residual = torch.tensor([0.0, 4.0])
    adapter.roles.store.params.of("b").residual = torch.zeros(3)
    tensors, sumsq = adapter.residual_mass(0, 2)
    assert tensors == 1 and sumsq == pytest.approx(25.0)
    assert set(adapter.residuals) == {"a", "a" + OWNED_CHUNK_SUFFIX, "b"}


def test_departed_mass_counts_only_processes_that_left():
    before = {"h:1": (2, 4.0), "h:2": (3, 9.0), "h:3": (1, 16.0)}
    assert departed_mass(before, ["h:1", "h:3", "h:9"]) == (1, 3, 9.0)
    assert departed_mass(before, ["h:3", "h:2", "h:1"]) == (0, 0, 0.0)
    assert departed_mass(before, []) == (3, 6, 29.0)


def test_step_counts_round_trip_and_absent_keys_restart():
    adapter = InProcessAdapter(World(1), 0)
    adapter.roles.store.next_step("a"), adapter.roles.store.next_step("a"), adapter.roles.store.next_step("b")
    assert adapter.step_counts() == {"a": 2, "b": 1}
    adapter.set_step_counts({"a": 7, "c": 3})
    assert adapter.step_counts() == {"a": 7, "c": 3}


def test_tf_adapter_folds_the_owned_chunk_and_drops_its_variable():
    """TensorFlow: the stage-2 residual variable is added into the stage-1 one
    and removed, so the next trace makes one of the new chunk size."""
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.adapters.param_state import OWNED_CHUNK_RESIDUAL, RESIDUAL
    from hvd_compress.adapters.tf_adapter import TFAdapter, fold_into
    adapter = TFAdapter()
    adapter.roles.store.memory_variable(RESIDUAL, "w", lambda: tf.constant([1.0, 0, 0, 0, 0]))
    adapter.roles.store.memory_variable(OWNED_CHUNK_RESIDUAL, "w", lambda: tf.constant([2.0, 3.0]))
    tensors, sumsq = adapter.residual_mass(1, 3)  # chunks of 2: rank 1 owns elements 2 and 3
    assert tensors == 1 and sumsq == pytest.approx(1 + 4 + 9)
    adapter.fold_owned_chunks(1, 3)
    np.testing.assert_array_equal(adapter.residuals["w"].numpy(), [1, 0, 2, 3, 0])
    assert set(adapter.residuals) == {"w"} and adapter.roles.store.params["w"].owned_chunk_residual is None
    with pytest.raises(RuntimeError, match="cannot be folded back"):
        fold_into(np.zeros(5), np.ones(2), 0, 2)
    adapter.roles.store.next_step("w")
    adapter.set_step_counts({"w": 5, "v": 2})
    assert adapter.step_counts() == {"w": 5, "v": 2}


def test_import_hvd_compress_makes_elastic_available_without_a_framework():
    """README's line ``hvd_compress.elastic.register(state, compression)`` after ``import
    hvd_compress``, and the import stays light: neither TensorFlow nor torch is imported."""
    code = ("import sys, hvd_compress; assert callable(hvd_compress.elastic.register); "
            "import hvd_compress.elastic as e; assert e is hvd_compress.elastic; "
            "print(sorted(m for m in ('tensorflow', 'torch', 'horovod') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(hvd_compress.__file__).parents[1])})
    assert out.stdout.strip() == "[]", out


README_SETUP = """
import torch
import horovod.torch as hvd
hvd.init()
model = torch.nn.Linear(8, 2)
compression = __import__("hvd_compress").TopK(0.25)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression=compression)
"""
README_CHECK = """
model(torch.ones(4, 8)).sum().backward()
optimizer.step()
state.commit()
assert compression._elastic is not None and compression._elastic.state is state
print("README_ELASTIC_OK")
"""


def test_readme_elastic_lines_run_as_written():
    """README's elastic block, exactly as written, after a model, a Horovod optimizer and its
    compression (one process, hvd.init()); then a step and a commit."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Elastic training", 1)[1].split("\n## ", 1)[0]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "hvd_compress.elastic.register(state, compression)" in block
    out = subprocess.run([sys.executable, "-c", README_SETUP + block + README_CHECK], capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(hvd_compress.__file__).parents[1])})
    assert "README_ELASTIC_OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


#: Horovod's ``tensorflow2_keras_mnist_elastic.py`` in miniature (a smaller model and dataset), with the
#: three lines docs/guide/elastic.md changes: the import, the optimizer's compression, register
GUIDE_KERAS_SCRIPT = """
import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd
import hvd_compress
hvd.init()
model = tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(10, activation="softmax")])
opt = tf.optimizers.Adam(0.001 * hvd.size())
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True, compression=hvd_compress.TopK(0.01))
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"],
              experimental_run_tf_function=False)
images = np.ones((8, 28, 28, 1), np.float32)
dataset = tf.data.Dataset.from_tensor_slices((images, np.zeros(8, np.int64))).repeat().batch(4)
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
hvd_compress.elastic.register(state)
state.commit()  # ElasticNotRegistered if the compressor of the step before the state were not adopted
assert hvd_compress.elastic.unregistered_in_use() == []
print("GUIDE_KERAS_OK")
"""


def test_guide_keras_lines_run_as_written():
    """docs/guide/elastic.md's three lines for Horovod's Keras MNIST example, in that example's
    shape (one process, HOROVOD_ELASTIC=1 so that the optimizer compresses at one rank): the
    step before the state uses the compressor, ``register(state)`` adopts it, a commit passes."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "elastic.md").read_text()
    block = guide.split("TensorFlow 2 Keras (`tensorflow2_keras_mnist_elastic.py`)", 1)[1]
    block = block.split("```python\n", 1)[1].split("```", 1)[0]
    assert [line.strip() for line in block.splitlines()] == [
        "import hvd_compress",
        "opt, backward_passes_per_step=1, average_aggregated_gradients=True, compression=hvd_compress.TopK(0.01))",
        "hvd_compress.elastic.register(state)"]
    assert all(line.strip() in GUIDE_KERAS_SCRIPT for line in block.splitlines())
    env = {**os.environ, "PYTHONPATH": str(Path(hvd_compress.__file__).parents[1]), "HOROVOD_ELASTIC": "1",
           "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", GUIDE_KERAS_SCRIPT], capture_output=True, text=True,
                         timeout=300, env=env)
    assert "GUIDE_KERAS_OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]

def _one_rank_step(comp, step):
    """One exchange of a compressor on a one-rank in-process world (op Sum)."""
    world = comp.adapters["torch"].world
    world.posted.clear()
    _, pending = comp.compress(torch.from_numpy(_grad(0, step, 20)))
    return comp.decompress(torch.full((1,), float(world.size)), pending)


def _one_rank_torch_state():
    """Horovod's TorchState, its broadcast (needed by commit) the identity of one rank."""
    from horovod.torch.elastic import TorchState
    state = TorchState(model=torch.nn.Linear(2, 1), step=0)
    state._bcast_object = lambda obj: obj
    return state


@pytest.fixture
def one_rank_elastic(monkeypatch):
    """HOROVOD_ELASTIC=1, a one-rank world for the handler's own collectives, and no
    compressor of another test among those used in this process."""
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.setattr(hvd_compress.elastic, "_USED", weakref.WeakSet())
    monkeypatch.setattr(hvd_compress.elastic._HorovodOps, "rank_and_size", lambda self: (0, 1))
    monkeypatch.setattr(hvd_compress.elastic._HorovodOps, "allgather_object", lambda self, obj, name: [obj])


def test_a_compressor_used_before_register_is_adopted(one_rank_elastic):
    """Horovod's TF2 example runs a step before its state exists: register(state) then takes
    that compressor's residual as the state's, so a restore before any commit returns to it."""
    comp = hvd_compress.TopK(0.2)
    comp._adapters["torch"] = InProcessAdapter(World(1), 0)
    _one_rank_step(comp, 0)
    adopted = comp.adapters["torch"].roles.store.params["w"].residual.clone()
    assert adopted.abs().sum() > 0
    state = _one_rank_torch_state()
    handlers = hvd_compress.elastic.register(state)
    assert [h.compression for h in handlers] == [comp]
    _one_rank_step(comp, 1)
    assert not torch.equal(comp.adapters["torch"].roles.store.params["w"].residual, adopted)
    state.restore()
    assert torch.equal(comp.adapters["torch"].roles.store.params["w"].residual, adopted)
    state.commit()  # registered: no refusal


def test_a_commit_or_reset_with_an_unregistered_compressor_in_use_is_refused(one_rank_elastic):
    """Compressing is allowed before register; a commit or a reset is not, and the message
    names the call to add."""
    from hvd_compress.compressor import ElasticNotRegistered
    comp = hvd_compress.TopK(0.2)
    comp._adapters["torch"] = InProcessAdapter(World(1), 0)
    _one_rank_step(comp, 0)
    state = _one_rank_torch_state()
    with pytest.raises(ElasticNotRegistered, match=r"state\.commit\(\).*hvd_compress\.elastic\.register\(state, "
                                                   r"compression\)"):
        state.commit()
    with pytest.raises(ElasticNotRegistered, match=r"membership change.*hvd_compress\.elastic\.register"):
        state.on_reset()
    hvd_compress.elastic.register(state, comp)
    state.commit()


def test_register_without_a_compressor_needs_one_used_already(one_rank_elastic):
    state = _one_rank_torch_state()
    with pytest.raises(ValueError, match=r"no hvd_compress compressor has compressed a tensor.*"
                                         r"register\(state, compression\)"):
        hvd_compress.elastic.register(state)


def test_forget_in_flight_makes_the_fingerprint_agreed_again():
    adapter = InProcessAdapter(World(2), 0)
    adapter._fingerprint_checked, adapter.roles.rounds.waiting = True, ["x"]
    adapter.forget_in_flight()
    assert adapter._fingerprint_checked is False and adapter.roles.rounds.waiting == []


def test_auto_replans_after_a_reset_and_keeps_its_residuals():
    auto = hvd_compress.Auto()
    adapter = InProcessAdapter(World(2), 0)
    auto._adapters["torch"] = adapter
    adapter.roles.store.params.of("w").residual = torch.ones(4)
    auto.plan_state.history = [(5, {}, 0)]
    auto.plan_state.tensors = {"w": (4, (4,))}
    auto.replan_after_reset()
    assert auto.plan_state.history == [] and auto.plan_state.tensors == {} and auto.plan_state.early_link is None
    assert torch.equal(adapter.roles.store.params["w"].residual, torch.ones(4))


def test_auto_with_a_tensorflow_state_is_refused_naming_what_is_allowed():
    """TensorFlow Auto keeps its plan in the traced step: register() refuses it at once
    (not at the first reset) and names the fixed schemes that work with a Keras state."""
    tf = pytest.importorskip("tensorflow")
    hvd_elastic = pytest.importorskip("horovod.tensorflow.elastic")
    model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
    state = hvd_elastic.TensorFlowKerasState(model, optimizer=tf.keras.optimizers.SGD(0.1), epoch=0)
    with pytest.raises(ValueError, match=r"Auto under elastic Horovod is supported in PyTorch only.*TopK\(0\.01\)"):
        hvd_compress.elastic.register(state, hvd_compress.Auto())
