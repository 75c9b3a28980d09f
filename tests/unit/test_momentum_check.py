"""Unit tests of the recipe warnings (:mod:`hvd_compress.feedback.momentum_check`): which
compressor / optimizer-momentum pairs warn and what the message says, QSGD with
error feedback at construction, and the readers of the optimizer's momentum.
The warnings raised from a real Horovod optimizer's frame are tested under
horovodrun in tests/horovod/test_momentum_{torch,tf}.py."""
import warnings

import pytest

import hvd_compress as hc
from hvd_compress.feedback.momentum_check import RecipeWarning, check_construction, leaf_compressors, momentum_problems


@pytest.mark.parametrize("make, name", [
    (hc.EFSignSGD, "EFSignSGD"), (hc.OneBit, "OneBit"), (lambda: hc.RandomK(0.01), "RandomK"),
    (lambda: hc.SignSGD(error_feedback=True), "SignSGD"),
])
def test_large_residual_schemes_with_error_feedback_under_momentum(make, name):
    (msg,) = momentum_problems(make(), "SGD", 0.9)
    assert name in msg and "momentum 0.9" in msg and "1/(1-0.9) = 10" in msg
    assert f"hvd_compress.{name}(..., momentum=0.9)" in msg and "optimizer's momentum to 0" in msg


@pytest.mark.parametrize("make, momentum", [
    (hc.EFSignSGD, 0.0),                                 # no optimizer momentum
    (lambda: hc.EFSignSGD(error_feedback=False), 0.9),   # nothing released late
    (hc.SignSGD, 0.9),                                   # majority vote, no error feedback by default
    (lambda: hc.TopK(0.01), 0.9),                        # small residual: measured to train
    (hc.Int8, 0.9), (hc.FP16, 0.9), (lambda: hc.PowerSGD(2), 0.9),
    (lambda: hc.EFSignSGD(momentum=0.9), 0.0),           # the recommended placement
    (lambda: hc.DGC(0.01, momentum=0.9), 0.0),
])
def test_no_warning_where_the_recipe_trains(make, momentum):
    assert momentum_problems(make(), "SGD", momentum) == []


@pytest.mark.parametrize("make", [lambda: hc.TopK(0.01, momentum=0.9), lambda: hc.DGC(0.01, momentum=0.9),
                                  lambda: hc.RandomK(0.01, momentum=0.5)])
def test_momentum_twice_warns_for_any_scheme(make):
    (msg,) = momentum_problems(make(), "Adam", 0.9)
    assert "compounds" in msg and "Adam" in msg and "momentum to 0" in msg


def test_policy_and_schedule_warn_once_per_offending_scheme():
    pol = hc.Policy([hc.Rule(hc.RandomK(0.01), min_ndim=2), hc.Rule(hc.RandomK(0.1), name="*emb*"),
                     hc.Rule(hc.Schedule([(0, hc.none()), (5, hc.OneBit())]), name="*x*")], default=hc.TopK(0.01))
    assert [c.scheme.name for c in leaf_compressors(pol)] == ["RandomK", "RandomK", "NoCompression", "OneBit", "TopK"]
    msgs = momentum_problems(pol, "SGD", 0.9)
    assert len(msgs) == 2 and "RandomK" in msgs[0] and "OneBit" in msgs[1], msgs


def test_qsgd_with_error_feedback_warns_at_construction():
    with pytest.warns(RecipeWarning, match="QSGD with error feedback on.*contractive"):
        hc.QSGD(error_feedback=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeWarning)
        hc.QSGD()                                   # its default: no error feedback
        hc.QSGD(momentum=0.9)                       # momentum without error feedback
        hc.TopK(0.01, values=hc.QSGD().scheme)      # quantized Top-K values: Top-K's residual
        check_construction(hc.Int8())


def test_torch_optimizer_momentum_reader():
    compat = pytest.importorskip("hvd_compress.integration.horovod_internals")
    torch = pytest.importorskip("torch")
    p = [torch.nn.Parameter(torch.zeros(2))]
    read = lambda opt: compat.TorchCaller(opt, None).optimizer_momentum()  # noqa: E731
    assert read(torch.optim.SGD(p, lr=0.1, momentum=0.9)) == pytest.approx(0.9)
    assert read(torch.optim.SGD(p, lr=0.1)) == 0.0
    assert read(torch.optim.Adam(p, betas=(0.8, 0.999))) == pytest.approx(0.8)
    two_groups = torch.optim.SGD([{"params": p, "momentum": 0.5}, {"params": [torch.nn.Parameter(torch.zeros(1))]}],
                                 lr=0.1, momentum=0.0)
    assert read(two_groups) == pytest.approx(0.5)  # the largest over parameter groups


def test_keras_optimizer_momentum_reader():
    compat = pytest.importorskip("hvd_compress.integration.horovod_internals")
    tf = pytest.importorskip("tensorflow")
    assert compat.keras_optimizer_momentum(tf.keras.optimizers.SGD(0.1, momentum=0.9)) == pytest.approx(0.9)
    assert compat.keras_optimizer_momentum(tf.keras.optimizers.SGD(0.1)) == 0.0
    assert compat.keras_optimizer_momentum(tf.keras.optimizers.Adam(beta_1=0.85)) == pytest.approx(0.85)
