"""The scheme interface: the math of one compression method, nothing else.

A scheme turns a flat gradient (already corrected by error feedback) into a
*payload* -- a dict of named 1-D tensors -- and says how payloads from all
ranks combine back into one dense tensor.  It does not know about Horovod,
parameters, residuals or frameworks: :class:`hvd_compress.Compressor` and the
framework adapters do that, so every scheme is written once and is testable
against numpy without any collective.

Two transports exist:

* ``"allreduce"`` -- the payload is a single part named ``"reduce"`` whose
  element-wise sum is meaningful (casts, shared-seed Random-K, PowerSGD
  factors).  Horovod's own allreduce carries it; ``decode_reduced`` turns the
  sum back into a dense gradient.
* ``"allgather"`` -- every rank's payload is gathered and ``aggregate`` sums
  the decoded contributions.  Parts whose length differs between ranks are
  listed in ``variable_parts``; the transport sends their lengths too.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

Payload = Dict[str, Any]


def check_range(name, value, lo, hi, lo_open=False, hi_open=False, kind=float):
    """Raise a ValueError naming the parameter and the allowed range."""
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok_type = isinstance(value, int) and not isinstance(value, bool)
    lo_ok = ok_type and (value > lo if lo_open else value >= lo)
    hi_ok = ok_type and (hi is None or (value < hi if hi_open else value <= hi))
    if not (lo_ok and hi_ok):
        left = "(" if lo_open else "["
        right = ")" if hi_open or hi is None else "]"
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {what} in {left}{lo}, {'inf' if hi is None else hi}{right}; "
                         f"got {value!r}")
    return value


class SeededDraws:
    """The adapters' ``EncodeContext.uniform``: ``B.uniform(n, seed, like)``
    with its seed kept readable, so that a fused kernel can draw the same
    numbers itself (:mod:`hvd_compress.kernels` reproduces each framework's
    generator) instead of materialising them."""

    def __init__(self, B, seed, like):
        self.B, self._seed, self.like = B, seed, like

    @property
    def seed(self):
        """The seed; given as a function, it is made at each read, so that a
        traced step builds no seed ops for a scheme that draws nothing.  Not
        kept: each branch of a traced schedule must build its own (a tensor
        made in one branch's graph cannot be read from another's)."""
        return self._seed() if callable(self._seed) else self._seed

    def __call__(self, n):
        return self.B.uniform(n, self.seed, like=self.like)


@dataclass
class EncodeContext:
    """What a scheme may know about the call, beyond the tensor itself.

    ``uniform(n)`` draws U[0,1) from a generator seeded by (seed, key, step,
    rank) -- private to this call, so no global RNG state changes.
    ``shared_seed`` is the same on every rank for this key and step
    (Random-K needs that).  ``state`` is the scheme's per-key state dict
    (PowerSGD keeps its warm-started Q there).  ``need_sent`` is False when
    nothing will read the dense ``sent`` that ``encode`` returns (no error
    feedback): a scheme whose ``sent`` costs a pass of its own may return None.
    """
    key: str
    step: Any
    rank: int
    size: int
    uniform: Callable[[int], Any]
    shared_seed: Any
    shape: tuple
    state: Optional[dict] = None
    need_sent: bool = True


class Scheme:
    """Base class.  Subclasses set ``transport`` and implement the math."""

    transport = "allgather"
    #: error feedback on by default (the literature requires it for biased schemes)
    error_feedback_default = True
    #: stochastic schemes draw from ``ctx.uniform``
    stochastic = False
    #: parts whose length may differ between ranks
    variable_parts: tuple = ()
    #: parts whose length follows the number of elements encoded (one code an
    #: element, packed or not): when a sparsifier hands its kept values to this
    #: scheme (``values=``), the kept count varies, and so do these parts
    per_element_parts: tuple = ()
    #: whether Horovod's Average/Sum scaling applies to the aggregate
    #: (a majority vote is a sign, not a sum, so it opts out)
    apply_op_scale = True
    #: the payload is the gradient itself, unchanged (NoCompression): without a
    #: memory, an eager adapter hands the gradient to Horovod as ``none`` does
    passes_through = False

    def transport_for(self, shape) -> str:
        """The transport of a tensor of this shape (PowerSGD sends the
        tensors it cannot shrink by allreduce)."""
        return self.transport

    def stage2(self):
        """The scheme a two-phase owner re-encodes its combined chunk with
        (itself, unless the combination leaves the scheme's alphabet)."""
        return self

    @property
    def name(self):
        return type(self).__name__

    def config(self) -> dict:
        """Constructor arguments, for fingerprints, ``describe()`` and checkpoints."""
        return {}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{self.name}({args})"

    # --- math ----------------------------------------------------------------
    def encode(self, B, x, ctx: EncodeContext):
        """Return ``(payload, sent)``: the parts to transmit and the dense,
        flat tensor this rank contributes (what the others will decode)."""
        raise NotImplementedError

    def decode_one(self, B, payload: Payload, numel: int, ctx=None):
        """Dense flat tensor from one rank's payload."""
        raise NotImplementedError

    def aggregate(self, B, payloads, numel, ctx=None):
        """Sum of the decoded payloads of all ranks (vectorise where possible),
        in rank order on every rank, so that every replica rounds alike."""
        return B.sum_in_order(self.decode_one(B, p, numel, ctx) for p in payloads)

    def decode_reduced(self, B, reduced, numel, ctx=None):
        """For allreduce transport: the dense tensor from the summed payload."""
        raise NotImplementedError

    def payload_nbytes(self, numel: int) -> Optional[int]:
        """Bytes a rank hands to collectives for a tensor of ``numel``
        elements, or None where it depends on the data."""
        return None

    def step_nbytes(self, numel: int, shape) -> Optional[int]:
        """Bytes a rank hands to collectives per step for a tensor of this
        shape, Horovod's 4-byte placeholder included where the payload travels
        by allgather; None where it depends on the data."""
        n = self.payload_nbytes(numel)
        if n is not None and self.transport == "allgather":
            n += 4  # the placeholder
        return n


# --- the registry ---------------------------------------------------------------
@dataclass(frozen=True)
class Registration:
    """What the catalogues need to know about one scheme class.

    Specs are constructor calls with literal arguments, written as a user
    would: ``"TopK(0.05, values=Int8())"`` (see :func:`build`).  The same
    string builds a scheme (:func:`build`) or a compressor
    (``hvd_compress.tools.bench.specs.parse_spec``).
    """
    #: the public name: ``hvd_compress.<name>`` (the compressor factory) and
    #: ``hvd_compress.schemes.<name>`` (this class)
    name: str
    cls: type
    #: ``"none"``, ``"quantizer"``, ``"sparsifier"``, ``"lowrank"`` or
    #: ``"lossless"``: which of bench's speed targets applies
    kind: str
    #: how two implementations of the same math may differ on the same input:
    #: ``"exact"`` (bit for bit), ``"reducing"`` (a float reduction such as a
    #: norm or a mean inside: within float noise of the scale), ``"topk"``
    #: (exact up to ties in magnitude), ``"lowrank"`` or ``"lossless"``
    compare: str
    #: case id -> spec: the configurations the unit tests (against
    #: tests/reference.py) and the GPU check run
    examples: Dict[str, str]
    #: example ids the GPU check leaves out: its 3-step error-feedback runs
    #: would amplify float noise past the comparison rule (QSGD(1): with one
    #: level, a last-bit change of the norm moves an element by the whole norm)
    single_step: Tuple[str, ...]
    #: case id -> spec for the Horovod integration tests (tests/horovod), in
    #: the units of N(0, 1) gradients
    horovod: Dict[str, str]
    #: specs ``hvd-compress bench micro`` times by default: the first is the
    #: scheme's representative, the rest are extra configurations
    bench: Tuple[str, ...]
    #: spec -> payload formula, the rows of docs/results/scheme_table.md
    table: Dict[str, str]


#: public name -> :class:`Registration`, in the order the classes were defined
REGISTRY: Dict[str, Registration] = {}

_KINDS = ("none", "quantizer", "sparsifier", "lowrank", "lossless")
_COMPARE = ("exact", "reducing", "topk", "lowrank", "lossless")


def register(name=None, *, kind, examples, horovod=None, bench=None, table=None, compare="exact",
             single_step=()):
    """Class decorator: record a :class:`Scheme` subclass under its public
    ``name`` (default: the class name) with the configurations the
    catalogues use (see :class:`Registration`).  The public factory
    ``hvd_compress.<name>``, ``hvd-compress bench``, scripts/scheme_table.py,
    the GPU check and the test catalogues all read :data:`REGISTRY`, so a new
    scheme is this decorator on one class plus its math in tests/reference.py
    (docs/design/adding_a_scheme.md walks through it)."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}; got {kind!r}")
    if compare not in _COMPARE:
        raise ValueError(f"compare must be one of {_COMPARE}; got {compare!r}")
    if not examples:
        raise ValueError("examples must name at least one configuration (case id -> spec)")

    def record(cls):
        public = name or cls.__name__
        if not (isinstance(cls, type) and issubclass(cls, Scheme)):
            raise TypeError(f"register({public!r}) decorates a Scheme subclass; got {cls!r}")
        if public in REGISTRY and REGISTRY[public].cls is not cls:
            raise ValueError(f"scheme name {public!r} is already registered by {REGISTRY[public].cls!r}")
        unknown = set(single_step) - set(examples)
        if unknown:
            raise ValueError(f"single_step names case ids that are not examples: {sorted(unknown)}")
        REGISTRY[public] = Registration(public, cls, kind, compare, dict(examples), tuple(single_step),
                                        dict(horovod or {}), tuple(bench or (public,)), dict(table or {}))
        return cls
    return record


def registration(scheme) -> Registration:
    """The registration of a scheme instance, class or public name."""
    name = scheme if isinstance(scheme, str) else None
    cls = scheme if isinstance(scheme, type) else type(scheme)
    for reg in REGISTRY.values():
        if reg.name == name or reg.cls is cls:
            return reg
    raise KeyError(f"{scheme!r} is not a registered scheme; known: {', '.join(REGISTRY)}")


def spec_call(spec: str):
    """``(name, args, kwargs)`` of a spec such as ``"TopK(0.05, values=Int8())"``:
    literal arguments only (parsed with :mod:`ast`, never evaluated); a nested
    call such as ``Int8()`` becomes that scheme instance."""
    try:
        node = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"cannot parse scheme spec {spec!r}: {e.msg}") from None
    if isinstance(node, ast.Name):
        return node.id, [], {}
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise ValueError(f"a scheme spec is a call such as TopK(0.01); got {spec!r}")
    return node.func.id, [_literal(a) for a in node.args], {k.arg: _literal(k.value) for k in node.keywords}


def _literal(node):
    if isinstance(node, ast.Call):
        return build(ast.unparse(node))
    return ast.literal_eval(node)


def build(spec: str) -> Scheme:
    """The scheme instance a spec describes, e.g. ``build("Int8(block_size=64)")``."""
    name, args, kwargs = spec_call(spec)
    if name not in REGISTRY:
        raise ValueError(f"unknown scheme {name!r} in {spec!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name].cls(*args, **kwargs)
