"""Tests of the paged KV pool's spec, slot mapping, page tables and tensors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tandem.kv import KVCache, KVCacheSpec, PageAllocator


def make_spec(**overrides: Any) -> KVCacheSpec:
    fields: dict[str, Any] = {
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_dim": 8,
        "page_size": 16,
        "dtype": torch.float16,
    }
    fields.update(overrides)
    return KVCacheSpec(**fields)


# --- KVCacheSpec -----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_spec_rejects_bad_sizes(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        make_spec(**{field: value})


def test_spec_rejects_bad_dtype_and_device() -> None:
    with pytest.raises(ValueError, match="dtype"):
        make_spec(dtype="float16")
    with pytest.raises(ValueError, match="device"):
        make_spec(device="not-a-device")


def test_spec_is_frozen() -> None:
    spec = make_spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.page_size = 3  # type: ignore[misc]


def test_bytes_per_page() -> None:
    # K and V * layers * page_size * heads * head_dim * itemsize
    assert make_spec().bytes_per_page == 2 * 2 * 16 * 4 * 8 * 2
    assert make_spec(dtype=torch.float32, page_size=1).bytes_per_page == 2 * 2 * 1 * 4 * 8 * 4


def test_pages_for_budget_counts_the_null_page() -> None:
    spec = make_spec()
    bpp = spec.bytes_per_page
    assert spec.pages_for_budget(11 * bpp) == 10
    assert spec.pages_for_budget(12 * bpp - 1) == 10
    assert spec.pages_for_budget(2 * bpp) == 1
    for too_small in (2 * bpp - 1, bpp, 0):
        with pytest.raises(ValueError, match="num_bytes"):
            spec.pages_for_budget(too_small)


# --- slot mapping and page tables ------------------------------------------------------------


def interleaved_allocator() -> PageAllocator:
    """Page size 3; "a" owns pages [1, 3, 4], "b" owns [2], so "a" is not contiguous."""
    alloc = PageAllocator(5, 3)
    alloc.allocate("a", 3)
    alloc.allocate("b", 2)
    alloc.extend("a", 4)
    assert alloc.pages("a") == [1, 3, 4]
    assert alloc.pages("b") == [2]
    return alloc


def test_slot_mapping_crosses_page_boundaries() -> None:
    alloc = interleaved_allocator()
    assert alloc.slot_mapping("a", 0, 7) == [3, 4, 5, 9, 10, 11, 12]
    assert alloc.slot_mapping("a", 2, 4) == [5, 9]
    assert alloc.slot_mapping("a", 7, 7) == []
    assert alloc.slot_mapping("b", 0, 2) == [6, 7]
    assert [alloc.slot("a", i) for i in range(7)] == alloc.slot_mapping("a", 0, 7)


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (0, 8), (4, 3), (8, 8)])
def test_slot_mapping_bounds(start: int, end: int) -> None:
    alloc = interleaved_allocator()
    with pytest.raises(ValueError):
        alloc.slot_mapping("a", start, end)


@pytest.mark.parametrize("index", [-1, 7])
def test_slot_bounds(index: int) -> None:
    alloc = interleaved_allocator()
    with pytest.raises(ValueError, match="index"):
        alloc.slot("a", index)


def test_page_table_pads_with_the_null_page() -> None:
    alloc = interleaved_allocator()
    alloc.allocate("empty", 0)
    table = alloc.page_table(["b", "a", "empty"])
    assert table.dtype == torch.int32
    assert table.tolist() == [[2, 0, 0], [1, 3, 4], [0, 0, 0]]
    wide = alloc.page_table(["a"], width=5)
    assert wide.tolist() == [[1, 3, 4, 0, 0]]
    with pytest.raises(ValueError, match="width"):
        alloc.page_table(["a", "b"], width=2)


def test_page_table_of_no_requests() -> None:
    alloc = PageAllocator(2, 4)
    assert alloc.page_table([]).shape == (0, 0)
    assert alloc.page_table([], width=3).shape == (0, 3)


# --- KVCache ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_kv_cache_tensors(page_size: int) -> None:
    spec = make_spec(page_size=page_size, dtype=torch.bfloat16, num_layers=3)
    cache = KVCache(spec, num_pages=5)
    assert cache.spec is spec
    assert cache.allocator.num_pages == 5
    assert cache.allocator.page_size == page_size
    assert len(cache.k_caches) == len(cache.v_caches) == 3
    for tensor in [*cache.k_caches, *cache.v_caches]:
        assert tensor.shape == (6 * page_size, 4, 8)
        assert tensor.dtype == torch.bfloat16
        assert tensor.device.type == "cpu"
    # every layer owns its own storage
    cache.k_caches[0][0] = 1.0
    assert cache.k_caches[1].abs().sum() == 0
    assert cache.v_caches[0].abs().sum() == 0


def test_kv_cache_rejects_zero_pages() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        KVCache(make_spec(), 0)


def test_from_budget_sizes_the_pool() -> None:
    spec = make_spec(page_size=3)
    cache = KVCache.from_budget(spec, 8 * spec.bytes_per_page + 5)
    assert cache.allocator.num_pages == 7
    used = sum(t.numel() * t.element_size() for t in [*cache.k_caches, *cache.v_caches])
    assert used == 8 * spec.bytes_per_page
    with pytest.raises(ValueError, match="num_bytes"):
        KVCache.from_budget(spec, spec.bytes_per_page)


def test_slot_mapping_tensor_concatenates_requests() -> None:
    cache = KVCache(make_spec(page_size=3), num_pages=5)
    alloc = cache.allocator
    alloc.allocate("a", 3)
    alloc.allocate("b", 2)
    alloc.extend("a", 4)
    mapping = cache.slot_mapping_tensor(["a", "b"], [2, 0], [4, 2])
    assert mapping.dtype == torch.int64
    assert mapping.tolist() == [5, 9, 6, 7]
    assert cache.slot_mapping_tensor([], [], []).shape == (0,)
    with pytest.raises(ValueError, match="lengths"):
        cache.slot_mapping_tensor(["a"], [0, 0], [1, 1])
    with pytest.raises(ValueError):
        cache.slot_mapping_tensor(["a"], [0], [8])
