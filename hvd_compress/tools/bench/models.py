"""Communication-bound models of a chosen parameter count, for ``bench e2e``.

* ``mlp``: ``d_in -> H -> ... -> H -> classes`` (ReLU), ``H`` solved so that
  the parameter count is as close as possible to the request.  Most of the
  bytes sit in one or two large matrices, so the model is bound by the link
  and cheap to compute (a forward+backward is ~6 * params * batch flops).
* ``transformer``: token embedding, ``layers`` pre-norm encoder blocks
  (``heads`` heads, feed-forward 4*d) and an output projection, ``d`` solved
  from the parameter count.

Both exist for torch and for TensorFlow (tf.keras).  The builders return the
model and a ``batch(batch_size, seed)`` function giving synthetic inputs and
targets.
"""
from __future__ import annotations

import math


def mlp_width(params: int, d_in: int = 1024, classes: int = 10, hidden_layers: int = 2) -> int:
    """Hidden width H with d_in*H + H + (L-1)*(H*H + H) + H*classes + classes ~= params."""
    a = hidden_layers - 1
    b = d_in + 1 + (hidden_layers - 1) + classes
    c = classes - params
    if a == 0:
        return max(1, int(round(-c / b)))
    return max(1, int(round((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a))))


def mlp_layer_numels(params: int, d_in: int = 1024, classes: int = 10, hidden_layers: int = 2):
    h = mlp_width(params, d_in, classes, hidden_layers)
    dims = [d_in] + [h] * hidden_layers + [classes]
    out = []
    for i in range(len(dims) - 1):
        out += [dims[i] * dims[i + 1], dims[i + 1]]
    return out


def transformer_dims(params: int, vocab: int = 8192, layers: int = 2, heads: int = 8):
    """Model width d (a multiple of 8*heads... of heads) for about ``params`` parameters."""
    def count(d):
        block = 4 * d * d + 4 * d + 2 * (4 * d * d) + 4 * d + d + 4 * d
        return vocab * d + layers * block + d * vocab + vocab + 2 * d
    d = heads
    while count(d + heads) <= params:
        d += heads
    if abs(count(d + heads) - params) < abs(count(d) - params):
        d += heads
    return d


# ----------------------------------------------------------------------------- torch
def torch_model(kind: str, params: int, seq: int = 64, vocab: int = 8192, layers: int = 2, heads: int = 8):
    import torch
    from torch import nn

    if kind == "mlp":
        d_in, classes = 1024, 10
        h = mlp_width(params, d_in, classes)
        model = nn.Sequential(nn.Linear(d_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, classes))

        def batch(n, seed=0):
            g = torch.Generator().manual_seed(seed)
            return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out, y)
        return model, batch, loss_fn
    if kind == "transformer":
        d = transformer_dims(params, vocab, layers, heads)

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
                self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, vocab)

            def forward(self, tokens):
                return self.head(self.norm(self.enc(self.emb(tokens))))

        model = LM()

        def batch(n, seed=0):
            g = torch.Generator().manual_seed(seed)
            t = torch.randint(0, vocab, (n, seq + 1), generator=g)
            return t[:, :-1], t[:, 1:]

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))
        return model, batch, loss_fn
    raise ValueError(f"unknown model {kind!r} (mlp, transformer)")


# ----------------------------------------------------------------------------- TensorFlow
def tf_model(kind: str, params: int, seq: int = 64, vocab: int = 8192, layers: int = 2, heads: int = 8):
    import tensorflow as tf
    keras = tf.keras

    if kind == "mlp":
        d_in, classes = 1024, 10
        h = mlp_width(params, d_in, classes)
        model = keras.Sequential([keras.layers.Dense(h, activation="relu", name="fc1"),
                                  keras.layers.Dense(h, activation="relu", name="fc2"),
                                  keras.layers.Dense(classes, name="out")])
        model.build((None, d_in))

        def batch(n, seed=0):
            g = tf.random.Generator.from_seed(seed)
            return g.normal((n, d_in)), g.uniform((n,), 0, classes, dtype=tf.int64)

        loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return model, batch, loss_obj
    if kind == "transformer":
        d = transformer_dims(params, vocab, layers, heads)
        tokens = keras.Input((seq,), dtype="int32")
        x = keras.layers.Embedding(vocab, d)(tokens)
        for i in range(layers):
            y = keras.layers.LayerNormalization()(x)
            y = keras.layers.MultiHeadAttention(heads, d // heads)(y, y)
            x = x + y
            y = keras.layers.LayerNormalization()(x)
            y = keras.layers.Dense(4 * d, activation="relu")(y)
            x = x + keras.layers.Dense(d)(y)
        out = keras.layers.Dense(vocab)(keras.layers.LayerNormalization()(x))
        model = keras.Model(tokens, out)

        def batch(n, seed=0):
            g = tf.random.Generator.from_seed(seed)
            t = g.uniform((n, seq + 1), 0, vocab, dtype=tf.int64)
            return tf.cast(t[:, :-1], tf.int32), t[:, 1:]

        loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return model, batch, loss_obj
    raise ValueError(f"unknown model {kind!r} (mlp, transformer)")
