"""What a tensor is sent as before ``Auto``'s first plan: on a link where a
plain allreduce clearly loses (the early probe's fit), a safe compressed
candidate with error feedback instead of dense steps.  During a warmup
(``Auto(warmup_steps=..., warmup_with=...)``) only quantizers are safe."""
from __future__ import annotations

from typing import List

from .planner import Candidate, choose


#: the candidates a tensor may be calibrated with, where present: every
#: element kept to 16 or 8 bits, or the largest tenth of them, with error feedback
PROVISIONAL_LABELS = ("FP16", "Int8", "TopK(0.1)")
#: what ``Auto(warmup_with=...)`` may send a tensor as during a warmup, and
#: how much faster than a plain allreduce it must be predicted (the margin of
#: :func:`provisional_choice`).  Why quantizers only: a warmup exists because
#: leaving most of the gradient out early makes training oscillate (Lin et al.,
#: ICLR 2018); rounding leaves no element out, and on a link slow enough for it
#: the warmup's dense steps cost most of a short run.
#:
#: - ``"FP16"``: half precision (11 significant bits, summed by Horovod's
#:   allreduce), where predicted at least 1/(1-0.4) = 1.67x faster: FP16 halves
#:   the bytes at best, so the margin asks for a link that sets the tensor's
#:   time, and keeps a fast link (which ranks sharing cores may read as slow)
#:   dense.  On the MNIST CNN at 4 ranks its warmup epoch ran 1.7-1.9x faster
#:   than dense at 17 Mbit/s (docs/results/tta.md, "Auto()'s warmup").
#: - ``"Int8"``: the best of FP16 and Int8 (by two-phase from 4 ranks, where an
#:   allgather sends an 8-bit payload N-1 times), where predicted at least 2x
#:   faster.  Its warmup runs faster still, but the CNN's runs then took more
#:   steps to dense's accuracy (the same page).
WARMUP_CHOICES = {"none": ((), 0.0), "FP16": (("FP16",), 0.4), "Int8": (("FP16", "Int8"), 0.5)}
#: the codec cost assumed for them before anything is timed (seconds per
#: element): about 3x what the fused CPU kernels take (Top-K 10% 1.2 ns, Int8
#: 0.9 ns, one thread), so only a link that clearly loses calibrates compressed
PROVISIONAL_CODEC_S_PER_ELEMENT = 3e-9
#: how much faster than a plain allreduce a provisional candidate must be predicted
PROVISIONAL_GAIN = 0.5


def provisional_candidates(candidates, warmup=None) -> List[Candidate]:
    """What a tensor may be calibrated with: ``none``, and each of
    :data:`PROVISIONAL_LABELS` present among ``candidates`` (so ``exclude``
    and ``min_topk_ratio`` hold for calibration too), Top-K 10% with its
    values sent as bfloat16.  ``warmup`` (a key of :data:`WARMUP_CHOICES`):
    ``none`` and that warmup's quantizers present, by either transport (at 4 or
    more ranks the two-phase exchange sends an 8-bit payload's bytes about
    once, an allgather N-1 times).

    Why bfloat16: on a link slow enough to calibrate compressed, the bytes set
    the calibration step's time, and 16-bit values make Top-K 10%'s payload
    about 0.57x (2 + ~0.7 bytes a kept element instead of 4 + ~0.7).  The
    rounding (8 significant bits) stays in the residual, as the unsent
    coordinates do, so nothing is lost."""
    from ..schemes import BF16, TopK
    out = [candidates[0]]
    if warmup is not None:
        labels, _ = WARMUP_CHOICES[warmup]
        return out + [c for c in candidates[1:] if c.base_label in labels]
    for c in candidates[1:]:
        if c.label not in PROVISIONAL_LABELS:
            continue
        if c.label == "TopK(0.1)":
            c = Candidate("TopK(0.1, values=BF16())", TopK(0.1, values=BF16()))
        out.append(c)
    return out


def provisional_choice(numel, shape, workers, link, safe, min_gain=PROVISIONAL_GAIN):
    """The label a tensor is calibrated (or warmed up) with: the best of
    ``safe`` (from :func:`provisional_candidates`, ``none`` first) at the
    conservative cost :data:`PROVISIONAL_CODEC_S_PER_ELEMENT`, where it is
    predicted at least ``min_gain`` faster than ``none`` on ``link`` (a
    warmup's margin: :data:`WARMUP_CHOICES`); else ``none``.  Why a wide
    margin: the early probe runs at the first ``compress``, where ranks sharing
    cores can read a fast link as slow (with Auto's ``min_gain`` instead, 4
    ranks on 2 cores warmed a tensor up with Int8 over localhost).  So at the
    2x margin an 8-bit allgather, which cuts a ring allreduce's bytes by only
    2x at 4 ranks (all TensorFlow's Auto runs), does not qualify; the
    two-phase exchange's 4x does."""
    costs = {c.label: PROVISIONAL_CODEC_S_PER_ELEMENT * numel for c in safe[1:]}
    return choose(numel, shape, workers, link, safe, costs, min_gain=min_gain).label
