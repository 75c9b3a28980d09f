"""The typed per-parameter state (hvd_compress/adapters/param_state.py) and the torch
checkpoint function over it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hvd_compress
from hvd_compress.adapters.param_state import (OWNED_CHUNK_RESIDUAL, RESIDUAL, MemoryView, ParamState, StateTable, StepView)
from hvd_compress.adapters.torch_adapter import TorchAdapter, torch_load_state_dict, torch_state_dict


def test_param_state_is_a_slotted_dataclass_with_the_documented_fields():
    names = [f.name for f in dataclasses.fields(ParamState)]
    assert names == ["residual", "memory", "step", "scheme", "owned_chunk_residual", "workspace"]
    state = ParamState()
    with pytest.raises(AttributeError):
        state.typo = 1  # __slots__: a misspelt field is an error, not a new attribute
    # each field is explained where it is declared
    import inspect
    source = inspect.getsource(ParamState)
    for name in names:
        line = next(i for i, text in enumerate(source.splitlines()) if text.strip().startswith(name + ":"))
        assert source.splitlines()[line - 1].strip().startswith("#:"), f"{name} has no comment"


def test_memory_names_select_fields():
    state = ParamState()
    state.set_memory(RESIDUAL, 1)
    state.set_memory(OWNED_CHUNK_RESIDUAL, 2)
    state.set_memory("momentum", 3)
    assert (state.residual, state.owned_chunk_residual, state.memory) == (1, 2, {"momentum": 3})
    assert [state.get_memory(n) for n in (RESIDUAL, OWNED_CHUNK_RESIDUAL, "momentum", "other")] == [1, 2, 3, None]


def test_views():
    table = StateTable()
    table.of("w").residual = "r"
    table.of("w").owned_chunk_residual = "o"
    table.of("b").step = 4
    residuals = MemoryView(table, RESIDUAL)
    assert dict(residuals) == {"w": "r", "w#owned_chunk": "o"}
    residuals["b#owned_chunk"] = "o2"
    assert table["b"].owned_chunk_residual == "o2"
    del residuals["w"]
    assert table["w"].residual is None and "w" not in residuals
    assert StepView(table) == {"b": 4}
    with pytest.raises(KeyError):
        residuals["nothing"]


def test_torch_checkpoint_round_trip_keeps_the_entry_names():
    table = StateTable()
    table.of("w").residual = torch.tensor([1.0, 2.0])
    table.of("w").owned_chunk_residual = torch.tensor([3.0])
    table.of("w").memory["momentum"] = torch.tensor([4.0, 5.0])
    table.of("w").step = 7
    table.of("w").scheme["Q"] = torch.ones(2, 1)
    table.of("w").workspace["scratch"] = torch.zeros(9)
    entries = torch_state_dict(table)
    assert sorted(entries) == ["memory/momentum/w", "residual/w", "residual/w#owned_chunk", "scheme/w/Q", "step/w"]
    back = StateTable()
    torch_load_state_dict(back, entries)
    assert back["w"].step == 7 and back["w"].workspace == {}
    assert torch.equal(back["w"].owned_chunk_residual, table["w"].owned_chunk_residual)
    assert torch.equal(back["w"].memory["momentum"], table["w"].memory["momentum"])
    with pytest.raises(ValueError, match="unknown entry 'bogus/w'"):
        torch_load_state_dict(StateTable(), {"bogus/w": torch.zeros(1)})


def test_adapter_views_read_and_write_the_states():
    adapter = TorchAdapter()
    adapter.residuals["a"] = torch.tensor([3.0, 0.0])
    adapter.roles.store.params.of("a").memory["momentum"] = torch.tensor([1.0])
    assert adapter.roles.store.params["a"].residual.tolist() == [3.0, 0.0]
    assert set(adapter.memories) == {"momentum"} and set(adapter.memories["momentum"]) == {"a"}
    comp = hvd_compress.TopK(0.5)
    comp.use_adapter("torch", adapter)
    assert set(comp.state_dict()["torch"]) == {"residual/a", "memory/momentum/a"}
