"""Imports inside ``hvd_compress/`` run one way: no module imports, directly or
through others, a module that imports it back.

The graph is read from the source with :mod:`ast`, nothing is imported.  What
counts as an arrow A -> B (both modules of ``hvd_compress``):

* every ``import`` and ``from ... import`` statement of A, wherever it stands:
  at module level, inside a function or method (a lazy import is still a
  dependency, and a circle closed by one is still a circle in the layering:
  the lower module cannot be read or reused without the upper one), inside
  ``try`` or ``if``;
* ``from P import name`` is an arrow to the submodule ``P.name`` where that
  file exists, else to the package ``P`` itself (its ``__init__.py``): that
  is what Python loads for it;
* a package stands for its ``__init__.py``.

Not counted: the implicit import of the parent packages that Python runs
before a submodule (``import a.b.c`` first runs ``a/__init__.py`` and
``a/b/__init__.py``).  Every submodule would otherwise be in a circle with
any ``__init__.py`` that re-exports it, which is how a package shows its
names; an explicit import of the package (``from .. import X``) is counted.
Imports made by ``importlib`` or ``__import__`` (the scheme registry's plugin
discovery) are not statements and are not seen.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "hvd_compress"


def module_files(root: Path) -> dict:
    """``{dotted module name: path}`` of every ``.py`` file under the package ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def import_graph(root: Path) -> dict:
    """``{module: {imported module: [line, ...]}}`` for the package at ``root``,
    arrows as the module docstring defines them."""
    modules = module_files(root)
    top = root.name
    graph = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        package = name if _is_package(path) else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            for target in targets:
                # "import a.b.c" names a.b.c; keep the longest prefix that is one of ours
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target.split(".")[0] == top and target != name:
                    lines = edges.setdefault(target, [])
                    if node.lineno not in lines:
                        lines.append(node.lineno)
    return graph


def circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict, component: list) -> str:
    members = set(component)
    lines = [f"import circle of {len(component)} modules: {', '.join(component)}"]
    for a in component:
        for b, at in sorted(graph[a].items()):
            if b in members:
                lines.append(f"  {a} -> {b} (line {', '.join(map(str, at))})")
    return "\n".join(lines)


def test_no_import_circle_inside_hvd_compress():
    graph = import_graph(PACKAGE_ROOT)
    assert len(graph) > 50, f"the walker found only {len(graph)} modules under {PACKAGE_ROOT}"
    found = circles(graph)
    assert not found, "\n".join(describe(graph, c) for c in found)


def test_naming_is_a_leaf():
    """The names and hashes every layer uses import nothing of the package."""
    graph = import_graph(PACKAGE_ROOT)
    assert graph["hvd_compress.cross_rank"] == {}


#: the layers, bottom to top: a module may import from its own layer and those
#: below, never from one above (docs/design/architecture.md, "Layers").  A
#: module's layer is that of the longest entry it is or lies under.
LAYERS = {
    # 0: leaves -- the C kernels' loaders, names and hashes every rank agrees on,
    # the written contracts, and what hvd_compress reads of Horovod's internals
    "hvd_compress.kernels": 0, "hvd_compress.cross_rank": 0, "hvd_compress.protocols": 0,
    "hvd_compress.integration.horovod_internals": 0,
    "hvd_compress.backend": 1,  # tensor operations, once per framework
    "hvd_compress.schemes": 2,  # the math of each scheme, written against a backend
    # 3: what sits beside a scheme -- error feedback, byte statistics, the cost model
    "hvd_compress.feedback": 3, "hvd_compress.byte_counts": 3, "hvd_compress.costmodel": 3,
    "hvd_compress.codecs": 4,  # the fused framework codecs of schemes and memories
    "hvd_compress.transports": 5,  # how a payload moves, given the roles
    # 6: the framework adapters (and the roles they compose), the configuration check
    "hvd_compress.adapters": 6, "hvd_compress.integration.fingerprint": 6,
    # 7: the user's objects
    "hvd_compress.compressor": 7, "hvd_compress.policy": 7, "hvd_compress.factories": 7,
    "hvd_compress.auto": 8,  # the compressor that plans the others
    # 9: the package's face and elastic Horovod, which wraps any compressor
    "hvd_compress": 9, "hvd_compress.integration": 9, "hvd_compress.integration.elastic": 9,
    "hvd_compress.integration.elastic_internals": 9,
    "hvd_compress.tools": 10,  # the command line, bench, advise
}


