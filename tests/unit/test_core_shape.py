"""The core stays readable, measured on the source with :mod:`ast` (nothing
is imported):

* no function over 50 lines in hvd_compress/ outside the tools subpackage;
* no module reaches into another's private fields: ``obj._name`` where
  ``_name`` is a private name another module of hvd_compress defines and
  ``obj`` is not ``self``, ``cls`` or ``super()``;
* a transport's ``start`` and ``finish`` call back into the adapter at most
  twice (everything else they need is handed to them as roles);
* no adapter-like class (adapters, collectives, stores, codec providers,
  second rounds) has more than 15 public members;
* a ``Call`` carries its fields in groups;
* the adapter dispatches to transports instead of comparing transport names.

``python tests/unit/test_core_shape.py [PACKAGE_DIR]`` prints the numbers.
"""
from __future__ import annotations

import ast
import functools
import pathlib
import sys
import textwrap

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "hvd_compress"
CORE = sorted(p for p in PKG.rglob("*.py") if "tools" not in p.relative_to(PKG).parts)
TRANSPORT_NAMES = {"allreduce", "allgather", "two_phase", "powersgd", "resolved"}
#: the most public members an adapter-like class may have
MAX_PUBLIC_MEMBERS = 15
#: the most adapter members a transport's start or finish may call
MAX_ADAPTER_CALLBACKS = 2
#: what a name must end with to be an adapter-like class
ADAPTER_LIKE = ("Adapter", "AdapterBase", "Collectives", "Store", "Codecs", "Rounds")
#: names through which a transport reaches the adapter: the adapter itself, or
#: the second rounds it owns (the one role whose order spans tensors)
ADAPTER_HANDLES = {"adapter", "rounds"}


@functools.lru_cache(maxsize=None)
def _parse(path):
    return ast.parse(path.read_text(), str(path))


def test_the_core_is_found():
    assert len(CORE) > 20 and PKG / "adapters" / "base.py" in CORE


@pytest.mark.parametrize("path", CORE, ids=[str(p.relative_to(PKG)) for p in CORE])
def test_function_sizes(path):
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(_parse(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50}
    assert not long, f"{path.name}: functions over 50 lines: {long}"


@pytest.mark.parametrize("path", [PKG / "adapters" / n for n in ("base.py", "torch_adapter.py", "tf_adapter.py")],
                         ids=["base", "torch", "tf"])
def test_adapters_do_not_compare_transport_names(path):
    compared = [node.lineno for node in ast.walk(_parse(path)) if isinstance(node, ast.Compare)
                for side in [node.left, *node.comparators]
                if isinstance(side, ast.Constant) and side.value in TRANSPORT_NAMES]
    assert not compared, f"{path.name} compares transport names at lines {compared}"


# --- private fields --------------------------------------------------------------------------
def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def defined_privates(tree) -> frozenset:
    """The private names a module defines: its functions, classes, methods and
    variables, and what it sets on ``self`` or ``cls``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return frozenset(n for n in names if _is_private(n))


@functools.lru_cache(maxsize=None)
def private_names(root: pathlib.Path) -> frozenset:
    """Every private name a module of the package defines."""
    return frozenset().union(*(defined_privates(_parse(path)) for path in root.rglob("*.py")))


def private_reaches(path: pathlib.Path, ours: frozenset) -> list:
    """``(line, "obj._name")`` of each private name of the package (``ours``)
    that ``path`` uses on another object although it does not define it:
    a module uses its own private names on any object, and others' only on
    ``self``, ``cls`` and ``super()`` (an inherited attribute)."""
    tree = _parse(path)
    own = defined_privates(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr in ours - own):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            continue
        found.append((node.lineno, f"{ast.unparse(value)}.{node.attr}"))
    return found


#: modules whose reaches are still to be removed, each with a ceiling: the
#: elastic state marks the compressor it is registered with
KNOWN_REACHES = {"integration/elastic.py": 1}
@pytest.mark.parametrize("path", CORE, ids=[str(p.relative_to(PKG)) for p in CORE])
def test_no_module_reaches_into_another_s_private_fields(path):
    rel = str(path.relative_to(PKG))
    reaches = private_reaches(path, private_names(PKG))
    allowed = KNOWN_REACHES.get(rel, 0)
    assert len(reaches) <= allowed, (
        f"{rel} reaches into private fields of other objects ({len(reaches)}, at most {allowed}): "
        + ", ".join(f"line {line}: {what}" for line, what in reaches)
        + "; give the owner a public method or property for what is needed")


def test_the_private_check_can_fail(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "owner.py").write_text("class Owner:\n    def __init__(self):\n        self._secret = 1\n")
    (pkg / "user.py").write_text(textwrap.dedent("""
        import os
        class User:
            def __init__(self, owner, other):
                self._mine = owner._secret   # reaches into Owner
                other._mine = os._exit       # its own name on another User; not a name of the package
            def read(self):
                return self._mine, User._mine, super()._secret
    """))
    ours = private_names(pkg)
    assert ours == {"_secret", "_mine"}
    assert private_reaches(pkg / "user.py", ours) == [(5, "owner._secret")]


# --- the adapter and the transports ------------------------------------------------------------
def _classes(root: pathlib.Path) -> dict:
    """``{class name: (module path, ClassDef)}`` of every class in the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, (path, node))
    return out


