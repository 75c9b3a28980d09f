"""``hvd-compress bench micro``: what one scheme costs one rank, in copies.

What is timed (one repetition, one scheme, one tensor ``x`` of ``numel``
fp32 elements, shaped ``(numel / 1024, 1024)`` like a weight gradient):

* ``encode_decode_s`` -- ``out, ctx = comp.compress(x)`` followed by
  ``dense = comp.decompress(out, ctx)`` on a :class:`~hvd_compress.Compressor`
  whose adapter is the real torch/TF adapter with one-rank collectives
  (:mod:`hvd_compress.tools.bench.local`).  That is: flatten/cast, the step counter
  and the random generator of the call, ``acc = x + residual`` (error feedback,
  when the scheme has it on), ``scheme.encode``, the new residual
  ``acc - sent`` with non-finite values dropped, the split of the payload into
  the parts Horovod would carry, and on the way back the per-rank split,
  ``scheme.aggregate`` over that one payload (or ``decode_reduced``), the
  placeholder scaling and the reshape.  The residual persists between
  repetitions, as between training steps.  TensorFlow runs both inside one
  ``tf.function`` (Horovod always traces ``compress``), traced in the warm-up.
  Not timed: the collectives themselves.
* ``copy_s`` -- ``dst.copy_(src)`` of the same tensor into a preallocated
  buffer (torch, in both frameworks' runs; ``numpy.copyto`` if torch is
  missing), in the same process with the same thread settings.
* The input cycles through 3 independent N(0,1) tensors (the copy copies the
  current one), so error feedback sees a new gradient each call and its
  residual evolves as in training.  In torch each one is first copied,
  untimed, into one gradient tensor that ``compress`` receives, as Horovod's
  optimizer hands over ``p.grad``: the one-rank adapter, like the real one
  under the optimizer, may write the result into that gradient (Horovod sets
  ``p.grad`` to the result anyway), so a fused decode allocates nothing.
* Repetitions are interleaved (copy, scheme, scheme, copy, ...) and each time
  is the median over the repetitions; ``ratio_to_copy = encode_decode_s /
  copy_s``.
* ``encode_s`` / ``decode_s`` -- the two halves (TF: an encode-only function
  timed in the same loop; ``decode_s`` is the difference of medians).
* ``payload_bytes`` -- bytes handed to collectives as counted by
  ``comp.stats.totals()`` in the last repetition (4-byte placeholder and
  length words included); ``dense_fp32_bytes = 4 * numel``.

``hvd_fp16`` is Horovod's own ``hvd.Compression.fp16`` (a cast each way, no
error feedback), for reference.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..units import parse_counts
from .report import Progress, human_bytes, human_count, human_seconds, table, write_json
from .specs import HOROVOD_SPECS, parse_spec

DEFAULT_SIZES = "1M,16M,64M"
FIELDS = ("scheme", "framework", "device", "numel", "encode_decode_s", "copy_s", "ratio_to_copy",
          "payload_bytes", "dense_fp32_bytes")
#: the targets at 16M elements on one CPU thread, default malloc (ratio to a copy)
TARGETS = {("torch", "TopK(0.01)"): 4.0, ("torch", "Int8"): 4.0, ("torch", "EFSignSGD"): 4.0,
           ("torch", "FP16"): 1.5, ("tensorflow", "TopK(0.01)"): 6.0, ("tensorflow", "Int8"): 4.0,
           ("torch", "PowerSGD(4)"): 5.0,
           ("torch", "Threshold(2.576)"): 4.0, ("torch", "OneBit"): 4.0, ("torch", "TopK(0.1, values=BF16())"): 5.0,
           ("tensorflow", "DGC(0.01)"): 5.0}


def target_of(row):
    """The ratio-to-copy target of a micro row, or None (no target for it)."""
    if row["numel"] != 16_000_000 or row.get("threads") != 1 or allocator_of(row) != "default":
        return None
    return TARGETS.get((row["framework"], row["scheme"]))

#: glibc malloc settings a run can be repeated under.  With the defaults every
#: tensor of 128 KiB or more is a fresh mmap, so each temporary of a 16M-element
#: encode pays its page faults again (measured here: about 2/3 of Int8's time).
#: ``no-mmap`` keeps freed memory in the heap for reuse -- what jemalloc or
#: tcmalloc (PyTorch's CPU tuning guide) give too.  The process must start with it.
ALLOCATORS = {"default": {}, "no-mmap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736"}}


def check_allocator(param, name):
    if name not in ALLOCATORS:
        raise ValueError(f"{param}: unknown allocator {name!r} (allowed: {', '.join(ALLOCATORS)})")


def allocator_of(row):
    """A result row's malloc setting (rows from before the field: ``default``)."""
    return row.get("allocator", "default")


