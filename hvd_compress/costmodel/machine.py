"""The machine a rank runs on, as the cost model needs it: which ranks share
one machine's cores.  Horovod's ``local_size`` counts the ranks it placed on a
host *name*; ranks in containers or network namespaces of one machine have
names of their own but share its kernel and its cores, so the ranks' kernel
boot ids (gathered by a collective in :mod:`hvd_compress.auto`) say which
share."""
from __future__ import annotations

from typing import Optional

from .model import CORE_WAIT_S, Link, Machine, shared_host


def kernel_id() -> int:
    """This process's operating-system kernel as a 63-bit integer: the hash of
    its boot id (``/proc/sys/kernel/random/boot_id``), which every container
    and network namespace on one machine shares, so ranks that Horovod counts
    on different hosts (``local_size`` 1 each) but that share one machine's
    cores show the same id; the host name where there is no boot id."""
    import socket
    from ..cross_rank import stable_hash
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return stable_hash("boot", f.read().strip())
    except OSError:
        return stable_hash("host", socket.gethostname())


def usable_cpus() -> Optional[int]:
    """The cores this process may run on (its affinity mask; ``os.cpu_count()``
    where the platform has none)."""
    import os
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def machine_of(kernel_ids, local_size, cpus) -> Machine:
    """The host as the cost model sees it from every rank's :func:`kernel_id`
    (a collective gathers them): the most ranks that share one kernel (never
    fewer than Horovod's ``local_size``) sharing ``cpus`` cores
    (:func:`hvd_compress.costmodel.model.shared_host`).  A ring waits for its slowest member, so the most
    crowded machine sets the pace.  No wait for a core is added: ``Auto`` fits the link to
    allreduces timed on those shared cores, so its latency per ring step already holds it."""
    from collections import Counter
    busiest = max(Counter(int(i) for i in kernel_ids).values(), default=1)
    return shared_host(max(int(local_size or 1), busiest), cpus, core_wait_s=0.0)


def with_wait_floor(link: Link, machine: Machine, workers: int) -> Link:
    """``link`` (fitted to allreduces timed on ``machine``) with a latency per
    ring step of at least the cost model's wait for a core there
    (:data:`~hvd_compress.costmodel.model.CORE_WAIT_S` per runnable task beyond one
    a core).  On ranks sharing cores the probes' times scatter by more than
    their latency, and a least-squares intercept of 0 would make every extra
    round look free: measured at N = 4 on 2 cores, a fit of 0 us led Auto to
    add a two-phase round for three small tensors."""
    if not machine.cpus:
        return link
    from dataclasses import replace
    floor = replace(machine, core_wait_s=CORE_WAIT_S).step_wait_s(workers)
    return link if link.latency_s >= floor else Link(floor, link.bytes_per_s)


def this_rank(local_size) -> list:
    """What :func:`agreed_machine` needs of this rank (a collective gathers
    it): its kernel id, its usable cores and Horovod's ``local_size``."""
    return [kernel_id(), usable_cpus() or 0, int(local_size or 1)]


def agreed_machine(rows) -> Machine:
    """:func:`machine_of` from every rank's :func:`this_rank` (``rows``,
    gathered: the same on every rank), with the largest ``local_size`` and
    the fewest cores any rank has, so that every rank sees the same machine
    (its probe sizes depend on it, and the probes' collective names on them)."""
    cpus = min((int(r[1]) for r in rows if int(r[1]) > 0), default=None)
    return machine_of([int(r[0]) for r in rows], max((int(r[2]) for r in rows), default=1), cpus)
