"""Real models on real clusters, by the one cost model
(:mod:`hvd_compress.costmodel.model`): the tensors of a few published
architectures, their compute per step on a GPU, and the encode/decode cost of
each scheme on a GPU from its memory traffic.  ``hvd-compress advise --model``
and ``scripts/scale_projection.py`` use these; nothing is downloaded, every
size is written from the architecture.

**Tensors** (one gradient tensor per parameter tensor, as Horovod sees them):

* ``resnet50`` -- He et al., "Deep Residual Learning for Image Recognition",
  CVPR 2016, Table 1 (50-layer: bottleneck stages of 3, 4, 6, 3 blocks,
  widths 64-128-256-512, expansion 4, 1000 classes), with a batch norm
  (weight, bias) after every convolution as in torchvision's ``resnet50``:
  25,557,032 parameters;
* ``resnet101`` / ``vgg16`` -- the same stages with 3, 4, 23, 3 blocks
  (44,549,160), and Simonyan & Zisserman, ICLR 2015, configuration D
  (138,357,544): only for the comparison with Horovod's published scaling;
* ``bert-large`` -- Devlin et al., NAACL 2019: 24 layers, hidden 1024, 16
  heads, feed-forward 4096, vocabulary 30,522, 512 positions, 2 segment
  types, pooler; 335,141,888 parameters (the "340M" of the paper);
* ``gpt-1.3b`` -- Brown et al., "Language Models are Few-Shot Learners",
  2020, Table 2.1, GPT-3 XL: 24 layers, d_model 2048, 16 heads, context 2048,
  vocabulary 50,257 (tied output embedding); 1,315,723,264 parameters.

**Compute per step** (forward + backward on one GPU, the time communication
adds to): ResNet-50 from NVIDIA's published training throughput
(DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5, README,
"Training performance: NVIDIA DGX A100 (8x A100 80GB)": 2470 img/s on 1 GPU,
mixed precision, batch 256 a GPU: 0.104 s a step); the transformers from
``6 x parameters x tokens`` FLOPs (Kaplan et al., 2020) at 40% of an A100's
312 TFLOP/s dense BF16 peak (BERT-large: 32 sequences of 512 tokens a GPU,
GPT 1.3B: 8 sequences of 2048 tokens a GPU).

**Encode/decode on a GPU**: memory-bound kernels, ``passes x 4 bytes x n /
memory bandwidth`` (:func:`gpu_codec_seconds`) at
1.5 TB/s (75% of an A100 80GB's 2.0 TB/s) plus 5 us a kernel launch; the
passes per scheme (reads and writes of an fp32-sized tensor, error feedback
included) are :data:`GPU_PASSES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple


def gpu_codec_seconds(numel, passes, bytes_per_element=4.0, memory_bytes_per_s=2.0e12, launches=0,
                      launch_s=5e-6) -> float:
    """Seconds a memory-bound GPU kernel sequence takes on ``numel`` elements:
    ``passes`` full reads or writes of the fp32 tensor at ``memory_bytes_per_s``
    plus ``launches`` kernel launches.  The projection's assumption for encode
    and decode on GPUs (stated with the passes per scheme in
    ``scripts/scale_projection.py``)."""
    return passes * bytes_per_element * numel / memory_bytes_per_s + launches * launch_s


GPU_MEMORY_BYTES_PER_S = 1.5e12
#: a ring step's latency on the projected GPU clusters
REFERENCE_LATENCY_S = 10e-6
A100_BF16_FLOPS = 312e12
MFU = 0.40


def _bn(prefix, c):
    return [(prefix + ".weight", c, (c,)), (prefix + ".bias", c, (c,))]


def _conv(name, cout, cin, k):
    return (name, cout * cin * k * k, (cout, cin, k, k))


def resnet_layers(blocks=(3, 4, 6, 3), classes=1000) -> List[tuple]:
    """torchvision's ResNet with bottleneck blocks: (name, numel, shape) per tensor."""
    out = [_conv("conv1.weight", 64, 3, 7)] + _bn("bn1", 64)
    inplanes = 64
    for stage, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512)), start=1):
        for b in range(n):
            p = f"layer{stage}.{b}"
            out += [_conv(p + ".conv1.weight", width, inplanes, 1)] + _bn(p + ".bn1", width)
            out += [_conv(p + ".conv2.weight", width, width, 3)] + _bn(p + ".bn2", width)
            out += [_conv(p + ".conv3.weight", 4 * width, width, 1)] + _bn(p + ".bn3", 4 * width)
            if b == 0:
                out += [_conv(p + ".downsample.0.weight", 4 * width, inplanes, 1)] + _bn(p + ".downsample.1", 4 * width)
            inplanes = 4 * width
    return out + _linear("fc", 2048, classes)


