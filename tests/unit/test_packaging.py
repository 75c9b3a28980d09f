"""The core/tooling split: the library under ``hvd_compress/`` never
imports the tools under ``hvd_compress/tools/`` (bench, advise, cli, metrics,
the test cluster), and the data the tools read by default ships in the wheel."""
import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "hvd_compress"
#: modules a library import must not drag in (test runners, the tools)
FORBIDDEN = ("hvd_compress.tools", "pytest", "_pytest", "hypothesis")

sys.path.insert(0, str(REPO / "scripts"))
import sync_package_data  # noqa: E402  (scripts/sync_package_data.py)


def _core_files():
    return sorted(p for p in PKG.rglob("*.py") if "tools" not in p.relative_to(PKG).parts)


def test_import_hvd_compress_loads_no_tooling():
    """A fresh interpreter that imports hvd_compress (and its pure-Python core
    modules) has loaded neither the tools nor a test runner."""
    code = ("import json, sys\n"
            "import hvd_compress, hvd_compress.schemes, hvd_compress.backend, hvd_compress.schemes.bit_coding, "
            "hvd_compress.integration.fingerprint, hvd_compress.policy, hvd_compress.byte_counts, hvd_compress.feedback.memory\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                         cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "hvd_compress.schemes" in loaded  # the check itself sees the package's modules
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"import hvd_compress loaded {bad}"


def test_no_core_module_imports_tools():
    """Statically, so that a lazy import inside a function is caught too."""
    offenders = []
    for path in _core_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                names = [mod] + [f"{mod}.{a.name}" if mod else a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.split(".")[0] == "tools" or "hvd_compress.tools" in n or n.startswith(".tools")
                   for n in names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert _core_files(), "no core files found"
    assert not offenders, f"core modules import the tools: {offenders}"


def test_packaged_data_matches_docs_results():
    """hvd_compress/tools/data is a copy of docs/results (the source of truth):
    run scripts/sync_package_data.py after re-measuring."""
    assert sync_package_data.main(["--check"]) == 0, sync_package_data.stale()


def test_advise_default_costs_are_package_data():
    from hvd_compress.tools import advise
    path = Path(advise.DEFAULT_MICRO)
    assert path.is_file() and PKG / "tools" in path.parents, path
    assert json.loads(path.read_text()), "empty bench micro data"


def test_console_script_target_exists():
    import configparser
    import importlib
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    scripts = dict(line.split(" = ") for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines())
    module, func = scripts["hvd-compress"].split(":")
    assert module == "hvd_compress.tools.cli"
    assert callable(getattr(importlib.import_module(module), func))


@pytest.mark.slow
def test_wheel_ships_tools_and_their_data(tmp_path):
    """A wheel built from the tracked files holds the core, the tools, the
    advise data and the kernels' C source (built from a copy of the tree, so no build/ appears in the checkout)."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=str(REPO), capture_output=True,
                           text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for f in files:
        if f.startswith(("hvd_compress/", "setup.cfg", "pyproject.toml", "README.md")) and (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            (src / f).write_bytes((REPO / f).read_bytes())
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("hvd_compress-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for want in ("hvd_compress/__init__.py", "hvd_compress/schemes/base.py", "hvd_compress/tools/cli.py",
                 "hvd_compress/tools/bench/micro.py", "hvd_compress/tools/testing/cluster.py",
                 "hvd_compress/tools/data/micro.json", "hvd_compress/kernels/hvdc_kernels.c",
                 "hvd_compress/kernels/hvdc_kernels.h", "hvd_compress/kernels/hvdc_simd.h",
                 "hvd_compress/kernels/hvdc_tf_ops.cc",
                 "hvd_compress/kernels/native.py"):
        assert want in names, f"{want} missing from {wheel.name}"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "hvd-compress = hvd_compress.tools.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_python_requires_admits_exactly_the_classified_pythons():
    """setup.cfg's ``python_requires`` and its ``Programming Language :: Python :: 3.x``
    classifiers name the same Pythons (the tested ones), this one among them."""
    import configparser
    import re
    from packaging.specifiers import SpecifierSet
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    spec = SpecifierSet(cfg["options"]["python_requires"])
    classified = {m.group(1) for line in cfg["metadata"]["classifiers"].splitlines()
                  if (m := re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", line.strip()))}
    admitted = {f"3.{minor}" for minor in range(0, 30) if spec.contains(f"3.{minor}.0")}
    assert classified == admitted, (classified, admitted)
    assert "{}.{}".format(*sys.version_info[:2]) in admitted
