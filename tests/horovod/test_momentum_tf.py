"""Momentum-aware error feedback (hvd_compress.MomentumMemory) through the stock
Horovod TensorFlow 2 APIs under horovodrun, and the recipe warnings.

* ``DistributedGradientTape``: ``NoCompression(momentum=0.9)`` with Keras
  ``SGD(momentum=0)`` trains like Horovod's dense ``SGD(momentum=0.9)``;
  ``EFSignSGD(momentum=0.9)`` keeps a velocity per variable, and
  ``tf.train.Checkpoint(hvdc=compressor.tf_checkpointable())`` restored before the
  first trace resumes bit-identically (velocity and residual included).
* Keras ``DistributedOptimizer``: the optimizer's ``momentum`` is visible, so
  EFSignSGD with error feedback under ``SGD(momentum=0.9)`` warns once, and the
  recommended placement trains without a warning.
* ``DistributedGradientTape`` never sees the optimizer: nothing is warned there
  (documented in docs/guide/schemes.md).
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tempfile  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvdk  # noqa: E402
from tf_linear_training import mlp, mse_tape_step  # noqa: E402

import hvd_compress as hc  # noqa: E402
from hvd_compress.feedback.momentum_check import RecipeWarning  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
f32 = np.float32


def _dataset():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((96 * SIZE, 12)).astype(f32)
    y = np.tanh(x @ rng.standard_normal((12, 1)).astype(f32)).astype(f32)
    return x, y


X, Y = _dataset()
SPEC_X, SPEC_Y = tf.TensorSpec([16, 12], tf.float32), tf.TensorSpec([16, 1], tf.float32)


class TapeRun:
    def __init__(self, comp, momentum, seed=1, prefix="mt_"):
        self.model = mlp(seed, prefix, hidden=16)
        hvd.broadcast_variables(self.model.variables, root_rank=0)
        self.opt = tf.keras.optimizers.SGD(learning_rate=0.05, momentum=momentum)
        self.comp = comp
        self.step_fn = mse_tape_step(self.model, self.opt, comp, input_signature=[SPEC_X, SPEC_Y])

    def train(self, steps, first=0):
        losses = []
        for step in range(first, first + steps):
            lo = RANK * 96 + (step % 6) * 16
            losses.append(float(self.step_fn(tf.constant(X[lo:lo + 16]), tf.constant(Y[lo:lo + 16]))))
        return losses

    def weights(self):
        return [v.numpy().copy() for v in self.model.trainable_variables]

    def checkpoint(self):
        return tf.train.Checkpoint(model=self.model, optimizer=self.opt, hvdc=self.comp.tf_checkpointable())


def test_tape_lossless_momentum_in_the_compressor_is_momentum_sgd():
    dense = TapeRun(hvd.Compression.none, momentum=0.9, prefix="ml_")
    dense.train(6)
    moved = TapeRun(hc.NoCompression(momentum=0.9), momentum=0.0, prefix="ml_")
    moved.train(6)
    for a, b in zip(dense.weights(), moved.weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert set(moved.comp.adapters["tensorflow"].memories["momentum"]) == {
        "ml_fc1/kernel:0", "ml_fc1/bias:0", "ml_out/kernel:0", "ml_out/bias:0"}


def test_tape_velocity_checkpoint_restored_before_the_first_trace_is_bit_identical():
    make = lambda: hc.EFSignSGD(momentum=0.9, nesterov=True)  # noqa: E731
    straight = TapeRun(make(), momentum=0.0)
    straight.train(3)
    path = straight.checkpoint().save(os.path.join(tempfile.mkdtemp(prefix=f"hvdc_mt_rank{RANK}_"), "ckpt"))
    state = {k: np.array(v, copy=True) for k, v in straight.comp.state_dict()["tensorflow"].items()}
    straight.train(3, first=3)

    fresh = TapeRun(make(), momentum=0.0, seed=2)
    fresh.checkpoint().restore(path)  # before the first trace: the usual order in a training script
    fresh.train(3, first=3)
    forgetful = TapeRun(make(), momentum=0.0, seed=2)  # control: the compressor's state left out
    tf.train.Checkpoint(model=forgetful.model, optimizer=forgetful.opt).restore(path).expect_partial()
    forgetful.train(3, first=3)

    assert {k for k in state if k.startswith("memory/momentum/")} == {
        "memory/momentum/mt_fc1/kernel:0", "memory/momentum/mt_fc1/bias:0", "memory/momentum/mt_out/kernel:0",
        "memory/momentum/mt_out/bias:0"}, sorted(state)
    assert all(np.abs(v).sum() > 0 for k, v in state.items() if k.startswith("memory/"))
    # (a 1-element tensor is sent exactly by EF-sign, so not every residual is non-zero)
    assert any(np.abs(v).sum() > 0 for k, v in state.items() if k.startswith("residual/"))
    assert all(np.array_equal(a, b) for a, b in zip(fresh.weights(), straight.weights())), \
        "resumed weights differ from the uninterrupted run"
    assert not all(np.array_equal(a, b) for a, b in zip(forgetful.weights(), straight.weights())), \
        "the run without the compressor state is identical -- the test would not catch a lost state"


def _keras_fit(comp, momentum, prefix):
    model = mlp(3, prefix, hidden=16)
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=0.05, momentum=momentum),
                                    compression=comp)
    model.compile(optimizer=opt, loss="mse")
    mine = slice(RANK * 96, (RANK + 1) * 96)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = model.fit(X[mine], Y[mine], batch_size=16, epochs=4, shuffle=False, verbose=0,
                         callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    return hist.history["loss"], [str(w.message) for w in caught if issubclass(w.category, RecipeWarning)]


def test_keras_sign_scheme_under_sgd_momentum_warns_once():
    _, got = _keras_fit(hc.EFSignSGD(), momentum=0.9, prefix="kw_")
    assert len(got) == 1, got
    assert "EFSignSGD" in got[0] and "momentum 0.9" in got[0] and "hvd_compress.EFSignSGD(..., momentum=0.9)" in got[0]


def test_keras_momentum_in_the_compressor_trains_without_warning():
    losses, got = _keras_fit(hc.EFSignSGD(momentum=0.9), momentum=0.0, prefix="kok_")
    assert got == []
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


@pytest.mark.parametrize("momentum", [0.9])
def test_tape_cannot_see_the_optimizer_so_nothing_is_warned(momentum):
    run = TapeRun(hc.EFSignSGD(), momentum=momentum, prefix="tw_")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train(2)
    assert [w for w in caught if issubclass(w.category, RecipeWarning)] == []
