"""Real architectures for ``hvd-compress bench models``, as Horovod's synthetic
benchmarks run them: a ResNet-50, a MobileNetV2, a BERT-base-like encoder and
a GPT-2-small-like decoder, in PyTorch (defined here: torchvision from the
registry pulls a CUDA torch) and in TensorFlow (``tf.keras.applications`` for
the two CNNs, defined here for the two transformers).

``size="full"`` is the published shape (ResNet-50 25.6M parameters at 224x224,
MobileNetV2 3.5M, BERT-base 12 layers of 768 over a 30522-token vocabulary,
GPT-2 small 12 layers of 768 over 50257 tokens, sequences of 128);
``size="tiny"`` keeps each architecture's kinds of layers at a fraction of
the width and depth (32x32 images, sequences of 16), for a smoke test.

Every builder returns ``(model, batch(n, seed) -> (inputs, targets), loss)``.
"""
from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("resnet50", "mobilenetv2", "bert", "gpt2")
SIZES = ("full", "tiny")


@dataclass(frozen=True)
class TextShape:
    """A transformer's shape: layers, width, heads, vocabulary, sequence."""
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int


TEXT = {("bert", "full"): TextShape(12, 768, 12, 30522, 128), ("gpt2", "full"): TextShape(12, 768, 12, 50257, 128),
        ("bert", "tiny"): TextShape(2, 64, 2, 1000, 16), ("gpt2", "tiny"): TextShape(2, 64, 2, 1000, 16)}
#: (image side, classes, ResNet blocks per stage, ResNet base width, MobileNetV2 width multiplier)
IMAGES = {"full": (224, 1000, (3, 4, 6, 3), 64, 1.0), "tiny": (32, 10, (1, 1, 1, 1), 8, 0.25)}
#: MobileNetV2's inverted-residual stages: expansion, channels, repeats, first stride (Sandler et al., 2018)
MOBILENET_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                    (6, 320, 1, 1))


def check(arch, size):
    if arch not in ARCHITECTURES:
        raise ValueError(f"model must be one of {ARCHITECTURES}; got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}; got {size!r}")


