"""The core stays readable: no file over 400 lines and no function over 50
in hvd_compress/ outside the tools subpackage, and the adapter dispatches to
transports instead of comparing transport names."""
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
def test_file_and_function_sizes(path):
    source = path.read_text()
    assert source.count("\n") <= 400, f"{path.name}: {source.count(chr(10))} lines"
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
