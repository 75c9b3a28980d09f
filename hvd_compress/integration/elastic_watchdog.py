"""A bound on the survivors' reset after a failed worker in elastic Horovod.

After a worker dies, Horovod's ``hvd.elastic.run`` restores the last commit
and resets: ``hvd.shutdown()`` then ``hvd.init()``, which waits for the other
survivors (one of them may first wait out ``HOROVOD_GLOO_TIMEOUT_SECONDS`` in a
receive from the dead worker) and for Gloo's rendezvous.  Nothing in Horovod
bounds that wait as a whole, and a TensorFlow job has been seen never to finish
it.  :class:`ResetWatchdog` bounds it: armed when the state is restored after a
failure, disarmed when the reset has finished (the state's reset callbacks
start); if the bound runs out first, the worker writes one error naming the
cause and the settings, dumps every thread's stack to stderr, and exits with
:data:`EXIT_CODE`, so that the job fails instead of waiting forever.

The bound: ``HVDC_ELASTIC_RESET_TIMEOUT_S`` seconds if set (0: no bound), else
:func:`default_bound_s`: twice ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (Horovod's
default 30 s) plus 60 s -- one Gloo timeout for the slowest survivor to give
up on the dead worker, one for the rendezvous, and a minute for shutdown and
start-up on a loaded machine.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading

#: the exit status of a worker whose reset ran past the bound (EX_TEMPFAIL: retrying may succeed)
EXIT_CODE = 75
#: Horovod 0.28.1's Gloo timeout when ``HOROVOD_GLOO_TIMEOUT_SECONDS`` is unset
HOROVOD_DEFAULT_GLOO_TIMEOUT_S = 30
BOUND_ENV = "HVDC_ELASTIC_RESET_TIMEOUT_S"


def _seconds_from_env(name, default):
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        if float(text) >= 0:
            return float(text)
    except ValueError:
        pass
    raise ValueError(f"{name}={text!r}: must be a number of seconds >= 0")


def gloo_timeout_s():
    return _seconds_from_env("HOROVOD_GLOO_TIMEOUT_SECONDS", HOROVOD_DEFAULT_GLOO_TIMEOUT_S)


def default_bound_s():
    return 2 * gloo_timeout_s() + 60


def bound_s():
    """The bound in seconds (0: none): ``HVDC_ELASTIC_RESET_TIMEOUT_S``, else :func:`default_bound_s`."""
    return _seconds_from_env(BOUND_ENV, default_bound_s())


def stalled_reset_message(bound, gloo_timeout):
    return (f"hvd_compress.elastic: the reset after a failed worker did not finish within {bound:g} s "
            f"({BOUND_ENV}); this worker is stuck in Horovod's shutdown / init or its Gloo rendezvous, "
            f"waiting for a survivor that will not come (stacks below). Ending it with exit code {EXIT_CODE} "
            f"so that the job fails instead of hanging. A healthy reset takes about HOROVOD_GLOO_TIMEOUT_SECONDS "
            f"({gloo_timeout:g} s now) plus start-up: set HOROVOD_GLOO_TIMEOUT_SECONDS at least as long as a "
            f"worker takes to start, and {BOUND_ENV} above twice that (0 turns this bound off).")


class ResetWatchdog:
    """One per process: :meth:`arm` after a restore, :meth:`disarm` when the reset is done."""

    def __init__(self, bound=None, exit_fn=os._exit, stream=None):
        #: seconds, or None: read from the environment at each arm (:func:`bound_s`)
        self.bound = bound
        self._exit, self._stream = exit_fn, stream
        self._timer = None
        self._lock = threading.Lock()

    @property
    def armed(self):
        return self._timer is not None

    def arm(self):
        """Start the clock (again, if it ran): the reset must finish within the bound."""
        bound = bound_s() if self.bound is None else self.bound
        if not bound:
            return
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(bound, self._expire, args=(bound,))
            self._timer.daemon = True
            self._timer.start()

    def disarm(self):
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _expire(self, bound):
        stream = self._stream or sys.stderr
        stream.write(stalled_reset_message(bound, gloo_timeout_s()) + "\n")
        stream.flush()
        try:
            faulthandler.dump_traceback(file=stream, all_threads=True)
        except (ValueError, OSError, AttributeError):  # a stream without a file descriptor
            pass
        self._exit(EXIT_CODE)
