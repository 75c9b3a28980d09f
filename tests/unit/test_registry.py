"""The scheme registry (hvd_compress.schemes.REGISTRY): every
registered scheme has a public factory, its math in tests/reference.py, and a
place in every catalogue that reads the registry -- the unit cases, the GPU
check, the Horovod cases, bench micro and the scheme table."""
import sys
from pathlib import Path

import numpy as np
import pytest

import hvd_compress
import reference as R  # tests/reference.py
from hvd_compress import schemes as S
from hvd_compress.schemes.base import Scheme, register, spec_call
from unit_helpers import CASES, REDUCING, framework, make_ctx, Draws, wire

REPO = Path(__file__).resolve().parents[2]
REGS = list(S.REGISTRY.values())
IDS = [r.name for r in REGS]

#: schemes that tests/reference.py has no math for, and what checks them instead;
#: a new scheme does not belong here: give it a reference (docs/design/adding_a_scheme.md)
NO_REFERENCE = {
    "PowerSGD": "conservation of the aggregate plus residuals (tests/horovod/*_compression.py)",
    "Lossless": "exactness and the byte count of shuffle + zstd (tests/horovod/*_compression.py)",
}


def test_the_builtin_schemes_are_registered():
    assert IDS == ["NoCompression", "FP16", "BF16", "Int8", "QSGD", "TernGrad", "SignSGD", "EFSignSGD",
                   "OneBit", "TopK", "RandomK", "Threshold", "DGC", "PowerSGD", "Lossless"]


@pytest.mark.parametrize("reg", REGS, ids=IDS)
def test_public_factory_and_class(reg):
    assert getattr(S, reg.name) is reg.cls and reg.name in S.__all__
    assert reg.name in hvd_compress.__all__
    comp = getattr(hvd_compress, reg.name)(*spec_call(next(iter(reg.examples.values())))[1])
    assert isinstance(comp, hvd_compress.Compressor) and type(comp.scheme) is reg.cls


@pytest.mark.parametrize("reg", REGS, ids=IDS)
def test_reference_exists(reg):
    assert reg.name in R.SCHEMES or reg.name in NO_REFERENCE, (
        f"{reg.name} has no math in tests/reference.py (see docs/design/adding_a_scheme.md)")
    assert not (reg.name in R.SCHEMES and reg.name in NO_REFERENCE), "stale NO_REFERENCE entry"


@pytest.mark.parametrize("reg", REGS, ids=IDS)
def test_examples_build_the_registered_class(reg):
    for cid, spec in list(reg.examples.items()) + list(reg.horovod.items()):
        assert type(S.build(spec)) is reg.cls, (cid, spec)
    for spec in list(reg.bench) + list(reg.table):
        assert type(S.build(spec)) is reg.cls, spec


@pytest.mark.parametrize("reg", REGS, ids=IDS)
def test_every_catalogue_lists_the_scheme(reg):
    sys.path.insert(0, str(REPO / "tests" / "horovod"))
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import compression_cases as cc
        import scheme_table
    finally:
        del sys.path[:2]
    from hvd_compress.tools.bench import gpu_check, micro
    ids = set(reg.examples)
    if reg.name in R.SCHEMES:  # the unit cases compare against the reference
        assert ids <= set(CASES)
        assert set(reg.horovod) and set(reg.horovod) <= set(cc.SCHEMES)
    else:
        assert set(reg.horovod) and set(reg.horovod) <= set(cc.EXTRA)
    assert ids - set(reg.single_step) <= {cid for cid, _, _ in gpu_check.cases()}
    assert reg.bench[0] in micro.default_schemes()
    assert reg.table and set(reg.table) <= {label for label, *_ in scheme_table.rows()}
    assert (reg.name in REDUCING) == (reg.compare == "reducing")


def test_case_ids_are_unique():
    ids = [cid for r in REGS for cid in r.examples]
    assert len(ids) == len(set(ids))
    ids = [cid for r in REGS for cid in r.horovod]
    assert len(ids) == len(set(ids))


# --- what a values= quantizer declares --------------------------------------------------------------
VALUE_QUANTIZERS = [r for r in REGS if r.cls.transport == "allgather" and r.kind == "quantizer"]


@pytest.mark.parametrize("reg", VALUE_QUANTIZERS, ids=[r.name for r in VALUE_QUANTIZERS])
def test_per_element_parts_are_exactly_the_parts_that_follow_the_count(reg):
    """A sparsifier's ``values=`` quantizer encodes a varying kept count: the parts
    whose length changes with it are the ones it declares ``per_element_parts``
    (the sparsifier sends their lengths; one missing would be cut to the wrong length)."""
    fw = framework("torch")
    for cid, spec in reg.examples.items():
        scheme = S.build(spec)
        lengths = []
        for n in (150, 4500):  # a different number of blocks for every Int8 block size in the examples
            payload, _ = scheme.encode(fw.B, fw.tensor(np.linspace(-1, 1, n, dtype=np.float32)),
                                       make_ctx(fw, Draws(fw, 0)))
            lengths.append({k: int(v.numel()) for k, v in wire(payload).items()})
        changing = {k for k in lengths[0] if lengths[0][k] != lengths[1][k]}
        assert changing == set(scheme.per_element_parts) | (set(scheme.variable_parts) & set(lengths[0])), (
            cid, scheme.per_element_parts, lengths)


def test_sparsifier_variable_parts_come_from_the_quantizer():
    t = S.Threshold(1.0, values=S.Int8(block_size=8))
    assert set(t.variable_parts) == {"idx", "val", "v.q", "v.scale"}
    assert set(S.DGC(0.1, values=S.QSGD(4)).variable_parts) == {"idx", "val", "v.q"}
    assert set(S.DGC(0.1, values=S.Lossless()).variable_parts) == {"idx", "val", "v.bytes"}

    class Codes(Scheme):  # a quantizer the sparsifiers have never heard of
        per_element_parts = ("codes",)

    assert "v.codes" in S.Threshold(1.0, values=Codes()).variable_parts


# --- register() itself ---------------------------------------------------------------------------------
def test_register_validates_its_arguments():
    with pytest.raises(ValueError, match="kind must be one of"):
        register(kind="fancy", examples={"x": "X()"})
    with pytest.raises(ValueError, match="compare must be one of"):
        register(kind="quantizer", compare="close", examples={"x": "X()"})
    with pytest.raises(ValueError, match="examples"):
        register(kind="quantizer", examples={})
    with pytest.raises(ValueError, match="single_step names case ids that are not examples"):
        register("Y", kind="quantizer", examples={"y": "Y()"}, single_step=("z",))(type("Y", (Scheme,), {}))
    with pytest.raises(TypeError, match="Scheme subclass"):
        register("NotAScheme", kind="quantizer", examples={"x": "X()"})(object)
    with pytest.raises(ValueError, match="already registered"):
        register("TopK", kind="sparsifier", examples={"x": "TopK()"})(type("Other", (Scheme,), {}))
    assert list(S.REGISTRY) == IDS


def test_build_rejects_what_is_not_a_literal_spec():
    assert repr(S.build("TopK(0.05, values=Int8(block_size=8))")) == repr(S.TopK(0.05, values=S.Int8(block_size=8)))
    with pytest.raises(ValueError, match="unknown scheme 'Nope'"):
        S.build("Nope()")
    with pytest.raises(ValueError, match="cannot parse"):
        S.build("TopK(")
    with pytest.raises(ValueError):
        S.build("TopK(__import__('os'))")
