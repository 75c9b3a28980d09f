"""``hvd_compress.Auto()``: each tensor's scheme chosen online from the
measured link and encode cost.

* :mod:`~hvd_compress.auto.planner`: the planner, pure numbers in and a
  choice per tensor out by the one cost model (no framework import);
* :mod:`~hvd_compress.auto.probe`: which allreduce sizes Auto times to fit the link;
* :mod:`~hvd_compress.auto.compressor`: :class:`Auto`, the compression object
  (calibrate, decide, agree on one plan, re-check), for PyTorch and TensorFlow;
* :mod:`~hvd_compress.auto.calibration`: its PyTorch measurements and
  agreement collectives;
* :mod:`~hvd_compress.auto.tf_auto`: its TensorFlow side (a per-tensor mode
  variable, ``tf.switch_case`` over the modes its plan needs, a host callback at check
  steps).

The planner's public names are also importable from here
(``from hvd_compress.auto import plan, fit_link, Link``).
"""
from ..costmodel.model import comm_time
from .compressor import Auto
from .planner import (NONE_LABEL, Candidate, Choice, Link, PlanMismatchError, applies, check_codec_costs, choose,
                      default_candidates, fit_link, fixed_codec_seconds, format_plan, plan, predict_comm,
                      predicted_total)

__all__ = ["Auto", "NONE_LABEL", "Candidate", "Choice", "Link", "PlanMismatchError", "applies", "check_codec_costs",
           "choose", "comm_time", "default_candidates", "fit_link", "fixed_codec_seconds", "format_plan", "plan",
           "predict_comm", "predicted_total"]
