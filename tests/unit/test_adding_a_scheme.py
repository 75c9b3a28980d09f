"""docs/design/adding_a_scheme.md, run: its example scheme (the first code block) and
its numpy reference (the second) go through the unit harness of
tests/unit/test_schemes.py on both frameworks, also as a sparsifier's
``values=``; and, dropped as one file into a copy of the package, the scheme
appears as a public factory and in the registry without any other edit."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import reference as R
import test_schemes as harness  # tests/unit/test_schemes.py: the unit harness
import unit_helpers
from hvd_compress import schemes as S

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "design" / "adding_a_scheme.md"


def _blocks():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 2, "docs/design/adding_a_scheme.md: expected the scheme and its reference as two python blocks"
    return blocks


def test_the_example_is_about_fifteen_lines():
    body = [ln for ln in _blocks()[0].splitlines() if ln.strip() and not ln.startswith(("from ", "import "))]
    assert len(body) <= 20, len(body)


@pytest.fixture
def int4(monkeypatch):
    """The example registered (and unregistered afterwards), with its reference."""
    scheme_src, reference_src = _blocks()
    namespace = {}
    exec(compile(scheme_src, str(DOC), "exec"), namespace)
    cls = namespace["Int4"]
    try:
        monkeypatch.setattr(R, "DENSE", dict(R.DENSE))
        monkeypatch.setattr(R, "ALLGATHER", R.ALLGATHER | {"Int4"})
        monkeypatch.setattr(R, "SCHEMES", sorted(R.ALLREDUCE | R.ALLGATHER | {"Int4"}))
        exec(compile(reference_src, str(DOC), "exec"), {**vars(R)})  # fills the patched R.DENSE
        monkeypatch.setitem(unit_helpers.CASES, "int4", lambda: S.build("Int4()"))
        monkeypatch.setitem(unit_helpers.CASES, "threshold-int4", lambda: S.build("Threshold(1.0, values=Int4())"))
        yield cls
    finally:
        S.REGISTRY.pop("Int4", None)


@pytest.mark.parametrize("fwname", unit_helpers.FRAMEWORKS)
def test_example_through_the_unit_harness(int4, fwname):
    assert S.registration("Int4").cls is int4 and S.build("Int4()").name == "Int4"
    for case in ("int4", "threshold-int4"):
        for n in harness.SIZES:
            harness.test_encode_decode_bytes(case, n, fwname)
        for n in (1, 7, 1000):
            harness.test_aggregate(case, n, fwname)


def test_example_catches_a_wrong_reference(int4, monkeypatch):
    """The harness has teeth: a reference off by one level fails it."""
    sent, nbytes = R.DENSE["Int4"]
    monkeypatch.setitem(R.DENSE, "Int4", (lambda x, cfg, draw: sent(x, cfg, draw) * 1.1, nbytes))
    with pytest.raises(AssertionError):
        harness.test_encode_decode_bytes("int4", 1000, "torch")


def test_one_new_file_is_all_it_takes(tmp_path):
    """The example as hvd_compress/schemes/int4.py in a copy of the package:
    ``hvd_compress.Int4`` exists, is in the registry and the catalogues' inputs,
    and works as a sparsifier's ``values=`` -- with no other file edited."""
    pkg = tmp_path / "hvd_compress"
    shutil.copytree(REPO / "hvd_compress", pkg, ignore=shutil.ignore_patterns("__pycache__", "tools"))
    (pkg / "schemes" / "int4.py").write_text(_blocks()[0])
    code = (
        "import json, hvd_compress as h\n"
        "c = h.Int4(error_feedback=False)\n"
        "t = h.Threshold(1.0, values=h.Int4()).scheme\n"
        "print(json.dumps({'all': 'Int4' in h.__all__, 'scheme': repr(c.scheme), 'ef': c.error_feedback,\n"
        "  'registry': list(h.schemes.REGISTRY)[-1], 'examples': h.schemes.REGISTRY['Int4'].examples,\n"
        "  'variable': sorted(t.variable_parts)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=str(tmp_path),
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"all": True, "scheme": "Int4()", "ef": False, "registry": "Int4", "examples": {"int4": "Int4()"},
                   "variable": ["idx", "v.q", "val"]}
