"""kernels/zstd_api.py: the zstd library Lossless's kernels call, its function table,
bounds and per-thread contexts."""
from __future__ import annotations

import ctypes
import threading

import pytest

from hvd_compress.kernels import zstd_api

zstandard = pytest.importorskip("zstandard")


def test_loads_the_zstd_of_the_zstandard_package():
    z = zstd_api.load()
    assert z is not None, f"no zstd library loads from {zstd_api.candidates()}"
    assert all(z.table), "a function of the kernels' table is missing"
    assert z.version == zstandard.ZSTD_VERSION[0] * 10000 + zstandard.ZSTD_VERSION[1] * 100 + zstandard.ZSTD_VERSION[2]


def test_bound_covers_every_block_and_the_tail():
    z = zstd_api.load()
    one = z.lib.ZSTD_compressBound(4 * 100)
    assert z.bound(0, 100) == 0
    assert z.bound(250, 100) == 2 * one + z.lib.ZSTD_compressBound(4 * 50)
    assert z.bound(200, 100) == 2 * one >= 2 * 400


def test_contexts_are_kept_per_thread():
    z = zstd_api.load()
    mine = z.context("C"), z.context("D")
    assert mine == (z.context("C"), z.context("D")) and mine[0] != mine[1]
    theirs = []
    t = threading.Thread(target=lambda: theirs.append((z.context("C"), z.context("D"))))
    t.start()
    t.join()
    assert set(theirs[0]).isdisjoint(mine)


def test_a_named_library_that_does_not_load_gives_none(monkeypatch):
    monkeypatch.setenv("HVDC_ZSTD_LIBRARY", "/nonexistent/libzstd.so")
    assert zstd_api.load() is None
    monkeypatch.delenv("HVDC_ZSTD_LIBRARY")
    assert zstd_api.load() is not None and isinstance(zstd_api.load().lib, ctypes.CDLL)
