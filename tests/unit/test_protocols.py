"""The written contracts of hvd_compress/protocols.py hold: both backends
implement the whole Backend protocol, every registered scheme the Scheme
protocol and every memory the Memory protocol, with the protocol's parameter
names (an implementation may add parameters only with defaults)."""
from __future__ import annotations

import inspect
import typing

import pytest

from hvd_compress.feedback import memory as memories
from hvd_compress import protocols
from hvd_compress.backend import TensorFlowBackend, TorchBackend
from hvd_compress.schemes import REGISTRY


def _members(protocol):
    """(attributes, {method name: its signature}) the protocol declares."""
    methods, attributes = {}, set(typing.get_type_hints(protocol))
    for name, value in vars(protocol).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            attributes.add(name)
        elif callable(value):
            methods[name] = inspect.signature(value)
    return attributes, methods


def _mismatches(protocol, implementation):
    attributes, methods = _members(protocol)
    problems = [f"missing attribute {a}" for a in sorted(attributes) if not hasattr(implementation, a)]
    for name, wanted in methods.items():
        got = getattr(implementation, name, None)
        if not callable(got):
            problems.append(f"missing method {name}")
            continue
        want = [p for p in wanted.parameters if p != "self"]
        have = list(inspect.signature(got).parameters.values())
        have = [p for p in have if p.name != "self"]
        if [p.name for p in have[:len(want)]] != want:
            problems.append(f"{name}{inspect.signature(got)} does not take {want}")
        extra = [p.name for p in have[len(want):] if p.default is inspect.Parameter.empty]
        if extra:
            problems.append(f"{name} needs more than the protocol passes: {extra}")
    return problems


def test_protocols_declare_what_they_should():
    _, backend_methods = _members(protocols.Backend)
    assert len(backend_methods) == 52 and {"split", "uniform", "identity_with_deps", "copy"} <= set(backend_methods)
    _, scheme_methods = _members(protocols.Scheme)
    assert {"encode", "decode_one", "aggregate", "decode_reduced", "transport_for", "stage2"} <= set(scheme_methods)


@pytest.mark.parametrize("backend_class", [TorchBackend, TensorFlowBackend], ids=["torch", "tensorflow"])
def test_backend_implements_the_whole_protocol(backend_class):
    assert not _mismatches(protocols.Backend, backend_class)
    # and every public method is in the protocol (a helper that is not is private or
    # framework-only: host_reads_are_free is the torch backend's own test hook)
    _, methods = _members(protocols.Backend)
    public = {n for n, v in vars(backend_class).items() if callable(v) and not n.startswith("_")}
    assert public - set(methods) <= {"host_reads_are_free"}


def test_backends_are_instances_of_the_protocol():
    assert isinstance(TorchBackend(), protocols.Backend)
    assert isinstance(TensorFlowBackend(), protocols.Backend)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_scheme_implements_the_protocol(name):
    assert not _mismatches(protocols.Scheme, REGISTRY[name].cls)


MEMORIES = [cls for _, cls in inspect.getmembers(memories, inspect.isclass)
            if cls.__module__ == memories.__name__ and hasattr(cls, "compensate")]


@pytest.mark.parametrize("memory_class", MEMORIES, ids=[c.__name__ for c in MEMORIES])
def test_memory_implements_the_protocol(memory_class):
    memory = memory_class()  # an instance: a memory may set ``names`` in __init__
    assert not _mismatches(protocols.Memory, memory)
    assert isinstance(memory, protocols.Memory)


def test_a_missing_method_is_reported():
    class Incomplete:
        names = ("residual",)

        def compensate(self, B, x, state):
            return x

        def config(self):
            return {}

    assert _mismatches(protocols.Memory, Incomplete) == ["missing method update"]
    assert not isinstance(Incomplete(), protocols.Memory)
