"""What the torch and TF training tests share (test_training_torch.py,
test_training_tf.py): the schedules they run, their numpy reference, and the
tolerance check.  Not a test file (scripts/run_tests.sh launches only
``test_*.py``); it imports neither framework."""
import numpy as np

from compression_cases import ref, tolerance

import hvd_compress as hc
from hvd_compress import Schedule

f32 = np.float32

SCHED_SPECS = {"w": (40, 25), "b": (100,)}


def assert_close(sid, got, want, what):
    want = np.asarray(want, f32).reshape(-1)
    np.testing.assert_allclose(np.asarray(got).reshape(-1), want, **tolerance(sid, want), err_msg=what)


def explicit_schedule():
    return Schedule([(0, hc.none()), (3, hc.TopK(0.25)), (6, hc.TopK(0.01))])


def dgc_warmup_schedule():
    # dense for 2 communications, then 25%, 5%, 1% for 2 each
    return Schedule.dgc_warmup(warmup_steps=2, steps_per_stage=2, final_ratio=0.01, start_ratio=0.25, factor=5.0)


def phase_table(sched):
    """[(start, scheme name, scheme config, error feedback)] from the schedule's phases."""
    return [(start, c.scheme.name, c.scheme.config(), c.error_feedback) for start, c in sched.phases]


def schedule_reference(table, grads, op="average"):
    """grads[step][rank] -> (aggregated per step, payload bytes per step (this rank), final
    residual per rank).  Phase of communication c (0-based): the last phase starting at or
    before c; the residual is kept per tensor across phases (a phase without error feedback
    neither uses nor changes it)."""
    size = len(grads[0])
    residual = [np.zeros_like(grads[0][0]) for _ in range(size)]
    agg, nbytes = [], []
    for c, per_rank in enumerate(grads):
        _, name, cfg, ef = [p for p in table if p[0] <= c][-1]
        sents = []
        for r, g in enumerate(per_rank):
            acc = (g + residual[r]).astype(f32) if ef else g
            s = ref.sent(name, cfg, acc)
            if ef:
                residual[r] = (acc - s).astype(f32)
            sents.append(s)
        agg.append(ref.op_scale(name, ref.aggregate(name, sents), size, op))
        nbytes.append((name, ref.payload_bytes(name, cfg, grads[0][0].size)))
    return agg, nbytes, residual
