"""Compression metrics for logging: bytes sent vs dense, codec time, residual norm.

Two front ends over one meter:

* :class:`TorchCompressionLogger` -- call ``logger.step()`` after each
  ``optimizer.step()`` and ``logger.end_epoch(epoch)`` at the end of an epoch::

      compression = hvd_compress.TopK(0.01)
      opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                     compression=compression)
      logger = TorchCompressionLogger(compression, model=model, logdir="runs/topk")
      for epoch in range(epochs):
          for x, y in loader:
              ...; opt.step(); logger.step()
          print(logger.end_epoch(epoch))

* :class:`KerasCompressionCallback` -- a ``tf.keras`` callback for
  ``model.fit(..., callbacks=[KerasCompressionCallback(compression, logdir=...)])``;
  it also adds ``compression_ratio``, ``bytes_sent`` and ``residual_norm`` to
  the epoch's ``logs`` (so they appear in ``History``).

What is measured
----------------
``bytes_sent``
    bytes this rank handed to Horovod's collectives for gradients (payloads,
    indices, scales, lengths and placeholders), summed over the steps, from
    ``compressor.stats``; ``bytes_dense_fp32`` is what dense fp32 gradients
    would have cost.  For Horovod's own ``hvd.Compression.none`` / ``fp16``
    (which keep no statistics) they are 4 / 2 bytes for each element of the
    model's floating-point trainable parameters.
``residual_norm``
    the L2 norm over all error-feedback residuals after the step (0 without
    error feedback): how much gradient is still waiting to be sent.
``compress_ms`` / ``decompress_ms``
    PyTorch only (``time_codec=True``, the default): wall time spent in the
    compressor's ``compress`` and ``decompress`` per step, summed over
    tensors.  ``decompress`` includes waiting for the scheme's side
    allgathers, i.e. part of the communication.  TensorFlow traces
    ``compress`` once into a graph, so no per-step time exists there.

Where it goes
-------------
``sink="auto"``: TensorBoard event files in ``logdir`` when the
``tensorboard`` package is installed, otherwise a CSV file
``logdir/compression_metrics.csv`` (or nothing but the returned summaries
when ``logdir`` is None).  ``sink`` may also be ``"tensorboard"``, ``"csv"``
or ``"stdout"`` (one line per logged step).  Only rank 0 writes, unless
``all_ranks=True`` (each rank then writes under ``logdir/rank<N>``).
"""
from __future__ import annotations

import csv
import importlib.util
import math
import os
import sys
import time

__all__ = ["CompressionMeter", "TorchCompressionLogger", "KerasCompressionCallback", "format_bytes",
           "tensorboard_available"]


def tensorboard_available():
    return importlib.util.find_spec("tensorboard") is not None


def format_bytes(n):
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0


def _is_ours(compression):
    from ..compressor import Compressor
    return isinstance(compression, Compressor)


def auto_plan_summary(compression):
    """For :class:`hvd_compress.Auto`: how many plans it has adopted (0 while
    calibrating) and how many of its planned tensors the plan in force
    compresses, as numbers a TensorBoard scalar can hold; {} for the others."""
    plan = getattr(compression, "current_plan", None)
    if not callable(plan):
        return {}
    labels = plan()
    return {"auto_plans_adopted": len(compression.plan_state.history), "auto_tensors": len(labels),
            "auto_tensors_compressed": sum(label != "none" for label in labels.values())}


def _builtin_bytes_per_element(compression):
    """Horovod's own Compression classes: 2 bytes for fp16, else 4."""
    name = getattr(compression, "__name__", type(compression).__name__)
    return 2 if "fp16" in name.lower() else 4


def _to_float(x):
    if hasattr(x, "numpy"):
        x = x.numpy()
    return float(x)