def layer_of(module: str, layers: dict = LAYERS):
    """The layer of ``module``: that of the longest entry it is or lies under (None: no entry)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in layers:
            return layers[prefix]
    return None


def upward_imports(graph: dict, layers: dict = LAYERS) -> list:
    """``"a (layer i) -> b (layer j), line N"`` for every import of a higher layer."""
    found = []
    for a, edges in sorted(graph.items()):
        for b, lines in sorted(edges.items()):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if la is not None and lb is not None and lb > la:
                found.append(f"{a} (layer {la}) -> {b} (layer {lb}), line {', '.join(map(str, lines))}")
    return found


def test_every_module_has_a_layer():
    graph = import_graph(PACKAGE_ROOT)
    assert not [m for m in graph if layer_of(m) is None]


def test_no_module_imports_from_a_layer_above_its_own():
    found = upward_imports(import_graph(PACKAGE_ROOT))
    assert not found, "imports that run up the layers:\n" + "\n".join(found)


def test_the_layer_check_finds_an_upward_import(tmp_path):
    root = _write_package(tmp_path, {
        "__init__.py": "",
        "low.py": "def f():\n    from .high import g  # lazy, still upward\n    return g\n",
        "high.py": "from .low import f\ndef g(): pass\n",
    })
    layers = {"pkg": 2, "pkg.low": 0, "pkg.high": 1}
    assert upward_imports(import_graph(root), layers) == ["pkg.low (layer 0) -> pkg.high (layer 1), line 2"]


def _write_package(tmp_path, files):
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_walker_finds_a_circle_closed_by_a_lazy_import(tmp_path):
    root = _write_package(tmp_path, {
        "__init__.py": "from .top import Top\n",
        "top.py": "from .low.helpers import shared\nclass Top: pass\n",
        "low/__init__.py": "",
        "low/helpers.py": "def shared():\n    from ..top import Top  # the lazy import back up\n    return Top\n",
        "leaf.py": "import os\n",
    })
    graph = import_graph(root)
    assert graph["pkg.low.helpers"] == {"pkg.top": [2]}
    assert circles(graph) == [["pkg.low.helpers", "pkg.top"]]
    assert "pkg.low.helpers -> pkg.top (line 2)" in describe(graph, circles(graph)[0])


def test_the_walker_counts_an_import_of_the_package_face(tmp_path):
    """``from . import Name`` where ``Name`` is defined by ``__init__.py``
    (not a submodule) is an arrow to the package: a circle with an
    ``__init__.py`` that imports the module back.  ``from . import sub``
    naming a submodule is an arrow to that submodule only."""
    root = _write_package(tmp_path, {
        "__init__.py": "from .policy import Policy\nNAME = 1\n",
        "policy.py": "def f():\n    from . import NAME, other\n    return NAME\nclass Policy: pass\n",
        "other.py": "import pkg.policy\n",
    })
    graph = import_graph(root)
    assert graph["pkg.policy"] == {"pkg": [2], "pkg.other": [2]}
    assert graph["pkg.other"] == {"pkg.policy": [1]}
    assert circles(graph) == [["pkg", "pkg.other", "pkg.policy"]]


def test_the_walker_passes_a_package_without_circles(tmp_path):
    root = _write_package(tmp_path, {
        "__init__.py": "from .top import Top\nfrom . import low\n",
        "top.py": "from .low import helpers\nfrom .low.helpers import shared\nclass Top: pass\n",
        "low/__init__.py": "from .helpers import shared\n",
        "low/helpers.py": "import os\nfrom os import path\ndef shared():\n    return path\n",
    })
    graph = import_graph(root)
    assert graph["pkg.top"] == {"pkg.low.helpers": [1, 2]}
    assert circles(graph) == []