def _base_names(node):
    return [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))]


def _lineage(name, classes):
    """The class and its bases defined in the package, nearest first."""
    out, todo = [], [name]
    while todo:
        n = todo.pop(0)
        if n in classes and n not in out:
            out.append(n)
            todo += _base_names(classes[n][1])
    return out


def public_members(name: str, classes: dict) -> set:
    """Public names of a class and its bases in the package: methods,
    properties and class attributes, and attributes its methods set on self."""
    members = set()
    for cls in _lineage(name, classes):
        for node in classes[cls][1].body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.add(node.name)
            elif isinstance(node, ast.Assign):
                members |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                members.add(node.target.id)
        for node in ast.walk(classes[cls][1]):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                members.add(node.attr)
    return {m for m in members if not m.startswith("_")}


def adapter_like(classes: dict) -> dict:
    """``{class name: public member count}`` of the adapter-like classes."""
    return {name: len(public_members(name, classes)) for name in classes if name.endswith(ADAPTER_LIKE)}


#: adapter-like classes allowed over the limit, each with a ceiling (none now)
KNOWN_WIDE: dict = {}


def test_no_adapter_like_class_has_more_than_15_public_members():
    counts = adapter_like(_classes(PKG))
    assert {"AdapterBase", "TorchAdapter", "TFAdapter", "TorchCollectives", "TFCollectives", "TorchStore", "TFStore",
            "TorchCodecs", "TFCodecs", "SecondRounds", "DeferredRounds"} <= set(counts)
    wide = {name: n for name, n in counts.items() if n > KNOWN_WIDE.get(name, MAX_PUBLIC_MEMBERS)}
    assert not wide, f"adapter-like classes with more than {MAX_PUBLIC_MEMBERS} public members: {wide}"


def _receiver_chain(func):
    """The names along ``a.b.c`` of a called attribute's receiver (``a``, ``b``)."""
    names, node = [], func.value
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names


