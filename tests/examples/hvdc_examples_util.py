"""Helpers for the example tests: run a command under `horovodrun -np 2` on localhost.
(Not named conftest.py: tests/horovod/ has one, and both would be module `conftest`.)"""
import os
import re
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)
HOROVODRUN = os.path.join(VENV_BIN, "horovodrun")
_PREFIX = re.compile(r"\[\d+(?:,\d+)?\]<std(?:out|err)>:")


def env():
    e = dict(os.environ)
    e.update(TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0",
             PYTHONPATH=REPO + os.pathsep + e.get("PYTHONPATH", ""))
    return e


def horovodrun(args, np_=2, timeout=600, controller="gloo"):
    """Run ``python args...`` on np_ local ranks; return (exit code, output
    with the rank prefixes removed, seconds)."""
    cmd = [HOROVODRUN, f"--{controller}", "-np", str(np_), "-H", f"localhost:{np_}", sys.executable] + list(args)
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    out = _PREFIX.sub("", p.stdout)
    return p.returncode, out, time.monotonic() - t0


def require_horovodrun():
    if not os.path.exists(HOROVODRUN):
        pytest.fail(f"{HOROVODRUN} is missing: run scripts/install.sh")
