"""The bound on the survivors' reset after a failed worker
(hvd_compress/integration/elastic_watchdog.py): it ends a stuck worker with
its error and exit code, stays quiet when the reset finishes, reads its bound
from the environment, and is armed only by a restore after a failed collective.
The kill on the emulated cluster: scripts/elastic_kill_bound.py --stall-reset."""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from horovod.common.exceptions import HorovodInternalError

from hvd_compress.integration import elastic
from hvd_compress.integration.elastic_watchdog import EXIT_CODE, ResetWatchdog, bound_s

REPO = Path(__file__).resolve().parents[2]


def _watchdog(bound):
    exited, stream = threading.Event(), io.StringIO()
    codes = []

    def exit_fn(code):
        codes.append(code)
        exited.set()

    return ResetWatchdog(bound, exit_fn=exit_fn, stream=stream), exited, codes, stream


def test_a_reset_past_the_bound_ends_the_worker_naming_the_settings():
    dog, exited, codes, stream = _watchdog(0.05)
    dog.arm()
    assert exited.wait(10)
    assert codes == [EXIT_CODE]
    message = stream.getvalue()
    assert "did not finish within 0.05 s" in message
    assert "HVDC_ELASTIC_RESET_TIMEOUT_S" in message and "HOROVOD_GLOO_TIMEOUT_SECONDS" in message


def test_a_reset_that_finishes_ends_nothing():
    dog, exited, codes, _ = _watchdog(0.5)
    dog.arm()
    dog.disarm()
    assert not exited.wait(1.0)
    assert codes == [] and not dog.armed


@pytest.mark.parametrize("env, expected", [
    ({}, 120.0),  # Horovod's Gloo default, 30 s: 2 * 30 + 60
    ({"HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}, 300.0),
    ({"HOROVOD_GLOO_TIMEOUT_SECONDS": "120", "HVDC_ELASTIC_RESET_TIMEOUT_S": "45"}, 45.0),
    ({"HVDC_ELASTIC_RESET_TIMEOUT_S": "0"}, 0.0),
])
def test_the_bound_follows_the_gloo_timeout_unless_set(monkeypatch, env, expected):
    for name in ("HOROVOD_GLOO_TIMEOUT_SECONDS", "HVDC_ELASTIC_RESET_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert bound_s() == expected


def test_a_malformed_bound_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("HVDC_ELASTIC_RESET_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="HVDC_ELASTIC_RESET_TIMEOUT_S='soon'.*seconds >= 0"):
        bound_s()


def test_no_bound_arms_nothing():
    dog, _, _, _ = _watchdog(0)
    dog.arm()
    assert not dog.armed


def test_only_a_restore_after_a_failed_collective_arms_the_bound(monkeypatch):
    dog, _, _, _ = _watchdog(3600)
    monkeypatch.setattr(elastic, "_RESET_WATCHDOG", dog)
    elastic.watch_reset_after_failure()  # a restore of the user's own
    assert not dog.armed
    try:
        raise HorovodInternalError("peer gone")
    except HorovodInternalError:
        elastic.watch_reset_after_failure()  # as in Horovod's run: inside the handler
    assert dog.armed
    dog.disarm()


def test_in_a_real_process_the_worker_exits_with_the_code_and_its_stacks():
    script = textwrap.dedent("""
        import time
        from hvd_compress.integration.elastic_watchdog import ResetWatchdog
        ResetWatchdog(0.3).arm()
        time.sleep(60)
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == EXIT_CODE, p.stderr
    assert "did not finish within 0.3 s" in p.stderr
    assert "time.sleep" in p.stderr or "<string>" in p.stderr  # the main thread's stack
