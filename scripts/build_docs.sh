#!/usr/bin/env bash
# API reference: HTML from the docstrings of every hvd_compress module, with pdoc,
# into out/docs (gitignored), or the folder given as the first argument.
#   bash scripts/build_docs.sh [OUT_DIR]        (make docs)
# Fails (exit 1) on any warning, printing it:
#   * every warning pdoc writes to stderr ("Warn: ..."): a module that does not
#     import, a type annotation or an __all__ entry that does not resolve, a
#     failed `.. include::`, ...;
#   * a docstring cross-reference -- :class:`X`, :func:`m.f`, :mod:`...`, :meth:`...`
#     (a leading ~ is allowed) -- to an hvd_compress object that does not exist.
#     pdoc itself renders those silently as plain code, so this script resolves
#     every such reference the way pdoc links them and warns for each one that
#     points nowhere.  References to other packages (torch.topk, ast) are not checked.
# typing.NamedTuple classes with postponed annotations get their signatures
# resolved in their own module (pdoc would otherwise warn it cannot evaluate them).
# Every module is documented, including the children of packages whose __all__
# hides them from pdoc's walk (hvd_compress, hvd_compress.schemes).  No module
# needs Horovod at import time; one whose import fails only because an optional
# framework (torch, tensorflow, horovod) is missing is left out with a note on
# stdout, any other import failure is a warning.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# bash scripts/build_docs.sh --diagrams: only re-render the committed diagrams
# (docs/design/*.dot -> docs/design/*.png) with graphviz's dot; the API build and the test
# suite never need graphviz, since the PNGs are committed.
if [ "${1:-}" = "--diagrams" ]; then
  command -v dot >/dev/null || { echo "--diagrams needs graphviz's dot (apt-get install graphviz)" >&2; exit 1; }
  for src in "$REPO"/docs/design/*.dot; do
    dot -Tpng -Gdpi=110 "$src" -o "${src%.dot}.png"
    echo "rendered ${src%.dot}.png"
  done
  exit 0
fi
# shellcheck source=scripts/venv_path.sh
. "$REPO/scripts/venv_path.sh"
VENV="$(hvdc_selected_venv "$REPO")" || exit 1
PY="$VENV/bin/python"
[ -x "$PY" ] || PY=python3
OUT="${1:-$REPO/out/docs}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1
# let imports run their own subprocesses (platform.uname() in a dependency),
# instead of pdoc suppressing them with a warning of its own
export PDOC_ALLOW_EXEC=1
cd "$REPO"
ERR="$(mktemp)"
trap 'rm -f "$ERR"' EXIT
rm -rf "$OUT"
start=$SECONDS
set +e
"$PY" - "$OUT" 2> >(tee "$ERR" >&2) <<'PYEOF'
import importlib
import importlib.util
import pkgutil
import re
import sys
import warnings
from pathlib import Path

import pdoc
import pdoc.doc
import pdoc.extract
import pdoc.render
from pdoc.render_helpers import possible_sources, qualname_candidates

OPTIONAL = ("torch", "tensorflow", "tf_keras", "keras", "horovod")
# one line a warning, whoever raises it: "<Category>: <message> (<file>:<line>)"
warnings.formatwarning = lambda msg, cat, fn, ln, line=None: f"{cat.__name__}: {msg} ({fn}:{ln})\n"
out = Path(sys.argv[1])


def importable(name):
    """None if ``name`` imports; the missing optional framework if that is why not."""
    try:
        importlib.import_module(name)
        return None
    except ImportError as e:
        top = (e.name or "").split(".")[0]
        if top in OPTIONAL:
            return top
        raise


def specs_for(name):
    """``name`` plus every module below it that pdoc's walk would not reach
    (a child left out of its package's ``__all__``)."""
    mod = sys.modules[name]
    specs = [name]
    if hasattr(mod, "__path__"):
        listed = getattr(mod, "__all__", None)
        for info in pkgutil.iter_modules(mod.__path__, name + "."):
            try:
                missing = importable(info.name)
            except Exception as e:  # a real import error: pdoc shall report it
                warnings.warn(f"Error importing {info.name}: {type(e).__name__}: {e}")
                continue
            if missing:
                print(f"build_docs: {info.name} left out: it needs {missing}, which is not installed")
                continue
            below = specs_for(info.name)
            short = info.name.rpartition(".")[2]
            specs += below if (listed is not None and short not in listed) else below[1:]
    return specs


def fix_namedtuple_signatures():
    """typing.NamedTuple classes get a ``__new__`` compiled in a throw-away
    module ("namedtuple_X"), so pdoc evaluates their postponed annotations
    (``from __future__ import annotations``) in an empty namespace and warns;
    point it at the class's own module (in this process only)."""
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("hvd_compress"):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields") \
                    and obj.__module__ == modname:
                new = obj.__dict__.get("__new__")
                new = getattr(new, "__func__", new)
                if new is not None and str(getattr(new, "__module__", "")).startswith("namedtuple_"):
                    new.__module__ = modname


importable("hvd_compress")
specs = specs_for("hvd_compress")
fix_namedtuple_signatures()
pdoc.render.configure(docformat="restructuredtext", footer_text="hvd_compress API reference")
pdoc.pdoc(*specs, output_directory=out)

# --- cross-references in docstrings --------------------------------------------------
ROLE = re.compile(r"(?::py)?:(mod|func|data|const|class|meth|attr|exc|obj):`([^`]+)`")
names = pdoc.extract.walk_specs(specs)
all_modules = {n: pdoc.doc.Module.from_name(n) for n in names}


def resolves(ident, mod, namespace):
    ident = ident.lstrip("~").removesuffix("()")
    if ident.startswith("."):
        parent = mod.modulename if mod.is_package else mod.modulename.rpartition(".")[0]
        while ident.startswith(".."):
            ident, parent = ident[1:], parent.rpartition(".")[0]
        ident = parent + ident
    else:
        if any(mod.get(q) is not None for q in qualname_candidates(ident, namespace)):
            return True
        first = ident.split(".")[0]
        local = any(mod.get(q) is not None for q in qualname_candidates(first, namespace))
        if first != "hvd_compress" and not local and first not in all_modules:
            try:
                # another package (:mod:`ast`, :func:`torch.topk`): not ours to check
                return importlib.util.find_spec(first) is not None
            except (ImportError, ValueError):
                return False
    if ident in all_modules:
        return True
    try:
        sources = list(possible_sources(all_modules, ident))
    except ValueError:
        return False
    return any(m in all_modules and (q == "" or all_modules[m].get(q) is not None) for m, q in sources)


def own_docs(doc, modname):
    yield doc
    for member in getattr(doc, "own_members", []):
        if member.taken_from[0] == modname:
            yield from own_docs(member, modname)


broken = 0
for mod in all_modules.values():
    for doc in own_docs(mod, mod.modulename):
        namespace = "" if isinstance(doc, pdoc.doc.Module) else doc.qualname
        for m in ROLE.finditer(doc.docstring or ""):
            if not resolves(m.group(2), mod, namespace):
                broken += 1
                where = doc.fullname
                warnings.warn(f"docstring of {where}: :{m.group(1)}:`{m.group(2)}` does not resolve to any "
                              "documented object")
print(f"build_docs: {len(all_modules)} modules documented in {out} ({broken} broken references)")
PYEOF
rc=$?
set -e
# pdoc's own warnings read "Warn: ..."; Python's "...Warning: ..."; TensorFlow's C++
# start-up line "WARNING: All log messages before absl::InitializeLog()" is not about the docs
warn_lines="$(grep -iE 'warn' "$ERR" | grep -v 'All log messages before absl::InitializeLog' || true)"
if [ "$rc" -ne 0 ]; then
  echo "build_docs: FAILED: pdoc exited $rc" >&2
  exit 1
fi
if [ -n "$warn_lines" ]; then
  n="$(printf '%s\n' "$warn_lines" | wc -l)"
  echo "build_docs: FAILED: $n warning line(s) on stderr:" >&2
  printf '%s\n' "$warn_lines" | sed 's/^/  /' >&2
  exit 1
fi
echo "build_docs: OK in $((SECONDS - start)) s: $OUT/index.html"
