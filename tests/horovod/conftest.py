"""Tests here run inside `horovodrun -np N` (see scripts/run_tests.sh).

Each rank writes its own junit report: the path given with --junitxml may
contain %RANK%, replaced here by this process's Horovod rank.
"""
import os
import sys

import pytest

# Open MPI busy-polls while it waits; with more ranks than free cores (np=3 on a
# 2-core CI machine) every collective then costs scheduler time slices (measured:
# 65 ms an allreduce at np=3, 2 ms with yielding).  MPI_Init runs inside
# hvd.init() in this process, so setting the MCA parameter here is in time; a
# value given by the caller wins.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

RANK = next((os.environ[v] for v in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK") if v in os.environ), None)


def pytest_configure(config):
    xml = getattr(config.option, "xmlpath", None)
    if xml and "%RANK%" in xml:
        config.option.xmlpath = xml.replace("%RANK%", RANK or "x")


def pytest_collection_modifyitems(config, items):
    if RANK is None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason="runs only under horovodrun (scripts/run_tests.sh)"))


def pytest_sessionfinish(session, exitstatus):
    """Wait for every rank before this one exits.

    A rank's exit shuts Horovod down on every rank (its shutdown flag is shared in the
    next negotiation).  A rank that runs none of a file's collectives -- the rank left
    out of test_process_set_torch.py's set -- would otherwise finish first and make the
    set's ranks fail every test still running with "Process set provided does not
    exist" (ranks 0 and 1 of the np=3 MPI launch failed 9 of 9 that way).  One
    collective on the global set holds each rank here until all have arrived."""
    for module, zeros in (("horovod.torch", _torch_zeros), ("horovod.tensorflow", _tf_zeros)):
        hvd = sys.modules.get(module)
        if hvd is None or not hvd.is_initialized() or hvd.size() < 2:
            continue
        try:
            hvd.allreduce(zeros(), name="tests.session_end")
        except Exception as e:  # Horovod already shut down (a failed test): nothing to wait for
            print(f"rank {RANK}: no wait at the end of the session: {type(e).__name__}: {e}")


def _torch_zeros():
    import torch
    return torch.zeros(1)


def _tf_zeros():
    import tensorflow as tf
    return tf.zeros([1])
