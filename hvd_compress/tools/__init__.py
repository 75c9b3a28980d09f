"""Tooling around the library, kept out of ``import hvd_compress``:

* :mod:`hvd_compress.tools.bench` -- micro and end-to-end benchmarks, the GPU check;
* :mod:`hvd_compress.tools.advise` -- the cost model behind ``hvd-compress advise``;
* :mod:`hvd_compress.tools.cli` -- the ``hvd-compress`` console script;
* :mod:`hvd_compress.tools.metrics` -- compression loggers for training scripts;
* :mod:`hvd_compress.tools.testing` -- the emulated multi-host cluster and a smoke script;
* :mod:`hvd_compress.tools.units` -- parsers of counts and link rates shared by the above.

The dependency runs one way: these import the library, the library never
imports them (tests/unit/test_packaging.py checks both).
"""