def malloc_env():
    """The glibc malloc variables this process really started with."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}


def default_schemes():
    """Every registered scheme's representative configuration (the first of
    its ``bench`` specs in :data:`hvd_compress.schemes.REGISTRY`), then the
    extra ones (Top-10% with 16-bit values: the back-of-envelope case of
    :func:`hvd_compress.tools.advise.worked_example`), then Horovod's own fp16."""
    from ...schemes import REGISTRY
    first = [reg.bench[0] for reg in REGISTRY.values()]
    extra = [spec for reg in REGISTRY.values() for spec in reg.bench[1:]]
    return first + extra + ["hvd_fp16"]


def scheme_kind(spec: str) -> str:
    """'sparsifier', 'quantizer' or 'other' (for the targets), from the
    registered ``kind`` of the spec's scheme (a sparsifier's ``values=``
    quantizer does not change its kind)."""
    if spec in HOROVOD_SPECS:
        return "other"  # Horovod's own: a reference, not a product target
    from ...schemes import registration
    kind = registration(parse_spec(spec).scheme).kind
    return kind if kind in ("sparsifier", "quantizer") else "other"


def _shape(n):
    return (n // 1024, 1024) if n % 1024 == 0 and n >= 1024 else (n,)


def _data(n, seed=0):
    import numpy as np
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


#: independent gradients cycled through, so that error feedback sees a
#: fresh gradient each call (as in training) and its residual stays realistic
POOL = 3


class _Pool:
    def __init__(self, items):
        self.items, self.i = items, 0

    def current(self):
        return self.items[self.i]

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _interleaved(copy, encdec, reps, warmup):
    """Interleaved repetitions; ``encdec()`` returns (encode_s, total_s)."""
    for _ in range(warmup):
        copy()
        encdec()
    c, e, t = [], [], []
    for r in range(reps):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                t0 = time.perf_counter()
                copy()
                c.append(time.perf_counter() - t0)
            else:
                es, ts = encdec()
                e.append(es)
                t.append(ts)
    return c, e, t


def _row(spec, framework, device, n, copy_t, enc_t, tot_t, payload, cfg, copy_method):
    cs, ts, es = _median(copy_t), _median(tot_t), _median(enc_t)
    return {"scheme": spec, "framework": framework, "device": device, "numel": n,
            "encode_decode_s": ts, "copy_s": cs, "ratio_to_copy": ts / cs if cs > 0 else float("nan"),
            "payload_bytes": int(payload), "dense_fp32_bytes": 4 * n,
            "payload_ratio": payload / (4.0 * n), "encode_s": es, "decode_s": max(ts - es, 0.0),
            "encode_decode_s_min": min(tot_t), "encode_decode_s_max": max(tot_t),
            "copy_s_min": min(copy_t), "reps": len(tot_t), "threads": cfg["threads"],
            "copy_method": copy_method, "kind": scheme_kind(spec),
            "loadavg_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "allocator": cfg.get("allocator", "default"),
            "malloc_env": malloc_env()}  # read back from the worker, not from the request


# ----------------------------------------------------------------------------- workers
def _torch_rows(cfg, emit):
    import torch
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    devices = [d for d in cfg["devices"] if d == "cpu" or (d == "cuda" and torch.cuda.is_available())]
    for dev in devices:
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        for n in cfg["sizes"]:
            xs = _Pool([torch.from_numpy(_data(n, seed)).reshape(_shape(n)).to(dev) for seed in range(POOL)])
            dst = torch.empty_like(xs.items[0])

            def copy():
                dst.copy_(xs.current())
                sync()

            for spec in cfg["schemes"]:
                emit({"event": "start", "scheme": spec, "framework": "torch", "device": dev, "numel": n})
                with _reporting(emit, spec, "torch", dev, n):
                    _torch_one(cfg, emit, spec, dev, n, xs, copy, sync)
            del xs, dst


def _torch_one(cfg, emit, spec, dev, n, xs, copy, sync):
    if spec in HOROVOD_SPECS:
        from .specs import horovod_compression
        hc = horovod_compression(spec, "torch")
        comp, enc_f, dec_f = None, hc.compress, hc.decompress
    else:
        from .local import local_compressor
        comp = local_compressor(parse_spec(spec), "torch")
        enc_f, dec_f = comp.compress, comp.decompress
    last = {}
    grad = xs.items[0].clone()

    def encdec():
        # as under Horovod's optimizer: the gradient was just written (by the
        # backward pass; here, untimed, from the pool) and is replaced by the result
        grad.copy_(xs.next())
        sync()
        t0 = time.perf_counter()
        out, ctx = enc_f(grad)
        sync()
        t1 = time.perf_counter()
        dense = dec_f(out, ctx)
        sync()
        t2 = time.perf_counter()
        last["out"] = out
        del dense
        return t1 - t0, t2 - t0

    c, e, t = _interleaved(copy, encdec, cfg["reps"], cfg["warmup"])
    if comp is None:
        payload = last["out"].numel() * last["out"].element_size()
    else:
        payload = comp.stats.totals()["payload_bytes"]
    emit({"event": "row", **_row(spec, "torch", dev, n, c, e, t, payload, cfg, "torch.Tensor.copy_")})


def _tf_rows(cfg, emit):
    import numpy as np
    import tensorflow as tf
    if cfg["threads"]:
        tf.config.threading.set_intra_op_parallelism_threads(cfg["threads"])
        tf.config.threading.set_inter_op_parallelism_threads(cfg["threads"])
    try:
        import torch
        if cfg["threads"]:
            torch.set_num_threads(cfg["threads"])
    except ImportError:
        torch = None
    devices = ["cpu"]
    if "cuda" in cfg["devices"] and tf.config.list_physical_devices("GPU"):
        devices.append("cuda")
    for dev in devices:
        for n in cfg["sizes"]:
            srcs = [_data(n, seed) for seed in range(POOL)]
            dst = np.empty_like(srcs[0])
            with tf.device("/GPU:0" if dev == "cuda" else "/CPU:0"):
                xs = _Pool([tf.constant(s.reshape(_shape(n))) for s in srcs])
            if torch is not None:
                tsrc, tdst = [torch.from_numpy(s) for s in srcs], torch.from_numpy(dst)
                copy, copy_method = (lambda: tdst.copy_(tsrc[xs.i])), "torch.Tensor.copy_"
            else:
                copy, copy_method = (lambda: np.copyto(dst, srcs[xs.i])), "numpy.copyto"
            for spec in cfg["schemes"]:
                emit({"event": "start", "scheme": spec, "framework": "tensorflow", "device": dev, "numel": n})
                with _reporting(emit, spec, "tensorflow", dev, n):
                    _tf_one(cfg, emit, spec, dev, n, xs, copy, copy_method)
            del xs, srcs, dst


def _tf_one(cfg, emit, spec, dev, n, xs, copy, copy_method):
    import numpy as np
    import tensorflow as tf
    if spec in HOROVOD_SPECS:
        from .specs import horovod_compression
        hc = horovod_compression(spec, "tensorflow")
        comp = None

        def enc_body(t):
            out, _ = hc.compress(t)
            return [out]

        def full_body(t):
            out, ctx = hc.compress(t)
            return hc.decompress(out, ctx)
    else:
        from .local import local_compressor
        comp = local_compressor(parse_spec(spec), "tensorflow")

        def enc_body(t):
            out, pending = comp.compress(t)
            # the pending's collective results (every dict field of its typed dataclass), so
            # that the encode-only call computes everything compress() started
            return [out] + [v for f in vars(pending).values() if isinstance(f, dict)
                            for v in f.values() if tf.is_tensor(v)]

        def full_body(t):
            out, ctx = comp.compress(t)
            return comp.decompress(out, ctx)
    enc_fn, full_fn = tf.function(enc_body), tf.function(full_body)
    last = {}

    def encdec():
        # encode-only and encode+decode are separate calls of two traced
        # functions; each is timed on its own: (encode, encode+decode)
        x = xs.next()
        t0 = time.perf_counter()
        parts = enc_fn(x)
        _ = parts[0][:1].numpy()
        t1 = time.perf_counter()
        dense = full_fn(x)
        _ = tf.reshape(dense, [-1])[:1].numpy()
        t2 = time.perf_counter()
        last["parts"] = parts
        return t1 - t0, t2 - t1

    # the first calls after a trace are slow (graph optimisation): warm up more
    c, e, t = _interleaved(copy, encdec, cfg["reps"], max(cfg["warmup"], 3))
    if comp is None:
        p = last["parts"][0]
        payload = int(np.prod(p.shape)) * p.dtype.size
    else:
        payload = comp.stats.totals()["payload_bytes"]
    emit({"event": "row", **_row(spec, "tensorflow", dev, n, c, e, t, payload, cfg, copy_method)})


class _reporting:
    """Report a scheme that fails (and go on with the next one)."""

    def __init__(self, emit, spec, framework, device, n):
        self.emit, self.what = emit, {"scheme": spec, "framework": framework, "device": device, "numel": n}

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None or not issubclass(et, Exception):
            return False
        import traceback
        msg = str(ev).strip().splitlines()
        self.emit({"event": "scheme_error", **self.what, "error": f"{et.__name__}: {msg[-1] if msg else ''}",
                   "traceback": "".join(traceback.format_exception(et, ev, tb))[-4000:]})
        return True


def _worker(cfg):
    def emit(obj):
        sys.stdout.write("HVDC_MICRO " + json.dumps(obj) + "\n")
        sys.stdout.flush()

    fw = cfg["framework"]
    try:
        (_torch_rows if fw == "torch" else _tf_rows)(cfg, emit)
    except Exception as e:  # report, so the parent can say what failed
        import traceback
        emit({"event": "error", "framework": fw, "error": f"{type(e).__name__}: {e}",
              "traceback": traceback.format_exc()})
        return 1
    return 0


# ----------------------------------------------------------------------------- driver
def run(schemes=None, frameworks=("torch", "tensorflow"), sizes=DEFAULT_SIZES, devices=("cpu", "cuda"),
        threads=1, reps=5, warmup=1, out_json=None, out_png=None, progress=True, stream=None,
        strict=False, allocators=("default",)):
    """Run the micro benchmark, each framework in its own subprocess (thread
    settings must precede framework initialisation).  Returns the rows (a
    list with an ``errors`` attribute: schemes that failed are reported there
    and left out of the JSON; ``strict`` raises instead).  ``allocators``
    repeats the run under each of :data:`ALLOCATORS`' malloc settings."""
    stream = stream or sys.stdout
    schemes = list(schemes or default_schemes())
    for s in schemes:
        parse_spec(s)  # fail early on a typo
    sizes = parse_counts(sizes) if isinstance(sizes, str) else [int(s) for s in sizes]
    frameworks = ["tensorflow" if f in ("tf", "tensorflow") else f for f in frameworks]
    for f in frameworks:
        if f not in ("torch", "tensorflow"):
            raise ValueError(f"unknown framework {f!r} (torch, tf)")
    allocators = [allocators] if isinstance(allocators, str) else list(allocators)
    for a in allocators:
        check_allocator("allocators", a)
    n_dev = (1 + (1 if "cuda" in devices and _cuda_present() else 0)) * len(allocators)
    # weight the progress by element count: the 64M items dominate the run time
    total_weight = n_dev * len(frameworks) * len(schemes) * sum(sizes)
    prog = Progress(n_dev * len(frameworks) * len(schemes) * len(sizes), enabled=progress)
    rows, errors, done_weight = [], [], 0
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("TF_USE_LEGACY_KERAS", "1")
    if threads:
        for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[v] = str(threads)
    for alloc, fw in [(a, f) for a in allocators for f in frameworks]:
        cfg = {"framework": fw, "schemes": schemes, "sizes": sizes, "devices": list(devices),
               "threads": threads, "reps": reps, "warmup": warmup, "allocator": alloc}
        with tempfile.TemporaryFile("w+") as err:
            p = subprocess.Popen([sys.executable, "-m", "hvd_compress.tools.bench.micro", "--worker", json.dumps(cfg)],
                                 stdout=subprocess.PIPE, stderr=err, text=True, env={**env, **ALLOCATORS[alloc]})
            for line in p.stdout:
                if not line.startswith("HVDC_MICRO "):
                    continue
                ev = json.loads(line[len("HVDC_MICRO "):])
                if ev["event"] == "row":
                    ev.pop("event")
                    rows.append(ev)
                    done_weight += ev["numel"]
                    prog.step(f"{fw:<10} {ev['device']} {alloc:<7} {human_count(ev['numel']):>4} {ev['scheme']:<24}",
                              f"enc+dec {human_seconds(ev['encode_decode_s']):>9} = {ev['ratio_to_copy']:7.1f}x copy, "
                              f"payload {100 * ev['payload_ratio']:.3g}% of fp32",
                              weight_done=done_weight / total_weight)
                elif ev["event"] == "scheme_error":
                    errors.append(f"{fw} {human_count(ev['numel'])} {ev['scheme']}: {ev['error']}")
                    done_weight += ev["numel"]
                    prog.step(f"{fw:<10} {ev['device']} {human_count(ev['numel']):>4} {ev['scheme']:<24}",
                              f"FAILED: {ev['error']}", weight_done=done_weight / total_weight)
                elif ev["event"] == "error":
                    errors.append(f"{fw}: {ev['error']}")
                    prog.note(f"{fw}: FAILED: {ev['error']}\n{ev.get('traceback', '')}")
            rc = p.wait()
            if rc != 0 and not any(e.startswith(fw) for e in errors):
                err.seek(0)
                tail = err.read()[-3000:]
                errors.append(f"{fw}: worker exited {rc}")
                prog.note(f"{fw}: worker exited {rc}:\n{tail}")
    print(format_table(rows), file=stream)
    if out_json:
        write_json(out_json, rows)
        print(f"wrote {out_json}", file=stream)
    if out_png and rows:
        plot(rows, out_png)
        print(f"wrote {out_png}", file=stream)
    if errors:
        print("FAILED (not in the JSON):\n  " + "\n  ".join(errors), file=stream)
        if strict:
            raise RuntimeError("bench micro: " + "; ".join(errors))
    return Rows(rows, errors)


class Rows(list):
    """The result rows; ``.errors`` lists what failed (framework, size, scheme)."""

    def __init__(self, rows, errors=()):
        super().__init__(rows)
        self.errors = list(errors)


def _cuda_present():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def format_table(rows):
    def target(r):
        t = target_of(r)
        if t is None:
            return ""
        return f"<={t:g}x {'met' if r['ratio_to_copy'] <= t else 'NOT met'}"

    cols = [("framework", lambda r: r["framework"], "<"), ("dev", lambda r: r["device"], "<"),
            ("malloc", allocator_of, "<"),
            ("numel", lambda r: human_count(r["numel"]), ">"), ("scheme", lambda r: r["scheme"], "<"),
            ("enc+dec", lambda r: human_seconds(r["encode_decode_s"]), ">"),
            ("encode", lambda r: human_seconds(r["encode_s"]), ">"),
            ("decode", lambda r: human_seconds(r["decode_s"]), ">"),
            ("copy", lambda r: human_seconds(r["copy_s"]), ">"),
            ("x copy", lambda r: f"{r['ratio_to_copy']:.1f}", ">"),
            ("payload", lambda r: human_bytes(r["payload_bytes"]), ">"),
            ("% fp32", lambda r: f"{100 * r['payload_bytes'] / r['dense_fp32_bytes']:.3g}", ">"),
            ("target (at 16M)", target, "<")]
    return table(rows, cols, title="bench micro: encode + error feedback + decode, one rank, ratio to dst.copy_(src)")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = sorted({(r["framework"], r["device"], allocator_of(r)) for r in rows})
    fig, axes = plt.subplots(len(groups), 1, figsize=(13, 4.2 * len(groups)), squeeze=False)
    for ax, (fw, dev, al) in zip(axes[:, 0], groups):
        sub = [r for r in rows if r["framework"] == fw and r["device"] == dev and allocator_of(r) == al]
        schemes = list(dict.fromkeys(r["scheme"] for r in sub))
        sizes = sorted({r["numel"] for r in sub})
        width = 0.8 / max(len(sizes), 1)
        for j, n in enumerate(sizes):
            vals = []
            for s in schemes:
                m = [r["ratio_to_copy"] for r in sub if r["scheme"] == s and r["numel"] == n]
                vals.append(max(m[0], 1e-2) if m else np.nan)
            ax.bar(np.arange(len(schemes)) + (j - (len(sizes) - 1) / 2) * width, vals, width,
                   label=f"{human_count(n)} elements")
        ax.axhline(10, color="tab:red", ls="--", lw=1, label="target: sparsifiers <= 10x")
        ax.axhline(5, color="tab:purple", ls=":", lw=1, label="target: quantizers <= 5x")
        ax.set_yscale("log")
        labels = []
        for s in schemes:
            pr = [r for r in sub if r["scheme"] == s]
            frac = pr[-1]["payload_bytes"] / pr[-1]["dense_fp32_bytes"] if pr else float("nan")
            labels.append(f"{s}\n{100 * frac:.2g}% bytes")
        ax.set_xticks(np.arange(len(schemes)))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        thr = sub[0].get("threads")
        ax.set_ylabel("encode+EF+decode / copy")
        ax.set_title(f"{fw} on {dev}, {thr or 'default'} thread(s), malloc {al}: cost as multiples of dst.copy_(src)")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker(json.loads(sys.argv[2])))
    print("usage: hvd-compress bench micro ... (this module's own entry is for the worker)", file=sys.stderr)
    sys.exit(2)
