"""Graph frameworks under a schedule: the phase is picked at run time
(``tf.switch_case`` on the step), and each branch runs its own transport to
the end, so nothing crosses to ``decompress`` but the dense sum and whether
the phase's scheme takes Horovod's scaling."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Pending, Transport, op_scale, to_gradient


@dataclass(eq=False, kw_only=True)
class ResolvedPending(Pending):
    dense: Any  # the flat float32 sum over ranks, from the branch that ran
    apply_scale: Any  # 1.0 where that branch's scheme takes the op's scaling, else 0.0 (a tensor)


class ResolvedTransport(Transport):
    name = "resolved"

    def start(self, call):
        raise TypeError("the resolved transport is built by the TF adapter's schedule, not started")

    def finish(self, pending, reduced):
        scale = op_scale(pending.roles.B, reduced, pending.group.size)
        apply_scale = pending.apply_scale
        return to_gradient(pending, pending.dense * (apply_scale * scale + (1.0 - apply_scale)))
