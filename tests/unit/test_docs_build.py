"""The API reference: scripts/build_docs.sh builds HTML from the
docstrings with pdoc and fails on any warning, including a docstring
cross-reference that points nowhere.  Part of the plain pytest run of
scripts/run_tests.sh, so CI builds the docs on every run (about 30 s, most of it
importing TensorFlow for hvd_compress.adapters.tf_adapter)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_docs.sh"


def _venv():
    """$HVD_COMPRESS_VENV, else the venv of the interpreter running the tests (on
    Python 3.12 that is .venv-py312, not the 3.11 .venv), else the repository's .venv."""
    if os.environ.get("HVD_COMPRESS_VENV"):
        return Path(os.environ["HVD_COMPRESS_VENV"])
    if sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "python").exists():
        return Path(sys.prefix)
    return REPO / ".venv"


def _pdoc_missing():
    r = subprocess.run([str(_venv() / "bin" / "python"), "-c", "import pdoc"], capture_output=True)
    return r.returncode != 0


pytestmark = pytest.mark.skipif(_pdoc_missing(), reason="pdoc is not installed (scripts/install.sh installs it)")


#: a bound on a hang, not a speed: the build imports every module (TensorFlow and torch
#: included) and took 1786 s beside other CPU-heavy jobs at a load average of 26 on 2 cores
BUILD_BOUND_S = 2400


def _build(repo: Path, out: Path):
    env = {**os.environ, "HVD_COMPRESS_VENV": str(_venv())}
    return subprocess.run(["bash", str(repo / "scripts" / "build_docs.sh"), str(out)], capture_output=True,
                          text=True, timeout=BUILD_BOUND_S, env=env)


def test_api_reference_builds_without_warnings(tmp_path):
    r = _build(REPO, tmp_path / "docs")
    assert r.returncode == 0, f"build_docs.sh failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert "build_docs: OK" in r.stdout
    for page in ("index.html", "hvd_compress.html", "hvd_compress/compressor.html",
                 "hvd_compress/schemes/sparsification.html", "hvd_compress/tools/bench/micro.html",
                 "hvd_compress/tools/bench/gpu_check.html", "hvd_compress/adapters/torch_adapter.html"):
        assert (tmp_path / "docs" / page).is_file(), page
    html = (tmp_path / "docs" / "hvd_compress" / "schemes" / "sparsification.html").read_text()
    assert "class TopK" in html or "TopK" in html


# --- the script fails where it must, on a tiny stand-in package (no TensorFlow import) ----------------
GOOD = '''"""A stand-in package.  See :func:`helper` and :class:`Thing`, and :mod:`ast`."""


def helper():
    """Nothing; see :meth:`Thing.run`."""


class Thing:
    def run(self):
        """Run."""
'''


def _fake_repo(tmp_path: Path, init_source: str) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "build_docs.sh")
    shutil.copy(SCRIPT.parent / "venv_path.sh", repo / "scripts" / "venv_path.sh")
    (repo / "hvd_compress").mkdir()
    (repo / "hvd_compress" / "__init__.py").write_text(init_source)
    return repo


def test_stand_in_package_builds(tmp_path):
    r = _build(_fake_repo(tmp_path, GOOD), tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken references" in r.stdout


def test_fails_on_a_broken_docstring_reference(tmp_path):
    r = _build(_fake_repo(tmp_path, GOOD.replace(":meth:`Thing.run`", ":meth:`Thing.walk`")), tmp_path / "out")
    assert r.returncode == 1, r.stdout + r.stderr
    assert ":meth:`Thing.walk` does not resolve" in r.stderr and "FAILED: 1 warning" in r.stderr


def test_fails_on_a_pdoc_warning(tmp_path):
    # an annotation pdoc cannot evaluate: pdoc's own warning on stderr
    bad = "from __future__ import annotations\n" + GOOD + "\n\ndef f(x: NoSuchType) -> int:\n    return 1\n"
    r = _build(_fake_repo(tmp_path, bad), tmp_path / "out")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NoSuchType" in r.stderr and "FAILED" in r.stderr