class CompressionMeter:
    """Framework-neutral accumulator of per-step and per-epoch metrics.

    Args:
        compression: the object given to Horovod as ``compression=`` (an
            hvd_compress compressor, or Horovod's own ``Compression.none`` /
            ``Compression.fp16``).
        dense_fp32_bytes: 4 x the number of floating-point gradient elements
            per step; needed only for Horovod's own compressions.
    """

    def __init__(self, compression, dense_fp32_bytes=None):
        self.compression = compression
        self.ours = _is_ours(compression)
        self.dense_fp32_bytes = dense_fp32_bytes
        self.codec_time = {"compress": 0.0, "decompress": 0.0}
        self.timed = False
        self.global_step = 0
        self.reset_epoch()

    def reset_epoch(self):
        self.epoch = {"steps": 0, "bytes_sent": 0, "bytes_dense_fp32": 0, "compress_s": 0.0, "decompress_s": 0.0}
        self._t0 = time.monotonic()

    # --- one step ------------------------------------------------------------------------
    def latest_step_bytes(self):
        """(payload bytes, dense fp32 bytes) of the latest step."""
        if self.ours:
            t = self.compression.stats.totals()
            return int(t["payload_bytes"]), int(t["dense_fp32_bytes"])
        if self.dense_fp32_bytes is None:
            return 0, 0
        return self.dense_fp32_bytes * _builtin_bytes_per_element(self.compression) // 4, self.dense_fp32_bytes

    def residual_norm(self):
        """L2 norm over all error-feedback residuals (every framework adapter)."""
        if not self.ours:
            return 0.0
        total = 0.0
        for adapter in list(self.compression.adapters.values()):
            for r in list(getattr(adapter, "residuals", {}).values()):
                if hasattr(r, "detach"):  # torch
                    total += float(r.detach().float().pow(2).sum())
                else:  # tf.Variable / tf.Tensor
                    import tensorflow as tf
                    total += float(tf.reduce_sum(tf.square(tf.cast(r, tf.float32))))
        return math.sqrt(total)

    def step(self, with_residual=True):
        """Record one communication step; returns the step's metrics."""
        sent, dense = self.latest_step_bytes()
        self.global_step += 1
        e = self.epoch
        e["steps"] += 1
        e["bytes_sent"] += sent
        e["bytes_dense_fp32"] += dense
        out = {"bytes_sent": sent, "bytes_dense_fp32": dense,
               "compression_ratio": dense / sent if sent else float("nan")}
        if self.timed:
            c, d = self.codec_time["compress"], self.codec_time["decompress"]
            self.codec_time["compress"] = self.codec_time["decompress"] = 0.0
            e["compress_s"] += c
            e["decompress_s"] += d
            out.update(compress_ms=1e3 * c, decompress_ms=1e3 * d)
        if with_residual:
            out["residual_norm"] = self.residual_norm()
        return out

    def epoch_summary(self):
        e = self.epoch
        sent, dense, n = e["bytes_sent"], e["bytes_dense_fp32"], max(e["steps"], 1)
        out = {"steps": e["steps"], "bytes_sent": sent, "bytes_dense_fp32": dense,
               "compression_ratio": dense / sent if sent else float("nan"),
               "bytes_saved_pct": 100.0 * (1.0 - sent / dense) if dense else float("nan"),
               "residual_norm": self.residual_norm(), "epoch_time_s": time.monotonic() - self._t0}
        if self.timed:
            out.update(compress_ms_per_step=1e3 * e["compress_s"] / n,
                       decompress_ms_per_step=1e3 * e["decompress_s"] / n)
        out.update(auto_plan_summary(self.compression))
        return out

    @staticmethod
    def format(summary):
        """One line: 'sent X vs dense Y (Rx smaller, S% saved), residual norm N'.
        Needs only ``bytes_sent`` and ``bytes_dense_fp32``; the rest is optional."""
        sent, dense = summary["bytes_sent"], summary["bytes_dense_fp32"]
        ratio = dense / sent if sent else float("nan")
        saved = 100.0 * (1.0 - sent / dense) if dense else float("nan")
        s = (f"sent {format_bytes(sent)} vs dense {format_bytes(dense)} "
             f"({ratio:.1f}x smaller, {saved:.1f}% saved)")
        if summary.get("residual_norm"):
            s += f", residual norm {summary['residual_norm']:.3g}"
        if "auto_tensors" in summary:
            s += (f", Auto plan {summary['auto_plans_adopted']}: {summary['auto_tensors_compressed']} of "
                  f"{summary['auto_tensors']} tensors compressed")
        if "compress_ms_per_step" in summary:
            s += (f", codec {summary['compress_ms_per_step']:.2f}+{summary['decompress_ms_per_step']:.2f}"
                  " ms/step")
        return s

    # --- timing (eager frameworks) -------------------------------------------------------------
    def time_codec(self):
        """Wrap the compressor's compress/decompress (instance attributes, the
        class is untouched) to accumulate their wall time."""
        if not self.ours or self.timed:
            return
        comp = self.compression
        acc = self.codec_time
        inner_c, inner_d = comp.compress, comp.decompress

        def compress(tensor):
            t = time.perf_counter()
            try:
                return inner_c(tensor)
            finally:
                acc["compress"] += time.perf_counter() - t

        def decompress(tensor, ctx):
            t = time.perf_counter()
            try:
                return inner_d(tensor, ctx)
            finally:
                acc["decompress"] += time.perf_counter() - t

        comp.compress, comp.decompress = compress, decompress
        self.timed = True


