"""The framework adapters' own flow, run on one process without Horovod.

:func:`local_compressor` plugs into a :class:`~hvd_compress.Compressor` an
adapter whose collectives are those of a world of one rank: an allgather or
a sum-allreduce returns its input.  Everything else -- the caller's key,
error feedback (``acc = x + residual``; ``residual = acc - sent``, non-finite
values dropped), step counters, the private random generators, the payload
split into parts, the byte statistics, and on the way back the per-rank
split, ``scheme.aggregate`` / ``decode_reduced`` and the placeholder scaling --
is the code that runs under Horovod (:class:`hvd_compress.adapters.base.AdapterBase`).

So ``out, ctx = comp.compress(x); dense = comp.decompress(out, ctx)`` costs
exactly one rank's encode + error feedback + decode of one payload, minus the
network.
"""
from __future__ import annotations

from ...adapters.base import CallerInfo

BENCH_KEY = "bench.weight"


def _one_rank(collectives_class):
    class OneRank(collectives_class):
        """Collectives of a world of one rank: an allgather or a sum-allreduce returns its input."""

        def allgather(self, tensor, name, process_set):
            return tensor

        def allreduce_sum(self, tensor, name, process_set):
            return tensor

        def wait(self, handle):
            return handle

    return OneRank


def _local_class(base):
    class Local(base):
        key = BENCH_KEY

        def __init__(self):
            super().__init__()
            self.roles.collectives = _one_rank(type(self.roles.collectives))()

        def _caller_info(self, tensor):
            # as under Horovod's optimizer: the gradient is replaced by the result
            return CallerInfo(self.key, None, 0, 1, owns_input=True)

        def _check_fingerprint(self, comp, info):
            return None  # one rank: nobody to compare the configuration with

    Local.__name__ = Local.__qualname__ = "Local" + base.__name__
    return Local


def local_compressor(comp, framework: str):
    """Install a one-rank adapter for ``framework`` ('torch' or 'tensorflow')
    in ``comp`` and return ``comp``."""
    if framework == "torch":
        from ...adapters.torch_adapter import TorchAdapter as base
    elif framework in ("tensorflow", "tf"):
        from ...adapters.tf_adapter import TFAdapter as base
        framework = "tensorflow"
    else:
        raise ValueError(f"unknown framework {framework!r}")
    comp.use_adapter(framework, _local_class(base)())
    return comp
