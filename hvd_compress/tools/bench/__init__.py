"""Measurement tools behind ``hvd-compress bench``.

* :mod:`hvd_compress.tools.bench.micro` -- encode + decode (+ error feedback) cost of
  every scheme on one tensor, as a ratio to a preallocated copy of that tensor.
* :mod:`hvd_compress.tools.bench.e2e` -- training steps of a communication-bound
  model under ``horovodrun`` on the emulated cluster
  (:mod:`hvd_compress.tools.testing.cluster`) at several link rates;
  :mod:`hvd_compress.tools.bench.e2e_worker` is the script each rank runs.
* :mod:`hvd_compress.tools.bench.breakdown` -- where a step's time goes (clocked parts, Horovod's
  timeline); :mod:`hvd_compress.tools.bench.link_change` -- Auto when the link drops mid-run.
* :mod:`hvd_compress.tools.bench.tta` -- time to dense accuracy: real training on the emulated
  cluster on links that stand for real clusters; :mod:`hvd_compress.tools.bench.tta_worker` is
  each rank's script, :mod:`hvd_compress.tools.bench.tta_data` its models and data.
* :mod:`hvd_compress.tools.bench.specs` -- scheme specs such as ``"TopK(0.01)"``.
* :mod:`hvd_compress.tools.bench.report` -- progress lines, tables and JSON helpers.

See docs/results/benchmarks.md for what exactly each number means.
"""
