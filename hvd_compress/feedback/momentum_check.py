"""Warnings for compressor/optimizer combinations measured not to train.

Error feedback holds back what a lossy scheme does not send and releases it on
a later step; an optimizer with momentum ``m`` then multiplies every late
release by up to ``1 / (1 - m)``.  Top-K keeps a small residual and trains
under SGD momentum 0.9, but the sign family and Random-K keep a residual as
large as many steps of gradient: with SGD momentum 0.9 in the optimizer, EFSignSGD
with error feedback fell to chance level for one seed in three, OneBit lost 5 points
and Random-K diverged (docs/results/convergence.md), while with the momentum in the compressor
EFSignSGD and OneBit train to within 1.2 points of dense.  The fix is to put the momentum in the
compressor (``hvd_compress.EFSignSGD(momentum=0.9)``, see
:class:`hvd_compress.MomentumMemory`) and set the optimizer's momentum to 0.

These checks run once per compressor, at its first ``compress`` call, where
Horovod's optimizer is on the call stack:

* **torch** -- ``hvd.DistributedOptimizer``'s ``param_groups`` (``momentum``
  of SGD/RMSprop, ``betas[0]`` of Adam-type optimizers);
* **TF/Keras** -- the Keras and legacy ``DistributedOptimizer`` wrappers
  (``momentum`` of SGD, ``beta_1`` of Adam).  ``hvd.DistributedGradientTape``
  never sees the optimizer (it only reduces gradients; the user applies them
  later), so with a tape nothing is checked and nothing is warned.

Also at construction: QSGD with error feedback on.  Error feedback assumes a
contractive compressor (``||C(x) - x|| < ||x||``, Stich et al. 2018;
Karimireddy et al. 2019); QSGD is unbiased but not contractive (its variance
can exceed ``||x||^2``), and with error feedback it measured 68.4% against 97.0%
without (docs/results/convergence.md).
"""
from __future__ import annotations

import warnings

#: schemes whose error-feedback residual stays large: measured to collapse under optimizer momentum
LARGE_RESIDUAL_SCHEMES = ("SignSGD", "EFSignSGD", "OneBit", "RandomK")


class RecipeWarning(UserWarning):
    """A compressor configuration, or compressor and optimizer pair, measured to train badly."""


def leaf_compressors(comp):
    """Every plain compressor inside ``comp``: a Policy's rules and default, a Schedule's phases."""
    if hasattr(comp, "rules") and hasattr(comp, "default"):
        out = []
        for rule in comp.rules:
            out += leaf_compressors(rule.compression)
        return out + leaf_compressors(comp.default)
    if hasattr(comp, "phases"):
        return [c for _, sub in comp.phases for c in leaf_compressors(sub)]
    return [comp]


def optimizer_momentum(framework, tensor):
    """(optimizer class name, its momentum) of the Horovod optimizer that called
    ``compress``, or None where no optimizer is visible (DistributedGradientTape,
    direct ``hvd.allreduce`` calls)."""
    from ..integration import horovod_internals
    if framework == "torch":
        caller = horovod_internals.find_torch_caller()
        if caller.optimizer is None:
            return None
        return type(caller.optimizer).__name__, caller.optimizer_momentum()
    optimizer = horovod_internals.find_keras_optimizer()
    if optimizer is None:
        return None
    return type(optimizer).__name__, horovod_internals.keras_optimizer_momentum(optimizer)


def momentum_problems(comp, optimizer_name, momentum):
    """The warning messages for ``comp`` under an optimizer with ``momentum`` (no warning: [])."""
    if not momentum or momentum <= 0:
        return []
    out, seen = [], set()
    for leaf in leaf_compressors(comp):
        scheme, memory = leaf.scheme, leaf.memory
        own = float(getattr(memory, "momentum", 0.0) or 0.0)
        if own > 0 and ("twice", scheme.name) not in seen:
            seen.add(("twice", scheme.name))
            out.append(
                f"hvd_compress: {scheme.name} applies momentum {own:g} itself (momentum= in the compressor) and the "
                f"optimizer {optimizer_name} has momentum {momentum:g} too, so the momentum compounds (a steady step "
                f"of about {1 / ((1 - own) * (1 - momentum)):.0f}x the gradient instead of {1 / (1 - own):.0f}x). "
                f"Set the optimizer's momentum to 0 (torch SGD(momentum=0), Keras SGD(momentum=0.0)) and keep "
                f"the learning rate of momentum SGD")
        elif own == 0 and leaf.error_feedback and scheme.name in LARGE_RESIDUAL_SCHEMES \
                and ("late", scheme.name) not in seen:
            seen.add(("late", scheme.name))
            out.append(
                f"hvd_compress: {scheme.name} with error feedback runs under the optimizer {optimizer_name} with "
                f"momentum {momentum:g}. Error feedback releases held-back gradient on later steps and the "
                f"optimizer's momentum multiplies each late release by up to 1/(1-{momentum:g}) = "
                f"{1 / (1 - momentum):.0f}; with SGD momentum 0.9 the sign schemes and Random-K lost from 5 points "
                f"(OneBit) to chance level (Random-K; EFSignSGD for one seed in three, docs/results/convergence.md). Fix: put the momentum in the compressor, "
                f"hvd_compress.{scheme.name}(..., momentum={momentum:g}), and set the optimizer's momentum to 0 "
                f"(docs/guide/schemes.md, 'Momentum placement')"
                + (". Random-K keeps about 1/ratio steps of gradient in its residual and did not train with either "
                   "placement at 1%; TopK at the same ratio did" if scheme.name == "RandomK" else ""))
    return out


def check_optimizer_momentum(comp, framework, tensor):
    """Warn (:class:`RecipeWarning`) about ``comp`` under the calling optimizer's momentum.
    Never raises: a check that cannot see the optimizer stays silent."""
    try:
        found = optimizer_momentum(framework, tensor)
    except Exception:  # noqa: BLE001 - a Horovod layout the readers do not know: no check
        return []
    if found is None:
        return []
    messages = momentum_problems(comp, *found)
    for message in messages:
        warnings.warn(message, RecipeWarning, stacklevel=3)
    return messages


def check_construction(comp):
    """Warn at construction about QSGD with error feedback on."""
    for leaf in leaf_compressors(comp):
        if leaf.scheme.name == "QSGD" and leaf.error_feedback:
            warnings.warn(
                "hvd_compress: QSGD with error feedback on. Error feedback assumes a contractive compressor "
                "(||C(x) - x|| < ||x||); QSGD is unbiased but not contractive, and with error feedback it trained "
                "to 68.4% against 97.0% without (docs/results/convergence.md). Leave error_feedback at QSGD's default "
                "(off), or use a contractive scheme such as TopK or Int8 with error feedback",
                RecipeWarning, stacklevel=4)
            return
