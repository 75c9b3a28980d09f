"""``hvd-compress advise``: whether compression pays, from the one cost model
(:mod:`hvd_compress.costmodel.model`, the model ``Auto`` plans with) checked
against measurements.

The usual back-of-envelope model of communication time is *bytes / bandwidth +
latency*, judging compression by the bytes it saves.  This module keeps that
model but counts what actually moves and what compression costs:

* **payload** -- the bytes one rank hands to Horovod for a tensor of ``n``
  elements (``scheme.payload_nbytes``: values *and* indices, scales, the
  4-byte placeholder of allgather schemes);
* **transport** -- dense schemes ride Horovod's ring allreduce (``2 (N-1)/N x
  payload`` per rank), sparse and per-rank-scaled schemes the allgather
  (``(N-1) x payload``: traffic that *grows with the number of workers*), or
  the two-phase exchange (``"<spec>/two_phase"``: ``2 (N-1)/N x payload`` in
  two rounds); PowerSGD its factor allreduces;
* **overhead** -- encode + error feedback + decode, from a ``bench micro`` JSON
  measured on the machine at hand, interpolated in the tensor size (piecewise
  linear in ``n``; below the smallest size, the line through the two smallest
  sizes, which keeps the fixed per-call cost), counted as the transport runs
  it (:func:`hvd_compress.costmodel.model.codec_seconds`);
* **the collective's own CPU cost and Horovod's cycle** -- the
  :class:`~hvd_compress.costmodel.model.Machine` constants of the machine
  (:data:`CPU_GLOO`, fitted once to bench e2e rows; ``--machine gpu`` for
  NCCL on GPUs);
* **per step** the tensors summed with tensor fusion
  (:func:`hvd_compress.costmodel.model.step_cost`); no overlap with the backward
  pass is assumed (an upper bound of the communication share of a step).

A scheme is recommended for a tensor only if it beats plain allreduce by at
least ``min_gain`` (default 10%); otherwise the answer is "none: compression
does not pay here".

Python API: :func:`predict`, :func:`advise`, :func:`worked_example`,
:func:`validate`.  CLI: ``hvd-compress advise --help``.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .bench.report import human_bytes, human_count, human_seconds
from .bench.specs import HOROVOD_SPECS, parse_spec, payload_nbytes, split_specs
from ..costmodel import model as cost_model
from ..costmodel.model import GPU_NCCL, Link, Machine
from ..costmodel.step_plan import plan_step
from .units import parse_count, parse_rate

#: the encode/decode costs ``advise`` uses by default: a packaged copy of
#: docs/results/micro.json (scripts/sync_package_data.py keeps it in step), so an
#: installed wheel has it too
DEFAULT_MICRO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "micro.json")
DEFAULT_LATENCY_S = 50e-6
#: a two-phase variant of an allgather spec: ``"<spec>/two_phase"``
TWO_PHASE_SUFFIX = "/two_phase"

#: Gloo on this project's CPU machine: the collective's own CPU cost per byte
#: received (fp32 sums and copies, fp16 sums, allgather copies) and Horovod's
#: default cycle.  Fitted once, as least-squares slopes through the origin, to
#: the unshaped-link rows of docs/results/e2e.json (measured comm minus the
#: link's latency and bytes / bandwidth, the codec and the cycle):
#: ``.venv/bin/python scripts/scale_model_check.py --fit``.  ``core_wait_s``:
#: :data:`hvd_compress.costmodel.model.CORE_WAIT_S`.  Where a row's ranks shared
#: the machine's cores, :func:`predict_row` describes that sharing
#: (:func:`row_machine`); without it (the CLI) no sharing applies.
CPU_GLOO = Machine(reduce_s_per_byte=2.02e-9, reduce_half_s_per_byte=6.87e-9, gather_s_per_byte=2.73e-9,
                   cycle_s=cost_model.HOROVOD_CYCLE_S, core_wait_s=cost_model.CORE_WAIT_S,
                   name="CPU, Gloo (fitted to docs/results/e2e.json)")
MACHINES = {"cpu": CPU_GLOO, "gpu": GPU_NCCL, "link": cost_model.LINK_ONLY}
#: the usual back-of-envelope case: a 110M-parameter model (BERT-base size) on 8
#: workers at 100 Gbit/s, with the bytes and milliseconds it is quoted with
DOC_CASE = {"params": 110_000_000, "workers": 8, "bytes_mb": {"none": 440, "fp16": 220, "fp16_top10": 22},
            "time_ms": {"none": 35, "fp16": 18, "fp16_top10": 3}}


# ----------------------------------------------------------------------------- inputs
def parse_bandwidth(text) -> float:
    """Link bandwidth in **bytes/s** from '100gbit', '1000mbit', '1gbit', or a
    bare number of Mbit/s ('100')."""
    mbit = parse_rate(text)
    if mbit is None:
        raise ValueError(f"bandwidth must be a rate such as 100gbit or 1000mbit, got {text!r}")
    return mbit * 1e6 / 8


def load_layers(path: str) -> List[tuple]:
    """[(name, numel)] from a JSON file: a list of counts, a list of
    {"name", "numel"|"shape"}, or an object {name: count | shape}."""
    with open(path) as f:
        data = json.load(f)

    def numel(v):
        if isinstance(v, (int, float)):
            return int(v)
        if isinstance(v, str):
            return parse_count(v)
        if isinstance(v, list):
            return int(math.prod(v))
        if isinstance(v, dict):
            return numel(v["numel"]) if "numel" in v else numel(v["shape"])
        raise ValueError(f"{path}: cannot read a tensor size from {v!r}")

    if isinstance(data, dict):
        return [(str(k), numel(v)) for k, v in data.items()]
    if isinstance(data, list):
        return [(str(v.get("name", f"t{i}")) if isinstance(v, dict) else f"t{i}", numel(v))
                for i, v in enumerate(data)]
    raise ValueError(f"{path}: expected a JSON list or object")


def torch_model_layers(spec: str) -> List[tuple]:
    """[(name, numel)] of a torch model built by ``module:factory`` or
    ``path/to/file.py:factory`` (called with no arguments)."""
    import importlib
    import importlib.util
    mod_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"--torch-model wants module:factory or file.py:factory, got {spec!r}")
    if mod_name.endswith(".py"):
        s = importlib.util.spec_from_file_location("_hvdc_model", mod_name)
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    else:
        mod = importlib.import_module(mod_name)
    model = getattr(mod, attr)()
    return [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- overhead
class Overhead:
    """Encode and decode seconds of each scheme as a function of the tensor
    size, from ``bench micro`` rows of one framework, device and malloc
    setting (``allocator``: the rows' ``allocator`` field, ``default`` for
    rows that predate it)."""

    def __init__(self, rows, framework="torch", device="cpu", allocator="default"):
        framework = "tensorflow" if framework in ("tf", "tensorflow") else framework
        self.framework, self.device, self.allocator = framework, device, allocator
        from .bench.micro import allocator_of
        rows = [r for r in rows or [] if allocator_of(r) == allocator]
        self.points: Dict[str, List[tuple]] = {}
        self.fractions: Dict[str, List[tuple]] = {}
        for r in rows:
            if r.get("framework") != framework or r.get("device") != device:
                continue
            self.fractions.setdefault(r["scheme"], []).append(
                (r["numel"], r["payload_bytes"] / r["dense_fp32_bytes"]))
            enc = r.get("encode_s", r["encode_decode_s"])
            dec = r.get("decode_s", 0.0)
            self.points.setdefault(r["scheme"], []).append((r["numel"], enc, dec))
        for v in self.points.values():
            v.sort()
        self.threads = next((r.get("threads") for r in rows if r.get("framework") == framework), None)

    @classmethod
    def from_file(cls, path, framework="torch", device="cpu", allocator="default"):
        with open(path) as f:
            return cls(json.load(f), framework, device, allocator)

    def payload_fraction(self, spec, n):
        """payload / fp32 bytes measured at the size nearest to ``n`` (for
        schemes whose payload depends on the data), or None."""
        rows = self.fractions.get(spec)
        if not rows:
            return None
        return min(rows, key=lambda t: abs(math.log(t[0] / max(n, 1))))[1]

    def has(self, spec):
        return spec in self.points or spec == "none"

    @staticmethod
    def _interp(pts, n, i):
        if len(pts) == 1:
            n0, t0 = pts[0][0], pts[0][i]
            return t0 * n / n0
        if n <= pts[0][0]:
            (n0, a), (n1, b) = (pts[0][0], pts[0][i]), (pts[1][0], pts[1][i])
        elif n >= pts[-1][0]:
            (n0, a), (n1, b) = (pts[-2][0], pts[-2][i]), (pts[-1][0], pts[-1][i])
        else:
            j = max(k for k in range(len(pts)) if pts[k][0] <= n)
            (n0, a), (n1, b) = (pts[j][0], pts[j][i]), (pts[j + 1][0], pts[j + 1][i])
        slope = (b - a) / (n1 - n0) if n1 != n0 else 0.0
        t = a + slope * (n - n0)
        if n < pts[0][0]:
            # the line through the two smallest sizes keeps the fixed per-call
            # cost; never below proportional scaling from the smallest size
            t = max(t, pts[0][i] * n / pts[0][0])
        return max(t, 0.0)

    def encode_decode(self, spec, n):
        """(encode_s, decode_s) for one tensor of ``n`` elements, or (None, None)."""
        if spec == "none":
            return 0.0, 0.0  # Horovod's none: the gradient itself is the payload
        pts = self.points.get(spec)
        if not pts:
            return None, None
        return self._interp(pts, n, 1), self._interp(pts, n, 2)


# ----------------------------------------------------------------------------- the model
def split_transport(spec):
    """``(spec, transport)``: ``"TopK(0.01)/two_phase"`` -> ``("TopK(0.01)",
    "two_phase")``; a plain spec -> its scheme's own transport."""
    if spec.endswith(TWO_PHASE_SUFFIX):
        base = spec[:-len(TWO_PHASE_SUFFIX)]
        from ..compressor import supports_two_phase
        if base in HOROVOD_SPECS or not supports_two_phase(parse_spec(base).scheme):
            raise ValueError(f"{spec}: the two-phase transport needs a fixed-size allgather scheme (Int8, QSGD, "
                             f"TernGrad, BF16, the sign family or TopK)")
        return base, "two_phase"
    if spec in HOROVOD_SPECS:
        return spec, "allreduce"
    return spec, parse_spec(spec).scheme.transport


