"""The ``hvd-compress`` console script.

    hvd-compress bench micro [--sizes 1M,16M,64M] [--frameworks torch,tf] [--threads 1] ...
    hvd-compress bench e2e   [--params 16M] [--hosts 2] [--rates none,1000,100] [--schemes ...] ...
    hvd-compress bench scale [--workers 2,4,8] [--rates 100,1000] [--params 4M] [--schemes ...] ...
    hvd-compress bench breakdown [--schemes "none,TopK(0.01)"] [--rates none,1000,100] [--out ...]
    hvd-compress bench link-change [--recheck-every 10] [--steps 40] [--change-at 10] [--out ...]
    hvd-compress bench tta   [--model cnn|transformer|charlm] [--framework torch|tensorflow] [--seeds 1,2,3] ...
    hvd-compress bench noise [--results docs/results]
    hvd-compress advise      [--params 110M | --layers sizes.json | --torch-model mod:fn] ...
    hvd-compress advise --worked-example
    hvd-compress advise --validate docs/results/e2e.json

See docs/results/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import sys

from .bench.pinning import add_driver_argument as pin_driver_argument

#: where ``bench`` writes its JSON by default: docs/results of the checkout this package runs from
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "results")


def _env():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


def _add_cluster_studies(bsub):
    """``bench breakdown`` and ``bench link-change``: single studies on the emulated cluster."""
    bd = bsub.add_parser("breakdown", help="where a step's time goes per link: clocked parts and Horovod's "
                         "timeline (root)", description="Each timed step's parts clocked on every rank (forward, "
                         "backward, encode, waits, decode, update) and Horovod's timeline (negotiation, "
                         "execution, cycles), per scheme and link, 2 hosts of the emulated cluster.")
    from .bench.breakdown import add_arguments as breakdown_arguments
    breakdown_arguments(bd)

    lc = bsub.add_parser("link-change", help="Auto() when the link drops mid-run, against TopK(0.01) (root)",
                         description="Auto(recheck_every=R), TopK(0.01) and none on 2 hosts of the emulated "
                         "cluster whose link drops from unshaped to --rate before timed step --change-at; checks "
                         "that Auto re-checks within R steps and then runs within 1.2x of TopK(0.01).")
    from .bench.link_change import add_arguments as link_change_arguments
    link_change_arguments(lc)


def build_parser():
    ap = argparse.ArgumentParser(prog="hvd-compress", description="Measure gradient compression honestly "
                                 "and predict whether it pays.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    bench = sub.add_parser("bench", help="measure: micro (encode/decode cost) or e2e (training steps on the "
                           "emulated cluster)")
    bsub = bench.add_subparsers(dest="bench", required=True)

    m = bsub.add_parser("micro", help="encode + error feedback + decode cost of every scheme, in copies",
                        description="Encode + error feedback + decode time of every scheme on one tensor, as a "
                        "ratio to dst.copy_(src) of the same tensor measured in the same run.")
    m.add_argument("--schemes", help="comma-separated specs, e.g. 'TopK(0.01),Int8,hvd_fp16' (default: every "
                   "scheme)")
    m.add_argument("--sizes", default="1M,16M,64M", help="tensor sizes in elements (default %(default)s)")
    m.add_argument("--frameworks", default="torch,tf", help="torch, tf or both (default %(default)s)")
    m.add_argument("--devices", default="cpu,cuda", help="cpu and/or cuda (cuda only where present)")
    m.add_argument("--threads", type=int, default=1, help="intra-op threads (torch.set_num_threads, TF intra/"
                   "inter-op); 0 = framework default (default %(default)s)")
    m.add_argument("--reps", type=int, default=5, help="timed repetitions (median; default %(default)s)")
    m.add_argument("--warmup", type=int, default=1)
    m.add_argument("--out", default=os.path.join(RESULTS, "micro.json"), help="JSON (default %(default)s)")
    m.add_argument("--png", default=None, help="plot (default: the JSON path with .png)")
    m.add_argument("--allocators", default="default",
                   help="comma list of glibc malloc settings to repeat the run under: default, no-mmap "
                        "(MALLOC_MMAP_MAX_=0; see docs/results/benchmarks.md) (default %(default)s)")
    m.add_argument("--quiet", action="store_true", help="no progress lines")

    e = bsub.add_parser("e2e", help="training steps under horovodrun on the emulated cluster (root)",
                        description="Median step time, speedups and bytes (at the Horovod call and on the "
                        "wire) of a communication-bound model on the emulated cluster at several link rates.")
    e.add_argument("--framework", default="torch", choices=["torch", "tensorflow", "tf"])
    e.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    e.add_argument("--params", default="16M", help="parameter count (default %(default)s)")
    e.add_argument("--hosts", type=int, default=2)
    e.add_argument("--workers", type=int, default=None, help="ranks (default: one per host)")
    e.add_argument("--rates", default="none,1000,100", help="link rates in Mbit/s, 'none' = unshaped "
                   "(default %(default)s)")
    e.add_argument("--schemes", default="none,hvd_fp16,TopK(0.01),Int8,EFSignSGD,FP16,DGC(0.01)",
                   help="'none' and 'hvd_fp16' are Horovod's own (default %(default)s)")
    e.add_argument("--steps", type=int, default=10, help="timed steps at most (default %(default)s)")
    e.add_argument("--max-seconds", type=float, default=30.0, help="cap on the timed steps' duration per run "
                   "(at least 3 steps; default %(default)s)")
    e.add_argument("--warmup", type=int, default=2)
    e.add_argument("--batch", type=int, default=32)
    e.add_argument("--threads", type=int, default=1, help="threads per rank (default %(default)s)")
    e.add_argument("--controller", default="gloo", choices=["gloo", "mpi"])
    e.add_argument("--prefix", default="hvdcb", help="cluster name prefix (default %(default)s)")
    e.add_argument("--no-link-measurement", action="store_true", help="skip the TCP goodput measurement")
    e.add_argument("--out", default=os.path.join(RESULTS, "e2e.json"), help="JSON (default %(default)s)")
    e.add_argument("--png", default=None, help="step-time plot (default: the JSON path with .png; the wire "
                   "plot gets _wire.png)")
    e.add_argument("--allocator", default="default", help="glibc malloc settings of every rank: default or "
                   "no-mmap (MALLOC_MMAP_MAX_=0; see docs/results/benchmarks.md) (default %(default)s)")
    e.add_argument("--quiet", action="store_true")

    sc = bsub.add_parser("scale", help="training steps at N = 2, 4, 8 hosts on the emulated cluster (root)",
                         description="Median step, compute-only step, per-rank encode/decode time and bytes on "
                         "every host's interface, at several cluster sizes and link rates, one rank a host; rows "
                         "merged into docs/results/scale_measured.json (schema: hvd_compress/tools/bench/scale.py).")
    sc.add_argument("--workers", default="2,4,8", help="cluster sizes N (default %(default)s)")
    sc.add_argument("--rates", default="100,1000", help="link rates in Mbit/s (default %(default)s)")
    sc.add_argument("--schemes", default="none,hvd_fp16,TopK(0.01),TopK(0.01, transport='two_phase'),"
                    "Int8(transport='two_phase'),EFSignSGD,PowerSGD(4),Auto()", help="(default %(default)s)")
    sc.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    sc.add_argument("--params", default="4M", help="parameter count (default %(default)s)")
    sc.add_argument("--steps", type=int, default=4, help="timed steps per block (default %(default)s)")
    sc.add_argument("--passes", type=int, default=2, help="blocks per scheme, every other pass in reverse "
                    "scheme order (default %(default)s)")
    sc.add_argument("--warmup", type=int, default=2)
    sc.add_argument("--compute-steps", type=int, default=3)
    sc.add_argument("--batch", type=int, default=32)
    sc.add_argument("--threads", type=int, default=1)
    sc.add_argument("--prefix", default="sb", help="cluster name prefix (default %(default)s)")
    sc.add_argument("--out", default=os.path.join(RESULTS, "scale_measured.json"), help="JSON the rows are "
                    "merged into (default %(default)s)")
    sc.add_argument("--no-merge", action="store_true", help="overwrite --out instead of merging into it")
    sc.add_argument("--png", default=None, help="plot (default: the JSON path with .png)")
    sc.add_argument("--settle-max-s", type=float, default=60.0, help="before each launch, wait up to this long "
                    "for other work to stop running (default %(default)s)")
    sc.add_argument("--quiet", action="store_true")
    pin_driver_argument(sc)
    sc.add_argument("--report", action="store_true", help="run nothing: print --out's rows as the markdown "
                    "table of docs/results/benchmarks.md")

    _add_cluster_studies(bsub)
    _add_tta(bsub)
    _add_models(bsub)
    nz = bsub.add_parser("noise", help="what this machine's timings can tell apart: the spread of one "
                         "configuration timed twice, from the benchmarks' rows (runs nothing)",
                         description="none against itself across bench tta runs, and Auto()'s dense plan "
                         "against none within a bench models run (hvd_compress/tools/bench/noise.py).")
    from .bench.noise import add_arguments as noise_arguments
    noise_arguments(nz, RESULTS)
    a = sub.add_parser("advise", help="predict per-step communication + compression cost; recommend per tensor",
                       description="The bytes / bandwidth + latency cost model with index overhead, "
                       "allreduce vs allgather transports and measured encode/decode costs.")
    from .advise import add_arguments
    add_arguments(a)
    return ap


def _add_tta(bsub):
    from .bench.tta import DEFAULT_SCHEMES, LINKS
    t = bsub.add_parser("tta", help="time to dense accuracy: real training under horovodrun on the emulated "
                        "cluster (root)", description="Trains each scheme under its recipe, evaluates every K "
                        "steps, and records when each run first reaches dense's final accuracy less the scheme's "
                        "tolerance; rows appended to docs/results/tta.json (hvd_compress/tools/bench/tta.py).")
    t.add_argument("--framework", default="torch", choices=["torch", "tensorflow"])
    t.add_argument("--model", default="cnn", choices=["cnn", "transformer", "charlm"])
    t.add_argument("--schemes", default=DEFAULT_SCHEMES, help="must include none (default %(default)s)")
    t.add_argument("--seeds", default="1,2,3")
    t.add_argument("--links", default=",".join(LINKS), help="(default %(default)s)")
    t.add_argument("--stands-for", default="resnet50", choices=["resnet50", "bert-large"],
                   help="the real setup whose communication-to-compute ratio the links reproduce")
    t.add_argument("--workers", type=int, default=4, help="hosts, one rank each (default %(default)s)")
    t.add_argument("--steps", type=int, default=None, help="training steps (default: the model's)")
    t.add_argument("--eval-every", type=int, default=None)
    t.add_argument("--validate-link", default=None, help="also train seed 1 of every fixed scheme end to end on "
                   "this shaped link, to check the combined times")
    t.add_argument("--validate-schemes", default=None, help="the fixed schemes --validate-link trains (default: all)")
    t.add_argument("--curves-from", default=None, help="a worker JSON of the unshaped curves, measured before, "
                   "instead of measuring them again (a run in two sittings)")
    t.add_argument("--save-curves", default=None, help="write the unshaped curves' worker JSON here (with every "
                   "step's time), for a later --curves-from")
    t.add_argument("--rates-from", default=None, help="a tta meta JSON: the shaped links' rates of its last run "
                   "of this model, framework and ranks, instead of mapping them again (rows that join that run's)")
    t.add_argument("--time-steps", type=int, default=8, help="steps timed per scheme and link (default %(default)s)")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--prefix", default="tta", help="cluster name prefix (default %(default)s)")
    pin_driver_argument(t)
    t.add_argument("--out", default=os.path.join(RESULTS, "tta.json"), help="JSON the rows are appended to "
                   "(default %(default)s)")
    t.add_argument("--png", default=None, help="plot (default: the JSON path with -<framework>-<model>.png, -np<N> "
                   "before .png at N ranks other than 4); with --report, the plot of --out's rows of --model, "
                   "--framework and --workers drawn again")
    t.add_argument("--splice", default=None, metavar="FROM", help="run nothing: put the rows of the tta JSON FROM "
                   "into --out, in place of --out's rows of the same cells (model, framework, ranks, link, scheme)")
    t.add_argument("--splice-schemes", default=None, help="with --splice: only these schemes' rows (default: all)")
    t.add_argument("--keep-targets", action="store_true", help="with --splice: hold the spliced rows to the "
                   "targets of --out's own none rows (reached, time, steps and bytes read again from each curve)")
    t.add_argument("--join", action="store_true", help="with --splice: add the rows of FROM for the (cell, seed)s "
                   "--out lacks (a run in several sittings), and hold every row of their models to the target of "
                   "all their none rows together")
    t.add_argument("--report", action="store_true", help="run nothing: print --out's rows as the "
                   "time-to-dense-accuracy table")


def main(argv=None):
    _env()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    import shlex
    args.command = "hvd-compress " + shlex.join(argv)  # what a result file records as its command
    try:
        return _run_study(args) if getattr(args, "bench", None) in STUDIES else _dispatch(args)
    except ValueError as err:  # bad input: say which parameter and what is allowed, no traceback
        parser.exit(2, f"hvd-compress: error: {err}\n")


#: ``bench`` subcommands whose module takes the parsed arguments and the command line as given
STUDIES = {"breakdown": "breakdown", "link-change": "link_change", "tta": "tta", "noise": "noise"}


def _run_study(args):
    from importlib import import_module
    return import_module(f".bench.{STUDIES[args.bench]}", __package__).main_args(args, args.command)


def _dispatch(args):
    if args.cmd == "advise":
        from .advise import main_args
        return main_args(args)
    if args.bench == "micro":
        from .bench import micro
        from .bench.specs import split_specs
        png = args.png or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
        rows = micro.run(schemes=split_specs(args.schemes) if args.schemes else None,
                         frameworks=[f.strip() for f in args.frameworks.split(",") if f.strip()],
                         sizes=args.sizes, devices=[d.strip() for d in args.devices.split(",")],
                         threads=args.threads, reps=args.reps, warmup=args.warmup, out_json=args.out,
                         out_png=png, progress=not args.quiet,
                         allocators=[a.strip() for a in args.allocators.split(",") if a.strip()])
        return 1 if rows.errors else 0
    if args.bench == "e2e":
        from .bench import e2e
        from .testing.cluster import ClusterError
        png = args.png or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
        try:
            rows = e2e.run(framework=args.framework, model=args.model, params=args.params, hosts=args.hosts,
                           workers=args.workers, rates=args.rates, schemes=args.schemes, steps=args.steps,
                           warmup=args.warmup, max_seconds=args.max_seconds, batch=args.batch,
                           threads=args.threads, controller=args.controller, out_json=args.out, out_png=png,
                           prefix=args.prefix, measure_link=not args.no_link_measurement,
                           progress=not args.quiet, allocator=args.allocator)
        except ClusterError as err:
            print(f"hvd-compress bench e2e: {err}", file=sys.stderr)
            return 2
        return 1 if rows.failures else 0
    if args.bench == "models":
        return _bench_models(args)
    if args.bench == "scale":
        from .bench import scale
        from .testing.cluster import ClusterError
        if args.report:
            import json
            with open(args.out) as f:
                print(scale.markdown(json.load(f)))
            return 0
        png = args.png or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
        try:
            _, failures = scale.run(workers=args.workers, rates=args.rates, schemes=args.schemes, model=args.model,
                                    params=args.params, steps=args.steps, warmup=args.warmup, passes=args.passes,
                                    compute_steps=args.compute_steps, batch=args.batch, threads=args.threads,
                                    prefix=args.prefix, out_json=args.out, out_png=png, merge=not args.no_merge,
                                    progress=not args.quiet, settle_max_s=args.settle_max_s,
                                    pin_cores=not args.no_pin_cores)
        except ClusterError as err:
            print(f"hvd-compress bench scale: {err}", file=sys.stderr)
            return 2
        return 1 if failures else 0
    return 2


def _add_models(bsub):
    """``bench models`` (:mod:`hvd_compress.tools.bench.models_bench`)."""
    mo = bsub.add_parser("models", help="Horovod-style synthetic benchmarks of ResNet-50, MobileNetV2, BERT and "
                         "GPT-2 on the emulated cluster (root)",
                         description="Median step, start-up (Auto's broken down) and Auto's plan of real "
                         "architectures in PyTorch and TensorFlow, at several cluster sizes, links and schemes; "
                         "rows merged into docs/results/models.json (fields: hvd_compress/tools/bench/models_bench.py).")
    mo.add_argument("--models", default="resnet50,mobilenetv2,bert,gpt2", help="(default %(default)s)")
    mo.add_argument("--frameworks", default="torch,tensorflow", help="(default %(default)s)")
    mo.add_argument("--workers", default="2,4", help="cluster sizes N, one rank a host (default %(default)s)")
    mo.add_argument("--rates", default="none,1000,100", help="link rates in Mbit/s, 'none' = unshaped "
                    "(default %(default)s)")
    mo.add_argument("--schemes", default=None, help="(default: none, hvd_fp16, TopK(0.01), PowerSGD(4), Int8, "
                    "EFSignSGD, Auto(), Auto(include_sign=True))")
    mo.add_argument("--size", default="full", choices=["full", "tiny"], help="the published shapes, or a "
                    "fraction of them for a smoke test (default %(default)s)")
    mo.add_argument("--batch", type=int, default=4, help="per rank (default %(default)s)")
    mo.add_argument("--steps", type=int, default=5, help="timed steps a round (default %(default)s)")
    mo.add_argument("--rounds", type=int, default=1, help="rounds of timed steps; above 1, every scheme is "
                    "built first and the rounds alternate the schemes, every other round in reverse "
                    "(default %(default)s)")
    mo.add_argument("--warmup", type=int, default=2, help="untimed steps before them, besides Auto's "
                    "calibration (default %(default)s)")
    mo.add_argument("--threads", type=int, default=1)
    mo.add_argument("--prefix", default="hvdcm", help="cluster name prefix (default %(default)s)")
    mo.add_argument("--out", default=os.path.join(RESULTS, "models.json"), help="JSON the rows are merged "
                    "into (default %(default)s)")
    mo.add_argument("--no-merge", action="store_true", help="overwrite --out instead of merging into it")
    mo.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for every rank (repeatable), such as "
                         "HVDC_PAIR_SWAP_MIN_BYTES=1048576; each row's hvdc_env records the HVDC_ "
                         "variables its ranks saw")
    pin_driver_argument(mo)
    mo.add_argument("--quiet", action="store_true")


def _bench_models(args):
    from .bench import models_bench
    from .testing.cluster import ClusterError
    try:
        extra_env = models_bench.parse_env(args.env)
    except ValueError as err:
        print(f"hvd-compress bench models: {err}", file=sys.stderr)
        return 2
    try:
        _, failures = models_bench.run(models=args.models, frameworks=args.frameworks, workers=args.workers,
                                       rates=args.rates, schemes=args.schemes or models_bench.DEFAULT_SCHEMES,
                                       size=args.size, batch=args.batch,
                                       steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                                       threads=args.threads, prefix=args.prefix, out_json=args.out,
                                       merge=not args.no_merge, pin_cores=not args.no_pin_cores,
                                       progress=not args.quiet, extra_env=extra_env)
    except ClusterError as err:
        print(f"hvd-compress bench models: {err}", file=sys.stderr)
        return 2
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
