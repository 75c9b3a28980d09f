"""Test and benchmark helpers: an emulated multi-host cluster (:mod:`hvd_compress.tools.testing.cluster`)
and a tiny Horovod smoke script (``hvd_compress/tools/testing/smoke.py``)."""