def adapter_callbacks(root: pathlib.Path, transport: str, method: str) -> set:
    """The adapter members a transport's ``method`` calls, directly or through
    the functions and methods of ``transports/`` it calls: ``handle.member``
    where the receiver passes through ``adapter`` or ``rounds``."""
    classes = _classes(root / "transports")
    functions, helpers = {}, {}  # module-level functions; methods of the other classes there
    for path in (root / "transports").glob("*.py"):
        tree = _parse(path)
        functions.update({n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)})
        others = [n for n in tree.body if isinstance(n, ast.ClassDef) and "Transport" not in _lineage(n.name, classes)]
        for cls in others:
            helpers.update({m.name: m for m in cls.body if isinstance(m, ast.FunctionDef)})
    methods = {}
    for cls in reversed(_lineage(transport, classes)):
        methods.update({m.name: m for m in classes[cls][1].body if isinstance(m, ast.FunctionDef)})
    found, seen, todo = set(), set(), [methods[method]]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id in functions:
                todo.append(functions[f.id])
            elif isinstance(f, ast.Attribute):
                chain = _receiver_chain(f)
                handles = [i for i, n in enumerate(chain) if n in ADAPTER_HANDLES]
                if handles:
                    found.add(".".join([chain[handles[0]]] + list(reversed(chain[:handles[0]])) + [f.attr]))
                elif chain[-1:] in (["self"], [transport]) and f.attr in methods and f.attr != method:
                    todo.append(methods[f.attr])
                elif chain[-1:] != ["self"] and f.attr in helpers:
                    todo.append(helpers[f.attr])
    return found


TRANSPORTS = ["AllreduceTransport", "AllgatherTransport", "TwoPhaseTransport", "LowRankTransport"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("method", ["start", "finish"])
def test_a_transport_calls_back_into_the_adapter_at_most_twice(transport, method):
    calls = adapter_callbacks(PKG, transport, method)
    assert len(calls) <= MAX_ADAPTER_CALLBACKS, f"{transport}.{method} calls back into the adapter: {sorted(calls)}"


def test_the_callback_count_can_fail(tmp_path):
    root = tmp_path / "pkg"
    (root / "transports").mkdir(parents=True)
    (root / "transports" / "t.py").write_text(textwrap.dedent("""
        class Transport: pass
        def helper(adapter):
            return adapter.get_memory()
        class Packed:
            def per_rank(self, adapter):
                return adapter.wait(1)
        class T(Transport):
            def start(self, call):
                helper(call.adapter)
                call.adapter.record_bytes()
                self._more(call)
                call.roles.rounds.defer(1)
            def _more(self, call):
                call.packed.per_rank(call.adapter)
    """))
    assert adapter_callbacks(root, "T", "start") == {"adapter.get_memory", "adapter.record_bytes", "adapter.wait",
                                                     "rounds.defer"}


def report(root: pathlib.Path) -> str:
    lines = [f"adapter-like classes (public members) under {root}:"]
    lines += [f"  {name}: {n}" for name, n in sorted(adapter_like(_classes(root)).items())]
    for transport in TRANSPORTS:
        for method in ("start", "finish"):
            calls = adapter_callbacks(root, transport, method)
            lines.append(f"  {transport}.{method}: {len(calls)} adapter callbacks {sorted(calls)}")
    return "\n".join(lines)



def test_a_call_carries_its_fields_in_groups():
    """What a transport receives is grouped (roles, the gradient's names, the
    ranks, the scheme's context), not a flat list of loose fields."""
    from dataclasses import fields

    from hvd_compress.transports.base import Call, Pending
    assert [f.name for f in fields(Call)] == ["roles", "comp", "grad", "group", "x", "context", "scheme", "memory"]
    assert len(fields(Pending)) <= 6


#: packages that keep their state in one object (Auto's plan, the cost model):
#: stricter still, they read no private field of any other object at all
OWN_FIELDS_ONLY = sorted([*(PKG / "auto").glob("*.py"), *(PKG / "costmodel").glob("*.py")])


@pytest.mark.parametrize("path", OWN_FIELDS_ONLY, ids=[str(p.relative_to(PKG)) for p in OWN_FIELDS_ONLY])
def test_no_private_fields_of_other_objects(path):
    """``x._field`` only where ``x`` is ``self``, ``cls`` or ``super()``: what another
    object keeps private it exposes by a public name or a method."""
    reached = sorted({f"{ast.unparse(node.value)}.{node.attr}" for node in ast.walk(_parse(path))
                      if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                      and not node.attr.startswith("__")
                      and ast.unparse(node.value) not in ("self", "cls", "super()")})
    assert not reached, f"{path.name} reads private fields of other objects: {reached}"


if __name__ == "__main__":
    print(report(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else PKG))
