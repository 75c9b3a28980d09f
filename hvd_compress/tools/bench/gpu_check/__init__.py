"""One-shot CUDA check of every scheme: correctness, host syncs, speed.

Run it with ``bash scripts/gpu_check.sh [--out DIR]`` on a machine with a CUDA
GPU and PyTorch.  It needs nothing but this repository and ``python3`` with
``torch``: no network, no Horovod build; TensorFlow and ``zstandard`` are used
when importable and the parts that need them are skipped, with the reason
printed, when not.  Three parts, each reported on stdout and in
``gpu_check.json``:

1. **correctness** -- every scheme's encode, error feedback and decode on the
   device under test against the reference (``cpu``, one thread):

   * *same draws*: two ranks, three steps, error feedback on, tie-free
     inputs (every ``|x|`` distinct), and the random draws of the stochastic
     schemes (``ctx.uniform``, Random-K's indices, PowerSGD's initial Q) made
     on the host and handed to both sides.  Every payload part, every new
     residual and the aggregate over both ranks must be **bit-identical** for
     the element-wise schemes; schemes with a float reduction (QSGD's norm,
     EF-signSGD's and 1-bit SGD's means) may differ by float noise of the scale
     on a handful of elements; PowerSGD (matmul + QR) to a relative 1e-4;
     Top-K reports a mismatch as a *tie* only where the reference has equal
     magnitudes at the k-th place.
   * *own generators*: QSGD, TernGrad, Random-K and DGC with the backend's
     real random generators on each side (different seeds on the two sides):
     per-element means and variances, the level histogram, Random-K's
     selection counts and DGC's kept counts must agree within statistical
     tolerances; decode(encode) must equal the encoder's ``sent`` exactly on
     the device; ``B.uniform`` must be U[0,1) and reproducible by seed.
   * TensorFlow (optional): the *same draws* check of TF on its device
     against the torch reference.

2. **sync** -- every scheme's hot path (encode with error feedback, and the
   aggregate of two ranks' payloads; and the whole one-rank compressor, as
   ``bench micro`` times it) under ``torch.cuda.set_sync_debug_mode("error")``;
   where it raises, the same path is run again in ``"warn"`` mode and every
   synchronizing call is listed with its ``hvd_compress`` call chain.

3. **micro** -- :mod:`hvd_compress.tools.bench.micro` (unchanged: encode + error
   feedback + decode, interleaved with ``dst.copy_(src)`` into a preallocated
   buffer of the same device, ``torch.cuda.synchronize()`` after each, medians)
   on CUDA at 16M and 256M elements, written to ``micro_cuda.json`` in bench
   micro's own format, plus the quantizers with error feedback forced on.  The
   speed targets are judged at 256M: encode+decode+EF <= 8x the copy for
   Top-K/DGC, <= 4x for quantizers.

**CPU fallback** (``--cpu-fallback``, automatic without CUDA): the same code
at small sizes, with the device under test being the CPU with several threads
(reductions may split differently), the sync part replaced by a run with every
tensor-to-host conversion (``.item()``, ``.cpu()``, ``.tolist()``,
``.numpy()``, ``bool/int/float``) recorded -- which cannot see syncs hidden in
kernels with data-dependent output sizes (``nonzero``, ``unique``) -- and the
micro benchmark at small sizes on the CPU, written to
``micro_cpu_fallback.json`` (never ``micro_cuda.json``).

Modules, one a check family around the one case loop
(:func:`~hvd_compress.tools.bench.gpu_check.catalogue.each_case`):
:mod:`.catalogue` (the cases: every registered example, their comparison
rules, known syncs, targets), :mod:`.sides` (the devices compared and one run
of a case), :mod:`.same_draws` (1a, 1c), :mod:`.generators` (1b), :mod:`.sync`
(2), :mod:`.speed` (3) and :mod:`.driver` (the command line).

Exit status: 0 when every correctness check passes, 1 otherwise (2 for a usage
error).  Syncs and missed speed targets are reported, not failed on, unless
``--strict``.
"""
from .catalogue import (CUDA_DEVICE, EF_SPECS, KNOWN_SYNCS, TARGET_NUMEL, TARGETS, _has, cases,  # noqa: F401
                        comparison_rule, each_case, is_variable_size, sync_specs)
from .driver import environment, main  # noqa: F401
from .generators import (check_dgc_distribution, check_own_generators, check_quantizer_distribution,  # noqa: F401
                         check_randomk_distribution, check_uniform)
from .same_draws import check_same_draws, compare, compare_runs  # noqa: F401
from .sides import TFSide, TorchSide, run_case, run_powersgd, tie_free  # noqa: F401
from .speed import copy_with_events, judge_targets, micro_specs, run_micro, target_of  # noqa: F401
from .sync import check_host_reads_cpu, check_sync_cuda  # noqa: F401
