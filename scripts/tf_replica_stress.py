"""Stress the cross-rank identity of TF replicas: one linear model per scheme, all
trained in one tf.function through the stock ``hvd.DistributedGradientTape``, and
after every step the weights of every replica are gathered and compared bit for bit.

    horovodrun -np 3 -H localhost:3 --gloo python scripts/tf_replica_stress.py [--steps 120] [--schemes A,B]

Prints, on rank 0, the first step at which each scheme's replicas differed (an
empty dict when none did) and exits 1 if any did.  docs/design/reliability.md quotes what
it finds with the backend's sum over a stacked axis and with a chain of adds in its place.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "horovod"), os.path.join(HERE, "..", "tests")]
from compression_cases import TRAIN_IDS  # noqa: E402
from tf_linear_training import LinearTraining  # noqa: E402

DEFAULT = "NoCompression,FP16,BF16,Int8,Int8-block64,QSGD16,TernGrad,SignSGD,Lossless"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--schemes", default=DEFAULT, help=f"comma-separated, from {','.join(TRAIN_IDS)}")
    a = ap.parse_args()
    ids = a.schemes.split(",")
    unknown = sorted(set(ids) - set(TRAIN_IDS))
    if unknown:
        ap.error(f"--schemes: unknown {unknown}; allowed: {','.join(TRAIN_IDS)}")
    hvd.init()
    run = LinearTraining(ids)

    def differing(tag):
        everyone = run.everyone(f"stress.{tag}")
        return [ids[i] for i in range(len(ids))
                if any(not np.array_equal(everyone[r, i], everyone[0, i]) for r in range(run.size))]

    first = {sid: -1 for sid in differing("init")}
    for step in range(a.steps):
        run.step(step)
        for sid in differing(step):
            first.setdefault(sid, step)
    if run.rank == 0:
        print(f"first step at which replicas differed ({a.steps} steps, {run.size} ranks): {first}", flush=True)
    sys.exit(1 if first else 0)


if __name__ == "__main__":
    main()