class _Sink:
    """TensorBoard, CSV or stdout; scalars keyed by tag."""

    def __init__(self, framework, logdir, sink, prefix):
        self.prefix = prefix
        self.kind = sink
        if sink == "auto":
            self.kind = "tensorboard" if (logdir and tensorboard_available()) else ("csv" if logdir else "none")
        if self.kind in ("tensorboard", "csv") and not logdir:
            raise ValueError(f"sink={self.kind!r} needs a logdir")
        self.logdir = logdir
        self._writer = None
        self._csv = None
        if self.kind == "tensorboard":
            os.makedirs(logdir, exist_ok=True)
            if framework == "torch":
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
                self._writer = SummaryWriter(logdir)
            else:
                import tensorflow as tf  # TF writes event files natively
                self._writer = tf.summary.create_file_writer(logdir)
            self._framework = framework
        elif self.kind == "csv":
            os.makedirs(logdir, exist_ok=True)
            self.path = os.path.join(logdir, "compression_metrics.csv")
            self._csv = open(self.path, "w", newline="")
            self._csv_writer = None
        elif self.kind not in ("stdout", "none"):
            raise ValueError(f"sink must be auto, tensorboard, csv, stdout or none; got {sink!r}")

    def write(self, kind, step, values):
        values = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        if self.kind == "tensorboard":
            if self._framework == "torch":
                for k, v in values.items():
                    self._writer.add_scalar(f"{self.prefix}{kind}/{k}", v, step)
            else:
                import tensorflow as tf
                with self._writer.as_default():
                    for k, v in values.items():
                        tf.summary.scalar(f"{self.prefix}{kind}/{k}", v, step=step)
        elif self.kind == "csv":
            row = {"kind": kind, "step": step, **values}
            if self._csv_writer is None:
                self._fields = ["kind", "step", "steps", "bytes_sent", "bytes_dense_fp32", "compression_ratio",
                                "bytes_saved_pct", "residual_norm", "compress_ms", "decompress_ms",
                                "compress_ms_per_step", "decompress_ms_per_step", "epoch_time_s"]
                self._csv_writer = csv.DictWriter(self._csv, fieldnames=self._fields, extrasaction="ignore")
                self._csv_writer.writeheader()
            self._csv_writer.writerow(row)
            self._csv.flush()
        elif self.kind == "stdout":
            body = " ".join(f"{k}={v:.6g}" for k, v in values.items())
            print(f"[{self.prefix}{kind} {step}] {body}", file=sys.stdout, flush=True)

    def flush(self):
        if self._writer is not None:
            self._writer.flush()
        if self._csv is not None:
            self._csv.flush()

    def close(self):
        if self._writer is not None:
            self._writer.close() if hasattr(self._writer, "close") else self._writer.flush()
        if self._csv is not None:
            self._csv.close()


def _rank(framework):
    try:
        if framework == "torch":
            import horovod.torch as hvd
        else:
            import horovod.tensorflow as hvd
        return hvd.rank()
    except Exception:  # not initialised: a single process
        return 0


