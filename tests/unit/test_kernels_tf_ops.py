"""hvdc_tf_ops.cc registers every op from its one table, kOps: no op class or
REGISTER_OP outside it (read from the source, no compiler needed), and the
loaded library's ops are exactly the table's rows, with the inputs, outputs
and attributes the rows declare, all used by the TF code.  The rows that
docs/design/adding_a_scheme.md quotes are held to the file."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hvd_compress.kernels import tf_native

SOURCE = tf_native.SOURCE.read_text()
ROW = re.compile(r'^    \{"(Hvdc\w+)", (\w+), k(?:Stateful|Stateless),\n(.*?)(?=^    \{"Hvdc|^\};)', re.S | re.M)


def _table():
    """``{op name: (body, row text)}`` of the rows of kOps."""
    start = SOURCE.index("const OpSpec kOps[] = {")
    text = SOURCE[start:SOURCE.index("\n};\n", start) + 4]
    return {name: (body, rest) for name, body, rest in ROW.findall(text)}


def _decls(text):
    """The names a row's declarations give, in order (an output constant such as kSum as its declaration)."""
    for const, decl in re.findall(r'^const Output (k\w+) = \{("[^"]+")', SOURCE, re.M):
        text = re.sub(rf"\b{const}\b", decl, text)
    return re.findall(r'"(\w+): ', text)


def test_every_op_is_a_row_of_the_one_table():
    table = _table()
    assert len(table) >= 16
    # every op name in the file is a row's; nothing registers an op or a kernel by hand
    assert set(re.findall(r'"(Hvdc\w+)"', SOURCE)) == set(table)
    assert not re.search(r"\bREGISTER_(OP|KERNEL_BUILDER)\s*\(", SOURCE)
    assert re.findall(r"class (\w+) : public OpKernel\b", SOURCE) == ["TableKernel"]
    for name, (body, _) in table.items():
        assert re.search(rf"^void {body}\(const Call &c\) \{{", SOURCE, re.M), f"{name}: no body {body}"


def test_every_row_declares_an_attribute_that_has_a_field():
    fields = set(re.findall(r"X\([\w:]+, (\w+)\)", SOURCE))
    for name, (_, rest) in _table().items():
        attrs = _decls(rest.rsplit("\n     {", 1)[-1])
        assert set(attrs) <= fields, f"{name}: {set(attrs) - fields} missing from HVDC_ATTRS"


def test_the_guide_to_a_new_scheme_quotes_the_table_as_it_is():
    doc = Path(__file__).resolve().parents[2] / "docs" / "design" / "adding_a_scheme.md"
    blocks = re.findall(r"```cpp\n(.*?)```", doc.read_text(), flags=re.S)
    assert any('{"Hvdc' in b for b in blocks), "adding_a_scheme.md: no row of kOps quoted"
    for block in blocks:
        assert block in SOURCE, f"adding_a_scheme.md quotes code hvdc_tf_ops.cc no longer has:\n{block}"


@pytest.fixture(scope="module")
def ops():
    lib = tf_native.load()
    if lib is None:
        pytest.skip("the TF op library did not build")
    return lib


def test_the_library_registers_the_rows_as_declared(ops):
    from tensorflow.python.framework import op_def_registry
    for name, (_, rest) in _table().items():
        op_def = op_def_registry.get(name)
        declared = [a.name for a in op_def.input_arg] + [a.name for a in op_def.output_arg] + \
                   [a.name for a in op_def.attr]
        assert declared == _decls(rest), name


def test_the_tf_code_calls_every_op_and_only_those(ops):
    from hvd_compress.codecs import providers, tf_fused
    called = set()
    for module in (tf_fused, providers):  # the codecs, and the codec provider's momentum pass
        called |= set(re.findall(r"\.(hvdc_\w+)\(", Path(module.__file__).read_text()))
    registered = {n for n in dir(ops) if n.startswith("hvdc_") and not n.endswith("_eager_fallback")}
    assert len(registered) == len(_table())
    assert called == registered