def _channels(c, mult):
    """MobileNetV2's rounding of a channel count to a multiple of 8."""
    v = max(8, int(c * mult + 4) // 8 * 8)
    return v + 8 if v < 0.9 * c * mult else v


# ----------------------------------------------------------------------------- torch
def torch_model(arch, size="full"):
    check(arch, size)
    import torch
    from torch import nn
    if arch in ("bert", "gpt2"):
        shape = TEXT[(arch, size)]
        model = _torch_transformer(shape, causal=arch == "gpt2")

        def batch(n, seed=0):
            g = torch.Generator().manual_seed(seed)
            t = torch.randint(0, shape.vocab, (n, shape.seq + 1), generator=g)
            return t[:, :-1], t[:, 1:]

        def loss(out, y):
            return nn.functional.cross_entropy(out.reshape(-1, shape.vocab), y.reshape(-1))
        return model, batch, loss
    side, classes, blocks, base, mult = IMAGES[size]
    model = _torch_resnet(blocks, base, classes) if arch == "resnet50" else _torch_mobilenet(mult, classes)

    def batch(n, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 3, side, side, generator=g), torch.randint(0, classes, (n,), generator=g)
    return model, batch, nn.functional.cross_entropy


def _torch_resnet(blocks, base, classes):
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = 4 * width
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return (self.body(x) + self.skip(x)).relu()

    layers = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    cin = base
    for stage, count in enumerate(blocks):
        width = base * 2 ** stage
        for i in range(count):
            layers.append(Bottleneck(cin, width, 2 if i == 0 and stage > 0 else 1))
            cin = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def _torch_mobilenet(mult, classes):
    from torch import nn

    def conv(cin, cout, k, stride, groups=1, act=True):
        out = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return out + [nn.ReLU6(inplace=True)] if act else out

    class Inverted(nn.Module):
        def __init__(self, cin, cout, stride, expand):
            super().__init__()
            mid = cin * expand
            body = conv(cin, mid, 1, 1) if expand != 1 else []
            self.body = nn.Sequential(*body, *conv(mid, mid, 3, stride, mid), *conv(mid, cout, 1, 1, act=False))
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    cin = _channels(32, mult)
    layers = conv(3, cin, 3, 2)
    for expand, c, repeats, stride in MOBILENET_STAGES:
        cout = _channels(c, mult)
        for i in range(repeats):
            layers.append(Inverted(cin, cout, stride if i == 0 else 1, expand))
            cin = cout
    last = _channels(1280, max(1.0, mult))
    return nn.Sequential(*layers, *conv(cin, last, 1, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(last, classes))


def _torch_transformer(shape, causal):
    import torch
    from torch import nn

    class Encoder(nn.Module):
        """BERT-like (post-norm, GELU) or GPT-2-like (pre-norm, causal, tied output)."""

        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(shape.vocab, shape.width)
            self.positions = nn.Embedding(shape.seq, shape.width)
            layer = nn.TransformerEncoderLayer(shape.width, shape.heads, 4 * shape.width, dropout=0.0,
                                               activation="gelu", batch_first=True, norm_first=causal)
            self.blocks = nn.TransformerEncoder(layer, shape.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(shape.width)
            self.head = None if causal else nn.Linear(shape.width, shape.vocab)

        def forward(self, tokens):
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1]) if causal else None
            h = self.norm(self.blocks(self.tokens(tokens) + self.positions(pos), mask=mask, is_causal=causal))
            return h @ self.tokens.weight.t() if causal else self.head(h)
    return Encoder()


# ----------------------------------------------------------------------------- TensorFlow
def tf_model(arch, size="full"):
    check(arch, size)
    import tensorflow as tf
    keras = tf.keras
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if arch in ("bert", "gpt2"):
        shape = TEXT[(arch, size)]
        model = _tf_transformer(shape, causal=arch == "gpt2")

        def batch(n, seed=0):
            g = tf.random.Generator.from_seed(seed)
            t = g.uniform((n, shape.seq + 1), 0, shape.vocab, dtype=tf.int64)
            return tf.cast(t[:, :-1], tf.int32), t[:, 1:]
        return model, batch, loss
    side, classes, _, _, mult = IMAGES[size]
    app = keras.applications.ResNet50 if arch == "resnet50" else keras.applications.MobileNetV2
    kwargs = {} if arch == "resnet50" else {"alpha": mult}
    model = app(weights=None, input_shape=(side, side, 3), classes=classes, classifier_activation=None, **kwargs)

    def batch(n, seed=0):
        g = tf.random.Generator.from_seed(seed)
        return g.normal((n, side, side, 3)), g.uniform((n,), 0, classes, dtype=tf.int64)
    return model, batch, loss


def _tf_transformer(shape, causal):
    import tensorflow as tf
    keras = tf.keras
    tokens = keras.Input((shape.seq,), dtype="int32")
    embed = keras.layers.Embedding(shape.vocab, shape.width)
    x = embed(tokens) + keras.layers.Embedding(shape.seq, shape.width)(tf.range(shape.seq))
    for _ in range(shape.layers):
        y = keras.layers.LayerNormalization()(x) if causal else x
        y = keras.layers.MultiHeadAttention(shape.heads, shape.width // shape.heads)(y, y, use_causal_mask=causal)
        x = x + y if causal else keras.layers.LayerNormalization()(x + y)
        y = keras.layers.LayerNormalization()(x) if causal else x
        y = keras.layers.Dense(shape.width)(keras.layers.Dense(4 * shape.width, activation="gelu")(y))
        x = x + y if causal else keras.layers.LayerNormalization()(x + y)
    x = keras.layers.LayerNormalization()(x)
    out = keras.layers.Dense(shape.vocab)(x)
    return keras.Model(tokens, out)
