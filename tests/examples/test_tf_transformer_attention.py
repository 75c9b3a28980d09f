"""examples/tf2_mnist_gradient_tape.py's transformer attentions (``--attention``), without
Horovod: the torch layout computes torch's ``nn.MultiheadAttention``, and each variant
draws its initial weights at the scale it names (the scale is what docs/results/convergence.md finds
moves dense TF's accuracy on the row transformer)."""
import math
import os
import sys

import numpy as np
import pytest

from hvdc_examples_util import REPO

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # the examples' Keras 2 (tf_keras)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
WIDTH, HEADS = 64, 4


@pytest.fixture(scope="module")
def tf_example():
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import tf2_mnist_gradient_tape
    return tf2_mnist_gradient_tape


def _layer(tf_example, seed, keras_init=False):
    layer = tf_example.TorchLayoutAttention(WIDTH, HEADS, seed, keras_init=keras_init)
    layer.build((None, 28, WIDTH))
    return layer


def test_torch_layout_attention_computes_torchs_multihead_attention(tf_example):
    import torch
    layer = _layer(tf_example, seed=3)
    x = np.random.RandomState(0).randn(2, 28, WIDTH).astype(np.float32)
    bias = np.random.RandomState(1).randn(3 * WIDTH).astype(np.float32)  # zeros would not test the biases
    layer.qkv_bias.assign(bias)
    layer.out_bias.assign(bias[:WIDTH])
    mha = torch.nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.from_numpy(layer.qkv_kernel.numpy().T))
        mha.in_proj_bias.copy_(torch.from_numpy(bias))
        mha.out_proj.weight.copy_(torch.from_numpy(layer.out_kernel.numpy().T))
        mha.out_proj.bias.copy_(torch.from_numpy(bias[:WIDTH]))
        want = mha(*[torch.from_numpy(x)] * 3, need_weights=False)[0].numpy()
    np.testing.assert_allclose(layer(x).numpy(), want, rtol=1e-4, atol=1e-5)


def _bound(w):
    return float(np.abs(np.asarray(w)).max())


def test_torch_init_draws_at_torchs_scale(tf_example):
    import torch
    layer = _layer(tf_example, seed=5)
    qkv, out = math.sqrt(6.0 / (WIDTH + 3 * WIDTH)), 1.0 / math.sqrt(WIDTH)  # xavier, Linear's default
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
    for ours, theirs, limit in ((layer.qkv_kernel, mha.in_proj_weight, qkv), (layer.out_kernel, mha.out_proj.weight,
                                                                               out)):
        assert 0.97 * limit < _bound(ours) <= limit
        assert 0.97 * limit < _bound(theirs.detach()) <= limit
    assert not np.any(layer.qkv_bias.numpy()) and not np.any(layer.out_bias.numpy())


def test_keras_init_draws_at_keras_multihead_attentions_scale(tf_example):
    import tensorflow as tf
    layer = _layer(tf_example, seed=5, keras_init=True)
    keras = tf.keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS,
                                               kernel_initializer=tf.keras.initializers.GlorotUniform(seed=5))
    x = tf.zeros((1, 28, WIDTH))
    keras(x, x)
    kernels = {w.name.split("/")[-2]: w for w in keras.weights if "kernel" in w.name}
    qkv_limit = _bound(layer.qkv_kernel)
    out_limit = _bound(layer.out_kernel)
    for name in ("query", "key", "value"):
        assert abs(_bound(kernels[name]) - qkv_limit) < 0.03 * qkv_limit, name
    assert abs(_bound(kernels["attention_output"]) - out_limit) < 0.03 * out_limit
    # the scale the docs quote: Keras' q/k/v are 2.2x smaller than torch's
    assert 2.1 < math.sqrt(6.0 / (4 * WIDTH)) / qkv_limit < 2.35


@pytest.mark.parametrize("attention", ["keras", "torch", "torch-keras-init"])
def test_every_attention_gives_the_torch_transformers_parameter_count(tf_example, attention):
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import pytorch_mnist
    model = tf_example.build_model("transformer", 0, 1, attention)
    ours = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
    theirs = sum(p.numel() for p in pytorch_mnist.build_model("transformer").parameters())
    assert ours == theirs
    args = tf_example.parse_args(["--model", "transformer", "--attention", attention])
    assert args.attention == attention


def test_the_convergence_script_offers_the_examples_attentions(tf_example):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import convergence
    assert convergence.ATTENTIONS == tuple(tf_example.ATTENTIONS)


def test_an_unknown_attention_is_refused_with_the_choices(tf_example, capsys):
    with pytest.raises(SystemExit):
        tf_example.parse_args(["--attention", "flash"])
    err = capsys.readouterr().err
    assert "--attention" in err and "keras" in err and "torch-keras-init" in err