def vgg16_layers() -> List[tuple]:
    out, cin = [], 3
    for i, c in enumerate((64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512)):
        out += [_conv(f"conv{i}.weight", c, cin, 3), (f"conv{i}.bias", c, (c,))]
        cin = c
    for i, (a, b) in enumerate(((512 * 7 * 7, 4096), (4096, 4096), (4096, 1000))):
        out += _linear(f"fc{i}", a, b)
    return out


def _linear(name, fan_in, fan_out):
    return [(name + ".weight", fan_in * fan_out, (fan_out, fan_in)), (name + ".bias", fan_out, (fan_out,))]


def bert_layers(layers=24, hidden=1024, ffn=4096, vocab=30522, positions=512, types=2) -> List[tuple]:
    out = [("embeddings.word", vocab * hidden, (vocab, hidden)),
           ("embeddings.position", positions * hidden, (positions, hidden)),
           ("embeddings.token_type", types * hidden, (types, hidden))] + _bn("embeddings.norm", hidden)
    for i in range(layers):
        p = f"encoder.{i}"
        for m in ("query", "key", "value", "output"):
            out += _linear(f"{p}.attention.{m}", hidden, hidden)
        out += _bn(p + ".attention.norm", hidden)
        out += _linear(p + ".intermediate", hidden, ffn) + _linear(p + ".output", ffn, hidden)
        out += _bn(p + ".output.norm", hidden)
    return out + _linear("pooler", hidden, hidden)


def gpt_layers(layers=24, d=2048, vocab=50257, context=2048) -> List[tuple]:
    out = [("wte", vocab * d, (vocab, d)), ("wpe", context * d, (context, d))]
    for i in range(layers):
        p = f"h.{i}"
        out += _bn(p + ".ln_1", d) + _linear(p + ".attn.c_attn", d, 3 * d) + _linear(p + ".attn.c_proj", d, d)
        out += _bn(p + ".ln_2", d) + _linear(p + ".mlp.c_fc", d, 4 * d) + _linear(p + ".mlp.c_proj", 4 * d, d)
    return out + _bn("ln_f", d)


@dataclass(frozen=True)
class Model:
    name: str
    layers: Callable[[], List[tuple]]
    compute_s: float
    compute_source: str

    @property
    def params(self) -> int:
        return sum(layer[1] for layer in self.layers())


def _transformer_step_s(params, tokens):
    return 6.0 * params * tokens / (MFU * A100_BF16_FLOPS)


_BERT_PARAMS = sum(layer[1] for layer in bert_layers())
_GPT_PARAMS = sum(layer[1] for layer in gpt_layers())

MODELS = {
    "resnet50": Model("ResNet-50", resnet_layers, 256 / 2470.0,
                      "NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch, 1x A100 80GB, AMP: 2470 img/s at batch 256"),
    "bert-large": Model("BERT-large", bert_layers, _transformer_step_s(_BERT_PARAMS, 32 * 512),
                        "6 x params x 32 x 512 tokens at 40% of 312 TFLOP/s (A100 BF16)"),
    "gpt-1.3b": Model("GPT-3 XL (1.3B)", gpt_layers, _transformer_step_s(_GPT_PARAMS, 8 * 2048),
                      "6 x params x 8 x 2048 tokens at 40% of 312 TFLOP/s (A100 BF16)"),
}

