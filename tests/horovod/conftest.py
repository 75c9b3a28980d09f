"""Tests here run inside `horovodrun -np N` (see scripts/run_tests.sh).

Each rank writes its own junit report: the path given with --junitxml may
contain %RANK%, replaced here by this process's Horovod rank.
"""
import os

import pytest

RANK = next((os.environ[v] for v in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK") if v in os.environ), None)


def pytest_configure(config):
    xml = getattr(config.option, "xmlpath", None)
    if xml and "%RANK%" in xml:
        config.option.xmlpath = xml.replace("%RANK%", RANK or "x")


def pytest_collection_modifyitems(config, items):
    if RANK is None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason="runs only under horovodrun (scripts/run_tests.sh)"))