def transport_of(spec):
    return split_transport(spec)[1]


def two_phase_variants(specs):
    """``"<spec>/two_phase"`` for each spec that can travel two-phase."""
    from ..compressor import supports_two_phase
    return [s + TWO_PHASE_SUFFIX for s in specs
            if s not in HOROVOD_SPECS and TWO_PHASE_SUFFIX not in s and supports_two_phase(parse_spec(s).scheme)]


#: the link part of the one model (hvd_compress.costmodel.model)
comm_time = cost_model.comm_time


@dataclass
class Prediction:
    spec: str
    numel: int
    transport: str
    payload_bytes: float
    payload_exact: bool
    wire_bytes: float
    #: on the link, the collective's CPU work and the extra rounds' cycle
    comm_s: float
    encode_s: Optional[float]
    decode_s: Optional[float]
    cost: Optional[cost_model.TensorCost] = None

    @property
    def overhead_s(self):
        if self.encode_s is None:
            return None
        return self.encode_s + self.decode_s

    @property
    def total_s(self):
        o = self.overhead_s
        return None if o is None else self.comm_s + o


def _payload(spec, numel, workers, transport, payload_fraction, shape=None):
    if shape is not None and transport == "powersgd":
        return parse_spec(spec).scheme.step_nbytes(numel, tuple(shape)), True
    if transport == "two_phase" and workers > 1:
        chunk, exact = payload_nbytes(spec, -(-int(numel) // workers))
        return (None, exact) if chunk is None else (4 + workers * (chunk - 4), exact)
    payload, exact = payload_nbytes(spec, numel)
    if transport == "powersgd":
        # low rank compresses matrices, and a tensor here is only an element count
        if payload_fraction is None:
            raise ValueError(f"{spec}: the payload depends on the tensor's shape; give shapes (--layers, "
                             f"--model) or a bench micro measurement")
        return payload_fraction * 4 * numel, False
    if payload is None:
        if payload_fraction is None:
            raise ValueError(f"{spec}: payload depends on the data and no bench micro measurement is given")
        payload = payload_fraction * 4 * numel
    return payload, exact


def predict(spec, numel, workers, bandwidth, latency=DEFAULT_LATENCY_S, overhead: Optional[Overhead] = None,
            payload_fraction=None, machine: Machine = cost_model.LINK_ONLY, codec=None, shape=None):
    """Per-step prediction for one tensor by the cost model.  ``bandwidth``
    in bytes/s; ``spec`` may end in ``/two_phase``.  ``payload_fraction``
    (bytes / fp32 bytes measured by bench micro) is used where the payload
    depends on the data (Threshold).  ``codec``: ``(encode_s, decode_s)`` of
    the whole tensor instead of ``overhead``'s (the GPU estimate).
    ``shape``: the tensor's shape where known (PowerSGD's factors)."""
    base, tr = split_transport(spec)
    if shape is not None and tr == "powersgd" and parse_spec(base).scheme.transport_for(tuple(shape)) != "powersgd":
        tr = "allreduce"  # PowerSGD sends what it cannot shrink uncompressed
        base = "none"
    payload, exact = _payload(base, numel, workers, tr, payload_fraction, shape)
    extra = 0 if base in HOROVOD_SPECS else len(getattr(parse_spec(base).scheme, "variable_parts", ()) or ())
    enc = dec = None
    if codec is not None:
        enc, dec = codec
    elif overhead is not None:
        enc, dec = overhead.encode_decode(base, numel)
    elif base == "none":
        enc = dec = 0.0
    half = base in ("hvd_fp16", "FP16") or base.startswith("FP16(")
    cost = cost_model.tensor_cost(tr, payload, workers, Link(latency, bandwidth), machine,
                                  encode_s=enc or 0.0, decode_s=dec or 0.0, extra_allgathers=min(extra, 2),
                                  half=half)
    if enc is not None:
        codec_total = cost_model.codec_seconds(tr, enc, dec, workers)
        enc, dec = enc, codec_total - enc  # decode: every decode the transport runs
    return Prediction(spec, numel, tr, payload, exact, cost.wire_bytes,
                      cost.link_s + cost.collective_s + cost.rounds_s, enc, dec, cost)


@dataclass
class Advice:
    layers: List[tuple]
    workers: int
    bandwidth: float
    latency: float
    schemes: List[str]
    per_layer: List[dict] = field(default_factory=list)
    totals: Dict[str, dict] = field(default_factory=dict)
    plan_total_s: float = 0.0
    none_total_s: float = 0.0
    #: of the totals, what the step pays once for all its tensors (:func:`shared_seconds`)
    plan_shared_s: float = 0.0
    none_shared_s: float = 0.0
    unmeasured: List[str] = field(default_factory=list)
    min_gain: float = 0.1
    machine: Machine = cost_model.LINK_ONLY


def advise(layers, workers, bandwidth, latency=DEFAULT_LATENCY_S, overhead: Optional[Overhead] = None,
           schemes=None, min_gain=0.1, machine: Machine = cost_model.LINK_ONLY, codec_of=None) -> Advice:
    """Predict every scheme (and transport) on every tensor and pick one per
    tensor; whole-model totals by :func:`hvd_compress.costmodel.model.step_cost`
    (tensor fusion, Horovod's cycle).  ``codec_of(spec, numel)``: ``(encode_s,
    decode_s)`` instead of ``overhead``'s (None: unknown)."""
    if schemes is None:
        schemes = ["none", "hvd_fp16"] + [s for s in (overhead.points if overhead else {})
                                          if s not in ("none", "hvd_fp16", "NoCompression")]
        schemes += two_phase_variants(schemes)
    adv = Advice(list(layers), workers, bandwidth, latency, list(schemes), min_gain=min_gain, machine=machine)

    def measured(s):
        base = split_transport(s)[0]
        if codec_of is not None:
            return base == "none" or codec_of(base, 1 << 20) is not None
        return overhead is not None and overhead.has(base)

    adv.unmeasured = [s for s in schemes if s != "none" and not measured(s)]
    costs = {s: [] for s in schemes}
    for s in schemes:
        adv.totals[s] = {"payload_bytes": 0.0, "wire_bytes": 0.0, "comm_s": 0.0, "overhead_s": 0.0,
                         "total_s": 0.0, "measured": s not in adv.unmeasured}
    layer_preds = []
    for layer in layers:
        name, n = layer[0], layer[1]
        shape = layer[2] if len(layer) > 2 else None
        preds = {}
        for s in schemes:
            try:
                codec = None if codec_of is None else codec_of(split_transport(s)[0], n)
                p = predict(s, n, workers, bandwidth, latency, overhead if codec_of is None else None,
                            overhead.payload_fraction(split_transport(s)[0], n) if overhead else None,
                            machine, codec, shape)
            except ValueError:
                continue
            preds[s] = p
            costs[s].append(p.cost)
            t = adv.totals[s]
            t["payload_bytes"] += p.payload_bytes
            t["wire_bytes"] += p.wire_bytes
            t["overhead_s"] += p.overhead_s or 0.0
        layer_preds.append((name, n, preds))
    options = [{s: p.cost for s, p in preds.items() if p.total_s is not None} for _, _, preds in layer_preds]
    for (name, n, preds), choice in zip(layer_preds, plan_step(options, machine, min_gain, "none", schemes)):
        adv.per_layer.append(_layer_advice(name, n, preds, choice, min_gain))
    chosen = [preds[row["choice"]].cost for (_, _, preds), row in zip(layer_preds, adv.per_layer)]
    nones = [preds["none"].cost for _, _, preds in layer_preds]
    for s, cs in costs.items():
        if len(cs) == len(adv.layers):
            step = cost_model.step_cost(cs, machine)
            t = adv.totals[s]
            t["comm_s"] = step.seconds - step.codec_s
            t["total_s"] = step.seconds if t["measured"] else t["comm_s"]
            t["step"] = step
        else:
            adv.totals.pop(s)
    _set_step_totals(adv, cost_model.step_cost(chosen, machine), cost_model.step_cost(nones, machine))
    return adv


def _set_step_totals(adv: Advice, plan: cost_model.StepCost, dense: cost_model.StepCost):
    """The plan's step and the all-``none`` step, each with what it pays once for all its tensors."""
    adv.plan_total_s, adv.plan_shared_s = plan.seconds, shared_seconds(plan)
    adv.none_total_s, adv.none_shared_s = dense.seconds, shared_seconds(dense)


def _layer_advice(name, numel, preds, choice, min_gain) -> dict:
    """One layer's row: the step plan's choice and why.  Every time in it is
    the tensor's own (:attr:`~hvd_compress.costmodel.model.TensorCost.own_s`, what
    the plan compares): the rounds a step shares between its tensors are left
    out of each row and shown once per step (:func:`shared_seconds`)."""
    own = {spec: p.cost.own_s for spec, p in preds.items() if p.total_s is not None}
    none_s, choice_s = preds["none"].cost.own_s, preds[choice].cost.own_s
    best = min(own, key=own.get) if own else "none"
    if choice != "none":
        why = f"saves {_saving(choice_s, none_s)}% of this tensor's own time"
    elif len(own) <= 1:
        why = "no alternative with a measured encode/decode cost"
    elif best == "none":
        why = "compression does not pay: every scheme's own time is above plain allreduce's here"
    elif own[best] > none_s * (1.0 - min_gain):
        why = (f"compression does not pay: the best ({best}) would save {_saving(own[best], none_s)}% of its own "
               f"time, under the {100 * min_gain:.0f}% margin")
    else:
        why = (f"compression does not pay: the best ({best}) would save {_saving(own[best], none_s)}% of its own "
               f"time, but the step, with the rounds it adds, would not be {100 * min_gain:.0f}% faster")
    return {"name": name, "numel": numel, "choice": choice, "why": why, "none_s": none_s, "best": best,
            "best_s": own.get(best, none_s), "choice_s": choice_s, "predictions": preds}


def _saving(seconds, none_s) -> str:
    return f"{100 * (1.0 - seconds / none_s):.0f}" if none_s > 0 else "0"


def shared_seconds(step: cost_model.StepCost) -> float:
    """What a step pays once whoever takes part: the fused rounds' latency
    (with their waits for a core) and Horovod's cycles -- the step's time less
    its tensors' own times."""
    return step.seconds - sum(c.own_s for c in step.tensors)


# ----------------------------------------------------------------------------- reports
def _ms(s):
    return "n/m" if s is None else human_seconds(s)


def _per_tensor_lines(adv: Advice, max_layers) -> List[str]:
    """The recommendation table, each row in the tensor's own time, then the
    rounds the step shares between its tensors, once, and the step's total:
    the rows' times plus the shared line make the total."""
    out = ["", f"Recommendation per tensor (a scheme must save >= {100 * adv.min_gain:.0f}% of the tensor's own "
               f"time over plain allreduce; own time: its bytes, codec and collective work, without the rounds "
               f"it shares with the step's other tensors):", "",
           "| tensor | elements | choice | own time | none's own time | why |", "|---|---:|---|---:|---:|---|"]
    for L in adv.per_layer[:max_layers]:
        out.append(f"| {L['name']} | {human_count(L['numel'])} | **{L['choice']}** | {_ms(L['choice_s'])} | "
                   f"{_ms(L['none_s'])} | {L['why']} |")
    if len(adv.per_layer) > max_layers:
        rest = adv.per_layer[max_layers:]
        from collections import Counter
        c = Counter(L["choice"] for L in rest)
        out.append(f"| ... {len(rest)} more | | {', '.join(f'{k} x{v}' for k, v in c.items())} | "
                   f"{_ms(sum(L['choice_s'] for L in rest))} | {_ms(sum(L['none_s'] for L in rest))} | |")
    gain = 1 - adv.plan_total_s / adv.none_total_s if adv.none_total_s else 0.0
    return out + ["", f"Shared by the step's tensors, once per step (fused rounds' latency, Horovod's cycles): "
                      f"{_ms(adv.plan_shared_s)} with the plan, {_ms(adv.none_shared_s)} uncompressed.",
                  f"Per-tensor plan: {_ms(adv.plan_total_s)} per step (own times + shared) vs "
                  f"{_ms(adv.none_total_s)} uncompressed ({100 * gain:.0f}% saved)."]


def format_advice(adv: Advice, max_layers=40) -> str:
    bw_gbit = adv.bandwidth * 8 / 1e9
    total_n = sum(layer[1] for layer in adv.layers)
    out = [f"## Prediction: {human_count(total_n)} parameters in {len(adv.layers)} tensor(s), "
           f"{adv.workers} workers, {bw_gbit:g} Gbit/s, latency {adv.latency * 1e6:g} us per ring step",
           "",
           "Whole model, one scheme for every tensor (per rank, per step):",
           "",
           "| scheme | transport | payload | on the wire (per rank) | comm | encode+decode | total | vs none |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    none_t = adv.totals["none"]["total_s"]
    for s, t in sorted(adv.totals.items(), key=lambda kv: kv[1]["total_s"]):
        tr = transport_of(s)
        ov = _ms(t["overhead_s"]) if t["measured"] else "not measured"
        tot = _ms(t["total_s"]) + ("" if t["measured"] else " (comm only)")
        sp = f"{none_t / t['total_s']:.2f}x" if t["total_s"] > 0 else "-"
        out.append(f"| {s} | {tr} | {human_bytes(t['payload_bytes'])} | {human_bytes(t['wire_bytes'])} | "
                   f"{_ms(t['comm_s'])} | {ov} | {tot} | {sp} |")
    out += _per_tensor_lines(adv, max_layers)
    if all(L["choice"] == "none" for L in adv.per_layer):
        out.append("**Compression does not pay for this model on this link: use plain allreduce.**")
    if adv.unmeasured:
        out.append(f"Not recommended because their encode/decode cost was not measured by bench micro: "
                   f"{', '.join(adv.unmeasured)}.")
    return "\n".join(out)


def worked_example(workers=8, params=DOC_CASE["params"], bandwidth=100e9 / 8, overhead: Optional[Overhead] = None,
                   worker_counts=(2, 4, 8, 16, 32, 64)) -> dict:
    """The usual back-of-envelope case (:data:`DOC_CASE`: 110M parameters, 8
    workers, 100 Gbit/s; fp32 440 MB in 35 ms, FP16 220 MB in 18 ms, FP16 +
    Top-10% 22 MB in 3 ms), reproduced and then corrected.  The estimate counts
    only the values and ignores the indices and the transport, so it
    understates Top-K's traffic by about 3x at 8 workers and more beyond.

    Returns a dict of numbers (bytes in decimal MB, times in ms) used by the
    report and the tests:

    * ``doc``: the quoted claims;
    * ``naive``: the estimate's own model -- payload / bandwidth, 4 or 2 bytes a value,
      Top-10% counted as 10% of the FP16 bytes (no indices, no transport);
    * ``corrected``: Top-10% with int32 indices (``k x (2 + 4)`` bytes), what
      each rank actually moves in a ring allreduce (``2 (N-1)/N x``) and in the
      allgather that sparse payloads need (``(N-1) x``), and hvd_compress's
      own Top-10% payload (coded indices, 16-bit values);
    * ``growth``: per-rank traffic of FP16-allreduce and Top-10%-allgather as
      the number of workers grows.
    """
    mb = 1e6
    n = params
    k = int(math.ceil(0.1 * n))
    naive = {"none": 4 * n / mb, "fp16": 2 * n / mb, "fp16_top10": 0.1 * 2 * n / mb}
    naive_ms = {key: v * mb / bandwidth * 1e3 for key, v in naive.items()}
    values_mb, index_mb = 2 * k / mb, 4 * k / mb
    top10_raw = values_mb + index_mb
    ours_spec = "TopK(0.1, values=BF16())"
    ours_mb = payload_nbytes(ours_spec, n)[0] / mb
    ring = 2 * (workers - 1) / workers
    corrected = {
        "none_wire_mb": ring * naive["none"], "fp16_wire_mb": ring * naive["fp16"],
        "top10_payload_mb": top10_raw, "top10_values_mb": values_mb, "top10_index_mb": index_mb,
        "top10_allgather_mb": (workers - 1) * top10_raw,
        "ours_payload_mb": ours_mb, "ours_allgather_mb": (workers - 1) * ours_mb,
    }
    corrected_ms = {key.replace("_mb", "_ms"): v * mb / bandwidth * 1e3
                    for key, v in corrected.items() if key.endswith(("wire_mb", "allgather_mb"))}
    overhead_ms = None
    if overhead is not None:
        e, d = overhead.encode_decode(ours_spec, n)
        if e is not None:
            overhead_ms = {"encode_ms": e * 1e3, "decode_ms_per_rank": d * 1e3,
                           "total_ms": (e + workers * d) * 1e3}
    growth = []
    for w in worker_counts:
        growth.append({"workers": w, "fp16_allreduce_mb": 2 * (w - 1) / w * naive["fp16"],
                       "top10_allgather_mb": (w - 1) * top10_raw, "ours_allgather_mb": (w - 1) * ours_mb})
    return {"params": n, "workers": workers, "bandwidth_gbit": bandwidth * 8 / 1e9, "k": k,
            "doc": DOC_CASE, "naive_mb": naive, "naive_ms": naive_ms, "corrected": corrected,
            "corrected_ms": corrected_ms, "overhead": overhead_ms, "growth": growth, "ours_spec": ours_spec}


def format_worked_example(w) -> str:
    d, nv, nm, c, cm = w["doc"], w["naive_mb"], w["naive_ms"], w["corrected"], w["corrected_ms"]
    N = w["workers"]
    lines = [
        f"## The back-of-envelope case: {human_count(w['params'])} parameters, {N} workers, "
        f"{w['bandwidth_gbit']:g} Gbit/s",
        "",
        "Reproduced with the estimate's own model (bytes = values only, time = bytes / bandwidth):",
        "",
        "| | quoted | this model |",
        "|---|---:|---:|",
        f"| fp32 (none) | {d['bytes_mb']['none']} MB, {d['time_ms']['none']} ms | {nv['none']:.0f} MB, {nm['none']:.1f} ms |",
        f"| FP16 | {d['bytes_mb']['fp16']} MB, {d['time_ms']['fp16']} ms | {nv['fp16']:.0f} MB, {nm['fp16']:.1f} ms |",
        f"| FP16 + Top-10% | {d['bytes_mb']['fp16_top10']} MB, {d['time_ms']['fp16_top10']} ms | "
        f"{nv['fp16_top10']:.0f} MB, {nm['fp16_top10']:.1f} ms |",
        "",
        "(440 MB in 35 ms is a 100 Gbit/s link; the quoted 3 ms for 22 MB includes ~1.2 ms it does not explain.)",
        "",
        "Corrected:",
        "",
        f"1. **Index overhead.** Top-10% keeps k = {human_count(w['k'])} values; each needs its position. "
        f"16-bit values ({c['top10_values_mb']:.0f} MB) + int32 indices ({c['top10_index_mb']:.0f} MB) = "
        f"**{c['top10_payload_mb']:.0f} MB per rank, not {nv['fp16_top10']:.0f} MB**. hvd_compress's "
        f"`{w['ours_spec']}` codes the indices (raw, bitmap or Elias-Fano, whichever is smallest for n and k): "
        f"{c['ours_payload_mb']:.1f} MB.",
        f"2. **Transport.** A ring allreduce moves 2(N-1)/N = {2 * (N - 1) / N:.2f}x the payload per rank: "
        f"fp32 {c['none_wire_mb']:.0f} MB ({cm['none_wire_ms']:.1f} ms), FP16 {c['fp16_wire_mb']:.0f} MB "
        f"({cm['fp16_wire_ms']:.1f} ms). Sparse payloads cannot be summed on the way (the indices differ "
        f"between ranks), so they go by allgather and every rank receives (N-1) = {N - 1} payloads: "
        f"**{c['top10_allgather_mb']:.0f} MB ({cm['top10_allgather_ms']:.1f} ms) -- more than dense FP16's "
        f"{c['fp16_wire_mb']:.0f} MB**; with coded indices {c['ours_allgather_mb']:.0f} MB "
        f"({cm['ours_allgather_ms']:.1f} ms).",
    ]
    if w["overhead"]:
        o = w["overhead"]
        lines.append(f"3. **Encode/decode** (from bench micro on this machine, extrapolated to "
                     f"{human_count(w['params'])} elements): encode {o['encode_ms']:.0f} ms + {N} x decode "
                     f"{o['decode_ms_per_rank']:.0f} ms = {o['total_ms']:.0f} ms per step -- at 100 Gbit/s "
                     f"that alone exceeds the dense FP16 allreduce.")
    lines += ["", "Per-rank traffic as the number of workers grows (FP16 ring allreduce is bounded by 2x the "
                  "payload; Top-10% allgather grows linearly):", "",
              "| workers | FP16 allreduce | Top-10% (fp16 + int32 idx) allgather | hvd_compress Top-10% allgather |",
              "|---:|---:|---:|---:|"]
    for g in w["growth"]:
        lines.append(f"| {g['workers']} | {g['fp16_allreduce_mb']:.0f} MB | {g['top10_allgather_mb']:.0f} MB | "
                     f"{g['ours_allgather_mb']:.0f} MB |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- validation
def row_spec(row):
    """The advise spec of a measured row: its scheme, ``/two_phase`` where
    it ran two-phase."""
    spec = row["scheme"]
    if row.get("transport") == "two_phase" and not spec.endswith(TWO_PHASE_SUFFIX):
        spec += TWO_PHASE_SUFFIX
    return spec


def auto_plan_tensors(plan_text):
    """``[(numel, shape, spec)]`` from the table ``Auto.describe()`` prints
    (``auto_plan`` of a bench row): each tensor's shape and chosen candidate
    label (an advise spec: ``none``, ``FP16``, ``TopK(0.01)/two_phase``, ...);
    None where the text is not such a table or a tensor is pinned by a rule."""
    if not isinstance(plan_text, str):
        return None
    out = []
    header = False
    for line in plan_text.splitlines():
        parts = line.split()
        if parts[:3] == ["tensor", "shape", "choice"]:
            header = True
            continue
        if not header or len(parts) < 7 or parts[0] in ("predicted", "link:"):
            continue
        shape_text, label = parts[1], parts[2]
        if label == "rule":
            return None
        shape = () if shape_text == "scalar" else tuple(int(d) for d in shape_text.split("x"))
        numel = 1
        for d in shape:
            numel *= d
        out.append((numel, shape, label))
    return out or None


def row_machine(row, machine: Machine) -> Machine:
    """``machine`` as a measured row ran it: bench e2e and bench scale run
    every emulated host on the one machine, so all ``workers`` ranks shared
    its ``cpus`` cores, with other work taking turns with them: the tasks
    runnable right before the launch (``runnable_before``) where the row has
    them, else the 1-minute load average then (``loadavg_1m_before``, which
    still carries a launch that just ended).  Unchanged
    where the row does not say, where ``machine`` already names its cores, and
    for :data:`~hvd_compress.costmodel.model.LINK_ONLY`."""
    from dataclasses import replace
    if not row.get("cpus") or machine.cpus is not None or machine is cost_model.LINK_ONLY:
        return machine
    load = row.get("runnable_before")
    load = row.get("loadavg_1m_before") if load is None else load
    return replace(machine, cpus=int(row["cpus"]), ranks_per_host=int(row["workers"]),
                   background_load=float(load or 0.0))


def predict_row(row, overhead: Optional[Overhead], machine: Machine, latency=DEFAULT_LATENCY_S, mbit=None):
    """The cost model's :class:`~hvd_compress.costmodel.model.StepCost` for a
    measured row (bench e2e or bench scale: ``scheme``, ``transport``,
    ``workers``, ``layer_numels``/``layer_shapes`` or ``model_params``, the
    link in Mbit/s; Horovod's cycle time and fusion threshold where the row
    names them), and whether its codec cost is known.  The codec is the
    row's own measured encode + decode seconds per step of its slowest rank where it carries them
    (bench scale: wall time inside ``compress``/``decompress`` less the waits,
    so the CPU sharing of the run is in it), else ``overhead``'s bench micro
    costs; the latency per ring step is half the row's measured round trip
    where it has one.  (None, False) where the model cannot predict the row
    (Auto without its plan, an unknown scheme)."""
    workers = row["workers"]
    from dataclasses import replace
    machine = row_machine(row, machine)
    if row.get("horovod_cycle_time_ms") is not None and machine is not cost_model.LINK_ONLY:
        machine = replace(machine, cycle_s=row["horovod_cycle_time_ms"] * 1e-3)  # what the run's Horovod used
    if row.get("horovod_fusion_threshold_bytes") is not None and machine is not cost_model.LINK_ONLY:
        machine = replace(machine, fusion_bytes=row["horovod_fusion_threshold_bytes"])
    mbit = mbit or row.get("link_measured_mbit") or row.get("link_mbit")
    if not mbit:
        return None, False
    bw = mbit * 1e6 / 8
    if row.get("link_rtt_s"):
        latency = row["link_rtt_s"] / 2
    numels = row.get("layer_numels") or [row["model_params"]]
    shapes = row.get("layer_shapes") or [None] * len(numels)
    if len(shapes) != len(numels):
        shapes = [None] * len(numels)
    params = row.get("model_params") or sum(numels)
    if row.get("transport") == "mixed" or str(row.get("scheme", "")).startswith("Auto"):
        tensors = auto_plan_tensors(row.get("auto_plan"))
        if tensors is None:
            return None, False
        numels, shapes, specs = (list(t) for t in zip(*tensors))
    else:
        specs = [row_spec(row)] * len(numels)
    fraction = None
    if row.get("payload_bytes_per_step") and params and len(set(specs)) == 1:
        fraction = row["payload_bytes_per_step"] / (4.0 * params)
    measured_codec = None
    if row.get("encode_s_per_step") is not None and row.get("decode_s_per_step") is not None:
        # the slowest rank's: a step's time is its slowest rank's
        measured_codec = (row.get("encode_s_per_step_max", row["encode_s_per_step"])
                          + row.get("decode_s_per_step_max", row["decode_s_per_step"]))
    known = True
    costs = []
    for n, shape, spec in zip(numels, shapes, specs):
        try:
            split_transport(spec)
            p = predict(spec, n, workers, bw, latency, overhead if measured_codec is None else None,
                        payload_fraction=fraction, machine=machine,
                        codec=(0.0, 0.0) if measured_codec is not None else None, shape=shape)
        except (ValueError, KeyError, TypeError):
            return None, False
        if p.overhead_s is None:
            known = False
        elif measured_codec is None:
            # bench micro timed one process alone: the run's ranks share the cores
            share = machine.cpu_share(workers)
            p.cost = _with_codec(p.cost, p.cost.codec_s * share)
        costs.append(p.cost)
    if measured_codec is not None and costs:
        costs[0] = _with_codec(costs[0], measured_codec)
    return cost_model.step_cost(costs, machine), known


def _with_codec(cost, codec_s):
    from dataclasses import replace
    return replace(cost, codec_s=codec_s)


def validate(e2e_rows, overhead: Overhead, latency=DEFAULT_LATENCY_S, use_measured_link=True,
             machine: Machine = None):
    """Predicted vs measured per-step communication time for each bench e2e row.

    Measured: ``median_step_s - compute_s`` (the step with Horovod minus the
    same model's purely local step).  Predicted: the cost model's step
    (:func:`predict_row`: link, codec, the collective's CPU work, cycle,
    fusion) at the row's link rate -- the TCP goodput measured on the cluster
    for that rate when present (unshaped links have no nominal rate), else the
    nominal rate."""
    machine = CPU_GLOO if machine is None else machine
    out = []
    for r in e2e_rows:
        if r.get("comm_s_measured") is None:
            continue
        mbit = (r.get("link_measured_mbit") if use_measured_link else None) or r.get("link_mbit")
        if not mbit:
            continue
        step, known = predict_row(r, overhead, machine, latency, mbit)
        meas = r["comm_s_measured"]
        row = {"scheme": r["scheme"], "transport": r.get("transport"), "framework": r.get("framework"),
               "link_mbit": r.get("link_mbit"), "bandwidth_mbit_used": mbit, "workers": r["workers"],
               "model_params": r.get("model_params"), "measured_s": meas, "median_step_s": r.get("median_step_s"),
               "compute_s": r.get("compute_s"), "measured_wire_bytes": r.get("wire_bytes_per_step")}
        if step is None:
            row.update(predicted_comm_s=None, predicted_overhead_s=None, predicted_s=None, predicted_wire_bytes=None,
                       error=None, unscored="the model cannot predict this row (a plan it does not carry)")
        else:
            row.update(predicted_comm_s=step.seconds - step.codec_s,
                       predicted_overhead_s=step.codec_s if known else None, predicted_s=step.seconds,
                       predicted_link_s=step.link_s, predicted_collective_s=step.collective_s,
                       predicted_cycle_s=step.cycle_s, predicted_wire_bytes=step.wire_bytes,
                       # without a measured encode/decode cost the prediction is incomplete:
                       # shown, but not scored
                       error=(step.seconds - meas) / meas if meas > 0 and known else None,
                       unscored=None if known else "no bench micro row for this scheme")
        out.append(row)
    return out


def format_validation(rows, micro_path=None, e2e_path=None, latency=DEFAULT_LATENCY_S) -> str:
    lines = ["# advise: predicted vs measured communication time", "",
             f"Measured = bench e2e `median_step_s - compute_s` ({e2e_path or 'e2e JSON'}); predicted = "
             f"the one cost model (hvd_compress/costmodel/model.py: ring allreduce 2(N-1)/N x payload, allgather "
             f"(N-1) x payload, latency {latency * 1e6:g} us per ring step, encode/decode from "
             f"{micro_path or 'bench micro'} with decode x N for allgather schemes, the collective's own CPU "
             f"cost and Horovod's cycle from advise.CPU_GLOO, each row's ranks sharing its cores with its load "
             f"average (advise.row_machine), tensor fusion, no overlap) at the TCP goodput "
             f"the cluster measured for each link setting. Error = (predicted - measured) / measured.", "",
             "| link | scheme | measured comm | predicted | of which comm | of which enc/dec | error | "
             "wire measured | wire predicted |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for v in rows:
        link = "unshaped" if v["link_mbit"] is None else f"{v['link_mbit']:g} Mbit/s"
        link += f" ({v['bandwidth_mbit_used']:.0f} measured)"
        err = (f"- ({v['unscored']})" if v.get("unscored") else "-") if v["error"] is None \
            else f"{100 * v['error']:+.0f}%"
        lines.append(f"| {link} | {v['scheme']} | {_ms(v['measured_s'])} | {_ms(v['predicted_s'])} | "
                     f"{_ms(v['predicted_comm_s'])} | {_ms(v['predicted_overhead_s'])} | {err} | "
                     f"{human_bytes(v['measured_wire_bytes'])} | {human_bytes(v['predicted_wire_bytes'])} |")
    errs = [abs(v["error"]) for v in rows if v["error"] is not None]
    if errs:
        errs.sort()
        import statistics
        lines += ["", f"Median absolute error {100 * statistics.median(errs):.0f}%, worst {100 * errs[-1]:.0f}% "
                      f"over {len(errs)} runs."]
    by_scheme = {}
    for v in rows:
        if v["error"] is not None:
            by_scheme.setdefault(v["scheme"], []).append(v["error"])
    if by_scheme:
        lines += ["", "| scheme | mean error | mean absolute error |", "|---|---:|---:|"]
        for s, e in by_scheme.items():
            lines.append(f"| {s} | {100 * sum(e) / len(e):+.0f}% | {100 * sum(map(abs, e)) / len(e):.0f}% |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def add_arguments(p):
    g = p.add_mutually_exclusive_group()
    g.add_argument("--params", type=parse_count, help="total parameter count, e.g. 110M (one tensor)")
    g.add_argument("--layers", metavar="JSON", help="per-tensor sizes: a JSON list of counts, a list of "
                   "{name, numel|shape}, or an object {name: count|shape}")
    g.add_argument("--torch-model", metavar="MODULE:FACTORY", help="count a torch model's parameters, e.g. "
                   "torchvision.models:resnet50 or my_model.py:build")
    from .projection import MODELS
    g.add_argument("--model", choices=sorted(MODELS), help="a built-in model's tensors, written from its "
                   "architecture (hvd_compress/tools/projection.py); implies --device gpu unless given")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--bandwidth", "--link", dest="bandwidth", default="100gbit",
                   help="link bandwidth, e.g. 100gbit, 1000mbit, 100 (Mbit/s)")
    p.add_argument("--latency-us", type=float, default=DEFAULT_LATENCY_S * 1e6,
                   help="latency per ring step in microseconds (default %(default)g)")
    p.add_argument("--micro", default=DEFAULT_MICRO, help="bench micro JSON with the encode/decode costs "
                   "(default: %(default)s)")
    p.add_argument("--framework", default="torch", choices=["torch", "tensorflow", "tf"])
    p.add_argument("--device", default=None, choices=["cpu", "gpu"],
                   help="cpu (default): encode/decode from the bench micro JSON, Gloo's CPU costs "
                   "(advise.CPU_GLOO); gpu: encode/decode from GPU memory bandwidth x passes per kernel, NCCL "
                   "(hvd_compress/tools/projection.py states the assumption)")
    p.add_argument("--schemes", help="comma-separated specs (default: none, hvd_fp16 and every scheme in the "
                   "micro JSON)")
    p.add_argument("--min-gain", type=float, default=0.1, help="a scheme must save this fraction (default 0.1)")
    p.add_argument("--worked-example", action="store_true", help="the usual back-of-envelope 110M/8-worker case, corrected")
    p.add_argument("--validate", metavar="E2E_JSON", help="compare predictions with a bench e2e JSON")
    p.add_argument("--out", help="also write the report (markdown) here; with --validate default "
                   "advise_validation.md next to the e2e JSON")
    p.add_argument("--max-layers", type=int, default=40)


def main_args(a, stream=None) -> int:
    stream = stream or sys.stdout
    overhead = None
    if a.device is None:
        a.device = "gpu" if getattr(a, "model", None) else "cpu"
    if a.micro and os.path.exists(a.micro):
        overhead = Overhead.from_file(a.micro, a.framework, a.device)
    elif a.micro != DEFAULT_MICRO:
        print(f"advise: {a.micro} not found", file=sys.stderr)
        return 2
    latency = a.latency_us * 1e-6
    parts = []
    if a.validate:
        if overhead is None:
            print("advise --validate needs a bench micro JSON (--micro)", file=sys.stderr)
            return 2
        with open(a.validate) as f:
            e2e_rows = json.load(f)
        fw = {r["framework"] for r in e2e_rows}
        from .bench.micro import allocator_of
        alloc = {allocator_of(r) for r in e2e_rows}
        if len(fw) == 1 and len(alloc) == 1:  # the costs measured under the e2e run's own settings
            overhead = Overhead.from_file(a.micro, fw.pop(), a.device, alloc.pop())
        v = validate(e2e_rows, overhead, latency)
        text = format_validation(v, a.micro, a.validate, latency)
        out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.validate)), "advise_validation.md")
        _write(out, text + "\n")
        print(text, file=stream)
        print(f"\nwrote {out}", file=stream)
        return 0
    if getattr(a, "model", None):
        from .projection import MODELS
        layers = MODELS[a.model].layers()
    elif a.layers:
        layers = load_layers(a.layers)
    elif a.torch_model:
        layers = torch_model_layers(a.torch_model)
    elif a.params:
        layers = [("model", a.params)]
    else:
        layers = None
    bw = parse_bandwidth(a.bandwidth)
    if a.worked_example or layers is None:
        parts.append(format_worked_example(worked_example(a.workers if layers else 8, bandwidth=bw if layers
                                                          else 100e9 / 8, overhead=overhead)))
    if layers is not None:
        schemes = split_specs(a.schemes) if a.schemes else None
        if schemes and "none" not in schemes:
            schemes = ["none"] + schemes
        if a.device == "gpu":
            from .projection import GPU_SCHEMES, gpu_codec
            adv = advise(layers, a.workers, bw, latency, None, schemes or GPU_SCHEMES, a.min_gain, GPU_NCCL,
                         codec_of=gpu_codec)
        else:
            adv = advise(layers, a.workers, bw, latency, overhead, schemes, a.min_gain, CPU_GLOO)
        if overhead is None:
            parts.append(f"(no bench micro JSON at {a.micro}: encode/decode costs unknown, so nothing is "
                         f"recommended; run `hvd-compress bench micro` first)")
        parts.append(format_advice(adv, a.max_layers))
    text = "\n\n".join(parts)
    print(text, file=stream)
    if a.out:
        _write(a.out, text + "\n")
        print(f"\nwrote {a.out}", file=stream)
    return 0


def _write(path, text):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