#: the schemes the projection compares (advise specs); each allgather one also
#: as ``/two_phase``
GPU_SCHEMES = ["none", "hvd_fp16", "Int8", "Int8/two_phase", "TopK(0.01)", "TopK(0.01)/two_phase", "EFSignSGD",
               "PowerSGD(4)"]

#: passes over an fp32-sized tensor per kernel sequence (error feedback
#: included: read gradient and residual, write residual) and kernel launches,
#: as (encode passes, decode passes per payload decoded, launches)
GPU_PASSES = {
    "none": (0.0, 0.0, 0),
    "hvd_fp16": (1.5, 1.5, 2),            # read fp32, write fp16; read fp16, write fp32
    "Int8": (4.25, 2.25, 4),              # EF (3), max-abs (1), write int8 (1/4); read int8, add into fp32 (2)
    "TopK(0.01)": (7.0, 0.05, 6),         # EF (3), radix select (3), write residual (1); scatter-add of 1%
    "EFSignSGD": (4.03, 2.03, 4),         # EF (3), mean-abs (1), pack bits (1/32); unpack, add into fp32 (2)
    "PowerSGD(4)": (7.0, 1.0, 10),        # EF (3), M Q and M^T P (2), P Q^T (1), residual (1); write result
}


def gpu_codec(spec, numel) -> Optional[Tuple[float, float]]:
    """(encode_s, decode_s) of one tensor on a GPU, None for a spec without
    stated passes."""
    passes = GPU_PASSES.get(spec)
    if passes is None:
        return None
    enc, dec, launches = passes
    mem = GPU_MEMORY_BYTES_PER_S
    return (gpu_codec_seconds(numel, enc, memory_bytes_per_s=mem, launches=launches),
            gpu_codec_seconds(numel, dec, memory_bytes_per_s=mem, launches=1 if launches else 0))


def resnet18_cifar_layers(classes=10) -> List[tuple]:
    """ResNet-18 for CIFAR-10 (3x3 stem, no max-pool, basic blocks [2, 2, 2, 2]), as in the
    PowerSGD paper's experiments (Vogels et al., NeurIPS 2019): 11,173,962 parameters."""
    out = [_conv("conv1.weight", 64, 3, 3)] + _bn("bn1", 64)
    inplanes = 64
    for stage, width in enumerate((64, 128, 256, 512), start=1):
        for b in range(2):
            p = f"layer{stage}.{b}"
            out += [_conv(p + ".conv1.weight", width, inplanes, 3)] + _bn(p + ".bn1", width)
            out += [_conv(p + ".conv2.weight", width, width, 3)] + _bn(p + ".bn2", width)
            if inplanes != width:
                out += [_conv(p + ".shortcut.0.weight", width, inplanes, 1)] + _bn(p + ".shortcut.1", width)
            inplanes = width
    return out + _linear("fc", 512, classes)


#: output positions per weight of a ResNet stage (ImageNet at 224: the stem 112 x 112, the
#: stages 56, 28, 14, 7; CIFAR at 32: 32, 16, 8, 4), the FLOPs of a weight's gradient
RESNET_POSITIONS = {"imagenet": {"conv1": 112 ** 2, "layer1": 56 ** 2, "layer2": 28 ** 2, "layer3": 14 ** 2,
                                 "layer4": 7 ** 2},
                    "cifar": {"conv1": 32 ** 2, "layer1": 32 ** 2, "layer2": 16 ** 2, "layer3": 8 ** 2,
                              "layer4": 4 ** 2}}


def backward_weights(layers, resolution=None) -> List[float]:
    """Each tensor's share of the backward pass, relative: its elements times the output
    positions it is applied at (a ResNet's ``resolution``, ``"imagenet"`` or ``"cifar"``);
    an embedding table (a lookup) takes none; any other tensor its elements."""
    pos = RESNET_POSITIONS.get(resolution, {})
    out = []
    for name, numel, *_ in layers:
        if name.startswith("embeddings.") or name in ("wte", "wpe"):
            out.append(0.0)
            continue
        out.append(float(numel) * pos.get(name.split(".")[0], 1))
    return out