class _Logger:
    def __init__(self, framework, compression, dense_fp32_bytes, logdir, sink, every_n_steps, prefix,
                 all_ranks, residual_every_step):
        self.meter = CompressionMeter(compression, dense_fp32_bytes)
        self.rank = _rank(framework)
        self.every_n_steps = every_n_steps
        self.residual_every_step = residual_every_step
        writes = all_ranks or self.rank == 0
        if all_ranks and logdir:
            logdir = os.path.join(logdir, f"rank{self.rank}")
        self.sink = _Sink(framework, logdir, sink if writes else "none", prefix)
        self.history = []

    def step(self):
        n = self.meter.global_step + 1
        log_now = self.every_n_steps and n % self.every_n_steps == 0 and self.sink.kind != "none"
        values = self.meter.step(with_residual=bool(log_now) and self.residual_every_step)
        if log_now:
            self.sink.write("step", n, values)
        return values

    def end_epoch(self, epoch):
        """Log and return the epoch's summary dict, then start a new epoch."""
        summary = self.meter.epoch_summary()
        summary["epoch"] = epoch
        self.sink.write("epoch", epoch, summary)
        self.sink.flush()
        self.history.append(summary)
        self.meter.reset_epoch()
        return summary

    def format(self, summary):
        return CompressionMeter.format(summary)

    def close(self):
        self.sink.close()


class TorchCompressionLogger(_Logger):
    """PyTorch helper; see the module docstring.

    Args:
        compression: what was passed to ``hvd.DistributedOptimizer``.
        model: the model (its floating-point ``requires_grad`` parameters size
            the dense baseline for Horovod's own compressions).
        logdir, sink: where to write (see module docstring).
        every_n_steps: also log per-step scalars every N steps (0: epochs only).
        time_codec: measure compress/decompress wall time.
    """

    def __init__(self, compression, model=None, logdir=None, sink="auto", every_n_steps=0,
                 time_codec=True, prefix="compression/", all_ranks=False):
        dense = None
        if model is not None:
            dense = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad and p.is_floating_point())
        super().__init__("torch", compression, dense, logdir, sink, every_n_steps, prefix, all_ranks, True)
        if time_codec:
            self.meter.time_codec()


def _keras_callback_base():
    import tensorflow as tf
    return tf.keras.callbacks.Callback


def KerasCompressionCallback(compression, logdir=None, sink="auto", every_n_steps=0, prefix="compression/",
                             all_ranks=False, verbose=0):
    """A ``tf.keras`` callback logging compression metrics (see module docstring).

    Adds ``bytes_sent``, ``bytes_dense_fp32``, ``compression_ratio`` and
    ``residual_norm`` to the epoch's ``logs``; ``verbose=1`` also prints the
    one-line summary on rank 0.  Place it *before* ``hvd.callbacks.MetricAverageCallback``
    only if you want those numbers averaged over ranks (they are per rank).
    """
    base = _keras_callback_base()

    class _KerasCompressionCallback(base):
        def __init__(self):
            super().__init__()
            self.logger = None

        def _ensure(self):
            if self.logger is None:
                dense = None
                if self.model is not None and self.model.trainable_variables:
                    dense = 4 * sum(int(v.shape.num_elements()) for v in self.model.trainable_variables
                                    if v.dtype.is_floating)
                self.logger = _Logger("tensorflow", compression, dense, logdir, sink, every_n_steps, prefix,
                                      all_ranks, True)
            return self.logger

        def on_epoch_begin(self, epoch, logs=None):
            self._ensure().meter.reset_epoch()

        def on_train_batch_end(self, batch, logs=None):
            self._ensure().step()

        def on_epoch_end(self, epoch, logs=None):
            summary = self._ensure().end_epoch(epoch)
            self.summary = summary
            if logs is not None:
                for k in ("bytes_sent", "bytes_dense_fp32", "compression_ratio", "residual_norm"):
                    logs[k] = summary[k]
            if verbose and self.logger.rank == 0:
                print(f"Epoch {epoch + 1} compression: {CompressionMeter.format(summary)}", flush=True)

        def on_train_end(self, logs=None):
            if self.logger is not None:
                self.logger.sink.flush()

    return _KerasCompressionCallback()
