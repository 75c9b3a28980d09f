"""Binding each rank of a benchmark to one core.

The emulated cluster runs its hosts' ranks on the one machine's cores, more ranks than cores.
Left to the scheduler, a rank and its Horovod and Gloo threads move between cores, and a
synchronous step waits for whichever rank is off its core.  On the 2-core machine, one seed of
the PyTorch CNN at 4 ranks took 42-116 ms a step over seven runs left to the scheduler, and
32-38 ms over three with rank ``r`` bound to core ``r mod cores`` (threads inherit it):
``hvd-compress bench noise``, docs/results/benchmarks.md, 'What this machine can tell apart'.
A real cluster gives each rank its own device or cores; binding is the nearer emulation of it.

A worker calls :func:`pin_rank_to_core` before it imports a framework or Horovod: the threads
it has then are bound, and every thread started later inherits the binding.
"""
from __future__ import annotations

import os

#: where a launcher puts the global rank: horovodrun (Gloo), Open MPI, MPICH / Intel MPI
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def rank_from_env(env=None) -> int:
    """This process's global rank, as its launcher set it."""
    env = os.environ if env is None else env
    for name in RANK_VARIABLES:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    raise ValueError(f"pin_cores: no rank in the environment (none of {', '.join(RANK_VARIABLES)} is set); "
                     "launch the worker with horovodrun or mpirun")


def core_for(rank: int, cores) -> int:
    """The core rank ``rank`` is bound to: the ``rank mod len(cores)``-th of ``cores``, in order."""
    cores = sorted(cores)
    if not cores:
        raise ValueError("pin_cores: this process may run on no core")
    return cores[rank % len(cores)]


def add_worker_argument(parser):
    """A benchmark worker's ``--pin-cores``: :func:`pin_if_asked` binds the rank when given."""
    parser.add_argument("--pin-cores", action="store_true", help="bind rank r to core r mod cores, before "
                        "anything starts a thread (hvd_compress/tools/bench/pinning.py)")


def add_driver_argument(parser):
    """A benchmark's ``--no-pin-cores``: its workers are bound unless it is given."""
    parser.add_argument("--no-pin-cores", action="store_true", help="leave the ranks to the scheduler instead "
                        "of binding rank r to core r mod cores (hvd_compress/tools/bench/pinning.py)")


def worker_arguments(pin_cores) -> list:
    """What a benchmark driver adds to its worker's command line: ``--pin-cores`` where it binds."""
    return ["--pin-cores"] if pin_cores else []


def pin_if_asked(args):
    """Bind this rank (:func:`pin_rank_to_core`) where the worker's ``args`` ask for it."""
    if args.pin_cores:
        pin_rank_to_core()


def pin_rank_to_core(env=None) -> int:
    """Bind this process to its rank's core, among the cores it may run on now: every thread
    it has (an imported library may have started some) and so every thread it starts from now
    on; return that core."""
    core = core_for(rank_from_env(env), os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})
    return core
