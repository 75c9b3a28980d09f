"""The core stays readable: no function over 50 lines in hvd_compress/
outside the tools subpackage, the adapter dispatches to transports instead of
comparing transport names, and the packages that keep their state in one
object (Auto's plan, the cost model) read no other object's private fields."""
from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "hvd_compress"
CORE = sorted(p for p in PKG.rglob("*.py") if "tools" not in p.relative_to(PKG).parts)
TRANSPORT_NAMES = {"allreduce", "allgather", "two_phase", "powersgd", "resolved"}


def test_the_core_is_found():
    assert len(CORE) > 20 and PKG / "adapters" / "base.py" in CORE


@pytest.mark.parametrize("path", CORE, ids=[str(p.relative_to(PKG)) for p in CORE])
def test_function_sizes(path):
    source = path.read_text()
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50}
    assert not long, f"{path.name}: functions over 50 lines: {long}"


@pytest.mark.parametrize("name", ["adapters/base.py", "adapters/torch_adapter.py", "adapters/tf_adapter.py"])
def test_adapters_do_not_compare_transport_names(name):
    tree = ast.parse((PKG / name).read_text())
    compared = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
                for side in [node.left, *node.comparators]
                if isinstance(side, ast.Constant) and side.value in TRANSPORT_NAMES]
    assert not compared, f"{name} compares transport names at lines {compared}"


#: modules that hold to "no module reaches into another's private fields"
OWN_FIELDS_ONLY = sorted([*(PKG / "auto").glob("*.py"), *(PKG / "costmodel").glob("*.py")])


@pytest.mark.parametrize("path", OWN_FIELDS_ONLY, ids=[str(p.relative_to(PKG)) for p in OWN_FIELDS_ONLY])
def test_no_private_fields_of_other_objects(path):
    """``x._field`` only where ``x`` is ``self``, ``cls`` or ``super()``: what another
    object keeps private it exposes by a public name or a method."""
    reached = sorted({f"{ast.unparse(node.value)}.{node.attr}" for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                      and not node.attr.startswith("__")
                      and ast.unparse(node.value) not in ("self", "cls", "super()")})
    assert not reached, f"{path.name} reads private fields of other objects: {reached}"
