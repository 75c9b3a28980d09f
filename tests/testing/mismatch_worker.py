"""Worker of tests/testing/test_mismatch.py; runs under ``horovodrun -np 2``.

    python mismatch_worker.py --framework torch|tf --kinds same,scheme,ratio,...

For each kind, in order, every rank builds a compressor (and a model) that
differs from the other ranks' in exactly that respect, runs one training step
through the stock Horovod API (torch: ``hvd.DistributedOptimizer`` and
``loss.backward()`` + ``opt.step()``; TF: ``hvd.DistributedGradientTape``
inside a ``tf.function``) and prints one line per kind::

    HVDC_MISMATCH {"kind": ..., "rank": ..., "raised": <exception type or null>,
                   "message": ..., "seconds": ...}

``same`` is the control: identical configurations must train without error.
With ``--result-dir DIR`` each record is also appended to ``DIR/rank<R>.jsonl``
(mpirun interleaves the ranks' stdout, so parsing stdout is not reliable).
A watchdog thread ends the process with exit code 3 (printing
``HVDC_MISMATCH_TIMEOUT <kind>``) if one kind takes longer than
``--kind-timeout`` seconds: a hang is reported as a failure, never waited out.

Each mismatch is raised by the fingerprint collective, which completes on all
ranks before anything else of that compressor is exchanged, so Horovod is left
in a clean state and the next kind can run in the same process.
"""
import argparse
import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import hvd_compress  # noqa: E402
from hvd_compress import Policy, Rule  # noqa: E402
from hvd_compress.integration.fingerprint import ConfigMismatchError  # noqa: E402

KINDS = ["same", "scheme", "ratio", "seed", "error_feedback", "policy", "params", "shapes"]


def compressor_for(kind, rank):
    """The compressor this rank builds for ``kind`` (rank 0's is the same for every kind)."""
    other = rank != 0
    if kind == "scheme":
        return hvd_compress.Int8() if other else hvd_compress.TopK(0.01)
    if kind == "ratio":
        return hvd_compress.TopK(0.02 if other else 0.01)
    if kind == "seed":
        return hvd_compress.QSGD(16, seed=1 if other else 0)
    if kind == "error_feedback":
        return hvd_compress.TopK(0.01, error_feedback=not other)
    if kind == "policy":
        small = hvd_compress.FP16() if other else hvd_compress.none()
        return Policy([Rule(name=["*bias*"], compression=small)], default=hvd_compress.TopK(0.01))
    if kind == "seed-policy":
        return Policy([Rule(max_numel=64, compression=hvd_compress.none())], default=hvd_compress.Int8(),
                      seed=1 if other else 0)
    return hvd_compress.TopK(0.01)


def shapes_for(kind, rank):
    """{parameter name: shape}; ``params``: rank 1 has one more; ``shapes``: one differs."""
    shapes = {"layer.weight": (32, 16), "layer.bias": (32,)}
    if kind == "params" and rank != 0:
        shapes["extra.weight"] = (8, 4)
    if kind == "shapes" and rank != 0:
        shapes["layer.weight"] = (16, 32)
    return shapes


# --- frameworks ------------------------------------------------------------------------------------------------
class TorchStep:
    def __init__(self):
        import horovod.torch as hvd
        import torch
        self.hvd, self.torch = hvd, torch
        hvd.init()
        self.rank = hvd.rank()
        self.mismatch_types = (ConfigMismatchError,)

    def run(self, kind):
        torch, hvd = self.torch, self.hvd
        params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in shapes_for(kind, self.rank).items()}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params.values(), lr=0.1), named_parameters=params.items(),
                                       compression=compressor_for(kind, self.rank))
        gen = torch.Generator().manual_seed(self.rank)
        loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params.values())
        loss.backward()
        opt.step()
        return float(params["layer.bias"].detach().abs().sum())


class TFStep:
    def __init__(self):
        import horovod.tensorflow as hvd
        import tensorflow as tf
        self.hvd, self.tf = hvd, tf
        hvd.init()
        self.rank = hvd.rank()
        self.mismatch_types = (ConfigMismatchError,)

    def run(self, kind):
        tf, hvd = self.tf, self.hvd
        variables = [tf.Variable(tf.zeros(s), name=n.replace(".", "_"))
                     for n, s in shapes_for(kind, self.rank).items()]
        comp = compressor_for(kind, self.rank)
        grads_in = [tf.random.stateless_normal(v.shape, seed=(self.rank, i)) for i, v in enumerate(variables)]

        @tf.function
        def step(gs):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, gs)])
            tape = hvd.DistributedGradientTape(tape, compression=comp)
            grads = tape.gradient(loss, variables)
            for v, g in zip(variables, grads):
                v.assign_sub(0.1 * g)
            return loss

        step(grads_in)
        return float(tf.reduce_sum(tf.abs(variables[1])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=["torch", "tf"], required=True)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--kind-timeout", type=float, default=90.0)
    ap.add_argument("--result-dir", default=None, help="also append each record to DIR/rank<R>.jsonl")
    args = ap.parse_args()
    fw = TorchStep() if args.framework == "torch" else TFStep()
    current = {"kind": None, "since": time.monotonic()}

    def watchdog():
        while True:
            time.sleep(0.5)
            if current["kind"] and time.monotonic() - current["since"] > args.kind_timeout:
                print(f"HVDC_MISMATCH_TIMEOUT {current['kind']}", flush=True)
                if args.result_dir:
                    with open(os.path.join(args.result_dir, f"rank{fw.rank}.jsonl"), "a") as f:
                        f.write(json.dumps({"timeout": current["kind"], "rank": fw.rank}) + "\n")
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    for kind in args.kinds.split(","):
        current.update(kind=kind, since=time.monotonic())
        t0 = time.monotonic()
        raised, message = None, ""
        try:
            fw.run(kind)
        except Exception as e:  # noqa: BLE001 - the type is what we report
            raised, message = type(e).__name__, str(e)
            if not isinstance(e, fw.mismatch_types):
                message = f"{type(e).__module__}.{type(e).__qualname__}: {e}"
        current["kind"] = None
        line = json.dumps({"kind": kind, "rank": fw.rank, "raised": raised, "message": message[:4000],
                           "seconds": round(time.monotonic() - t0, 3)})
        print("HVDC_MISMATCH " + line, flush=True)
        if args.result_dir:
            with open(os.path.join(args.result_dir, f"rank{fw.rank}.jsonl"), "a") as f:
                f.write(line + "\n")
    print(f"HVDC_MISMATCH_DONE {fw.rank}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
