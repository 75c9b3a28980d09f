"""Fixtures shared by the emulated-cluster tests of this folder."""
import os

import pytest


@pytest.fixture(scope="module")
def need_root():
    """The emulated cluster is made of network namespaces, which need root.  Without it the
    module is skipped, except under CI (``CI`` set), where a skip would hide the tests."""
    if os.geteuid() != 0:
        msg = "emulated-cluster tests need root (network namespaces); run them as root"
        if os.environ.get("CI"):
            pytest.fail(msg + " -- CI is set, so this is a failure, not a skip", pytrace=False)
        pytest.skip(msg)
