"""What a tensor is sent as before ``Auto``'s first plan: on a link where a
plain allreduce clearly loses (the early probe's fit), a safe compressed
candidate with error feedback instead of dense steps.  During a warmup
(``Auto(warmup_steps=...)``) only the quantizers are safe."""
from __future__ import annotations

from typing import List

from .planner import Candidate, choose


#: the candidates a tensor may be calibrated with, where present: every
#: element kept to 16 or 8 bits, or the largest tenth of them, with error feedback
PROVISIONAL_LABELS = ("FP16", "Int8", "TopK(0.1)")
#: the candidates a tensor may be sent as during a warmup, by either transport:
#: every element kept, rounded to 16 or 8 bits, the rounding fed back.  Why: a
#: warmup exists because leaving most of the gradient out early makes training
#: oscillate (Lin et al., ICLR 2018); rounding leaves nothing out, and on a link
#: slow enough for it the warmup's dense steps would cost most of a short run
WARMUP_LABELS = ("FP16", "Int8")
#: the codec cost assumed for them before anything is timed (seconds per
#: element): about 3x what the fused CPU kernels take (Top-K 10% 1.2 ns, Int8
#: 0.9 ns, one thread), so only a link that clearly loses calibrates compressed
PROVISIONAL_CODEC_S_PER_ELEMENT = 3e-9
#: how much faster than a plain allreduce a provisional candidate must be predicted
PROVISIONAL_GAIN = 0.5


def provisional_candidates(candidates, warmup=False) -> List[Candidate]:
    """What a tensor may be calibrated with: ``none``, and each of
    :data:`PROVISIONAL_LABELS` present among ``candidates`` (so ``exclude``
    and ``min_topk_ratio`` hold for calibration too), Top-K 10% with its
    values sent as bfloat16.  ``warmup``: ``none`` and the candidates of
    :data:`WARMUP_LABELS`, by either transport (at 4 or more ranks the two-phase
    exchange sends an 8-bit payload's bytes about once, an allgather N-1 times).

    Why bfloat16: on a link slow enough to calibrate compressed, the bytes set
    the calibration step's time, and 16-bit values make Top-K 10%'s payload
    about 0.57x (2 + ~0.7 bytes a kept element instead of 4 + ~0.7).  The
    rounding (8 significant bits) stays in the residual, as the unsent
    coordinates do, so nothing is lost."""
    from ..schemes import BF16, TopK
    out = [candidates[0]]
    if warmup:
        return out + [c for c in candidates[1:] if c.base_label in WARMUP_LABELS]
    for c in candidates[1:]:
        if c.label not in PROVISIONAL_LABELS:
            continue
        if c.label == "TopK(0.1)":
            c = Candidate("TopK(0.1, values=BF16())", TopK(0.1, values=BF16()))
        out.append(c)
    return out


def provisional_choice(numel, shape, workers, link, safe):
    """The label a tensor is calibrated (or warmed up) with: the best of
    ``safe`` (from :func:`provisional_candidates`, ``none`` first) at the
    conservative cost :data:`PROVISIONAL_CODEC_S_PER_ELEMENT`, where it is
    predicted at least :data:`PROVISIONAL_GAIN` faster than ``none`` on
    ``link``; else ``none``.  Why that margin for a warmup too: the early probe
    runs at the first ``compress``, where ranks sharing cores can read a fast
    link as slow (with Auto's ``min_gain`` instead, 4 ranks on 2 cores warmed a
    tensor up with Int8 over localhost).  So an 8-bit
    allgather, which cuts a ring allreduce's bytes by only 2x at 4 ranks (all
    TensorFlow's Auto runs), does not qualify there; the two-phase exchange's
    4x does."""
    costs = {c.label: PROVISIONAL_CODEC_S_PER_ELEMENT * numel for c in safe[1:]}
    return choose(numel, shape, workers, link, safe, costs, min_gain=PROVISIONAL_GAIN).label
