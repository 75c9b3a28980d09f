"""What the example-shaped elastic workers (tests/testing/elastic_example_*.py)
share, framework-free: the membership schedule they drive from inside the
job, and the ledger that checks the conservation law at the end.

Schedule (the host file is what the discovery script prints; rank 0 rewrites
it, so every change lands at a known step):

* phase 0 waits for 3 workers, phase 1 runs ``steps`` steps, then rank 0
  removes the leaving host;
* phase 2 waits for 2 workers, phase 3 runs ``steps``, then rank 0 adds it back;
* phase 4 waits for 3 workers, phase 5 runs ``steps``; then, if the job kills,
  the worker on the leaving host kills itself with SIGKILL before its next
  step, while the others wait for it in that step's exchanges;
* phase 6 waits for 2 workers, phase 7 runs ``steps``; then the job is done.
  Without the kill the job is done after phase 5.  ``kill_only``: phase 1 goes
  straight to phase 6 (no host removed or added, a worker killed).

Ledger: at every commit each rank allgathers (its process id, the float64 sum
of the gradients it computed, its error-feedback residuals with any two-phase
stage-2 chunk folded back), so the records roll back with the state.  With
``op=Sum`` and plain SGD, at the end
``(w0 - w) / lr + survivors' residuals + departed ranks' residuals == sum of all
recorded gradients``, and the departed ranks' residual norm is what the
library reports lost.
"""
import json
import os

import numpy as np

#: phases that wait for a number of workers, and the number
WAITS_FOR = {0: 3, 2: 2, 4: 3, 6: 2}


def hosts_text(staying, leaving, with_leaving):
    return "".join(f"{h}\n" for h in list(staying) + ([f"{leaving}:1"] if with_leaving else []))


def write_hosts(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class MembershipSchedule:
    """The phase machine above; ``state`` carries ``phase``, ``phase_step``
    and ``step`` (Horovod elastic state attributes: synced and rolled back)."""

    def __init__(self, hosts_file, staying, leaving, steps, mode):
        if mode not in ("kill", "nokill", "kill_only"):
            raise ValueError(f"mode must be kill, nokill or kill_only; got {mode!r}")
        self.hosts_file, self.staying, self.leaving = hosts_file, staying, leaving
        self.steps, self.kill, self.kill_only = steps, mode != "nokill", mode == "kill_only"
        self.last_phase = 8 if self.kill else 6

    def done(self, state):
        return state.phase >= self.last_phase

    def killing_now(self, state, host):
        """Whether this worker must die before this step."""
        return self.kill and state.phase == 6 and host == self.leaving

    def advance(self, state, size, rank):
        """After a step: the same decision on every rank."""
        if state.phase in WAITS_FOR:
            if size == WAITS_FOR[state.phase]:
                state.phase, state.phase_step = state.phase + 1, state.step
            return
        if state.step - state.phase_step < self.steps:
            return
        state.phase, state.phase_step = state.phase + 1, state.step
        if self.kill_only and state.phase == 2:
            state.phase = 6
        if rank == 0 and state.phase in (2, 4):
            write_hosts(self.hosts_file, hosts_text(self.staying, self.leaving, with_leaving=state.phase == 4))


def folded(residual, owned, rank, size):
    """``residual`` (flat) with a two-phase stage-2 chunk ``owned`` (chunk
    ``rank`` of ``size``) added at its place; computed here, not by the library."""
    out = np.array(residual, dtype=np.float64).reshape(-1).copy()
    if owned is None:
        return out
    chunk = -(-out.size // size)
    start = min(rank * chunk, out.size)
    stop = min(start + chunk, out.size)
    out[start:stop] += np.asarray(owned, dtype=np.float64).reshape(-1)[:stop - start]
    return out


def tf_folded_residuals(adapter, variables, rank, size):
    """This rank's residual of each TF variable in ``variables`` as ``adapter`` (hvd_compress's
    TF adapter) holds it, its two-phase stage-2 chunk folded in (numpy, flat)."""
    from hvd_compress.adapters.param_state import OWNED_CHUNK_SUFFIX
    out = []
    for v in variables:
        key = adapter.key_of(v)
        r = adapter.residuals.get(key)
        owned = adapter.residuals.get(key + OWNED_CHUNK_SUFFIX) if key is not None else None
        flat = np.zeros(v.shape.num_elements()) if r is None else r.numpy()
        out.append(folded(flat, None if owned is None else owned.numpy(), rank, size))
    return out


def conservation(initial, final, lr, records, members, kind):
    """The checks of one compressed model ``kind``: ``initial``/``final`` are
    its weights (lists of arrays), ``records`` {process id: {kind: {"grads":
    [...], "residuals": [...]}}} at the last commit, ``members`` the process
    ids present then."""
    departed = [pid for pid in records if pid not in members]
    n = len(initial)
    applied = [(np.asarray(w0, np.float64) - np.asarray(w, np.float64)).reshape(-1) / lr
               for w0, w in zip(initial, final)]
    grads = [sum(rec[kind]["grads"][i] for rec in records.values()) for i in range(n)]
    kept = [sum(records[pid][kind]["residuals"][i] for pid in members) for i in range(n)]
    lost = [sum((records[pid][kind]["residuals"][i] for pid in departed), np.zeros_like(applied[i]))
            for i in range(n)]
    return {"conservation_error": max(float(np.abs(a + k + lo - g).max())
                                      for a, k, lo, g in zip(applied, kept, lost, grads)),
            "error_without_lost": max(float(np.abs(a + k - g).max()) for a, k, g in zip(applied, kept, grads)),
            "grad_scale": max(float(np.abs(g).max()) for g in grads),
            "lost_expected_norm": float(np.sqrt(sum(np.square(r).sum() for pid in departed
                                                    for r in records[pid][kind]["residuals"]))),
            "departed": len(departed)}


def print_result(result):
    print("ELASTIC_RESULT " + json.dumps(result), flush=True)


def recording_state(base, allgather_object, process_id, records_of_this_rank, snapshot, put_back):
    """A subclass of Horovod's elastic state class ``base`` whose commits also
    allgather every rank's ``(process_id, records_of_this_rank())`` into
    ``state.records`` / ``state.members`` (kwargs of the state: they roll back
    with it) and keep ``snapshot()`` of this rank's gradient sums, which a
    restore hands to ``put_back``."""

    class RecordingState(base):
        def save(self):
            gathered = allgather_object((process_id, records_of_this_rank()), name="test.records")
            self.records = {**self.records, **dict(gathered)}
            self.members = [pid for pid, _ in gathered]
            self.saved_grads = snapshot()
            super().save()

        def restore(self):
            super().restore()
            put_back(self.saved_grads)

    return RecordingState
