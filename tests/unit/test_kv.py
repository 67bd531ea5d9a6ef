"""Tests of the paged KV pool: allocator bookkeeping, slot mapping, page tables and tensors."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tandem.errors import KVExhausted, NotFound
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


# --- PageAllocator: construction and allocation ----------------------------------------------


@pytest.mark.parametrize(("num_pages", "page_size"), [(0, 16), (-1, 16), (4, 0)])
def test_allocator_rejects_bad_sizes(num_pages: int, page_size: int) -> None:
    with pytest.raises(ValueError, match="num_pages" if num_pages < 1 else "page_size"):
        PageAllocator(num_pages, page_size)


def test_allocate_hands_out_lowest_pages_first() -> None:
    alloc = PageAllocator(8, 4)
    assert alloc.num_free_pages == 8
    alloc.allocate("a", 9)  # 3 pages
    assert alloc.pages("a") == [1, 2, 3]
    assert alloc.num_tokens("a") == 9
    assert alloc.num_free_pages == 5
    assert "a" in alloc and "b" not in alloc
    assert len(alloc) == 1
    alloc.allocate("b", 4)
    assert alloc.pages("b") == [4]


def test_allocate_zero_tokens_registers_without_pages() -> None:
    alloc = PageAllocator(2, 4)
    alloc.allocate("a", 0)
    assert "a" in alloc
    assert alloc.pages("a") == []
    assert alloc.num_free_pages == 2


def test_allocate_exhaustion_leaves_state_unchanged() -> None:
    alloc = PageAllocator(3, 4)
    alloc.allocate("a", 5)
    assert not alloc.can_allocate(9)
    with pytest.raises(KVExhausted):
        alloc.allocate("b", 9)
    assert "b" not in alloc
    assert alloc.num_free_pages == 1
    assert alloc.pages("a") == [1, 2]
    alloc.allocate("b", 4)  # the remaining page is still there
    assert alloc.pages("b") == [3]


def test_double_allocate_is_rejected() -> None:
    alloc = PageAllocator(4, 4)
    alloc.allocate("a", 3)
    with pytest.raises(ValueError, match="already"):
        alloc.allocate("a", 3)
    assert alloc.pages("a") == [1]
    assert alloc.num_tokens("a") == 3
    assert alloc.num_free_pages == 3


def test_negative_token_counts_are_rejected() -> None:
    alloc = PageAllocator(4, 4)
    alloc.allocate("a", 1)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.allocate("b", -1)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.extend("a", -1)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.pages_needed(None, -1)
    assert "b" not in alloc
    assert alloc.num_tokens("a") == 1


def test_pages_needed_and_can_checks() -> None:
    alloc = PageAllocator(4, 4)
    assert alloc.pages_needed(None, 0) == 0
    assert alloc.pages_needed(None, 1) == 1
    assert alloc.pages_needed(None, 4) == 1
    assert alloc.pages_needed(None, 5) == 2
    alloc.allocate("a", 3)  # one page, one slot left in it
    assert alloc.pages_needed("a", 1) == 0
    assert alloc.pages_needed("a", 2) == 1
    assert alloc.pages_needed("a", 13) == 3
    assert alloc.can_extend("a", 13)
    assert not alloc.can_extend("a", 14)
    assert alloc.can_allocate(12)
    assert not alloc.can_allocate(13)


def test_extend_takes_pages_only_across_page_boundaries() -> None:
    alloc = PageAllocator(4, 4)
    alloc.allocate("a", 2)
    alloc.extend("a", 2)
    assert alloc.pages("a") == [1]
    assert alloc.num_tokens("a") == 4
    alloc.extend("a", 1)
    assert alloc.pages("a") == [1, 2]
    alloc.extend("a", 0)
    assert alloc.num_tokens("a") == 5


def test_extend_exhaustion_leaves_state_unchanged() -> None:
    alloc = PageAllocator(3, 4)
    alloc.allocate("a", 3)
    alloc.allocate("b", 4)
    with pytest.raises(KVExhausted):
        alloc.extend("a", 10)  # needs 3 more pages, 1 free
    assert alloc.pages("a") == [1]
    assert alloc.num_tokens("a") == 3
    assert alloc.num_free_pages == 1


def test_extend_all_is_all_or_none() -> None:
    alloc = PageAllocator(4, 4)
    alloc.allocate("a", 3)
    alloc.allocate("b", 4)
    assert not alloc.extend_all([("a", 1), ("b", 9)])  # 1 + 3 pages needed, 2 free
    assert (alloc.num_tokens("a"), alloc.num_tokens("b"), alloc.num_free_pages) == (3, 4, 2)
    assert alloc.extend_all([("a", 2), ("b", 4)])  # 1 + 1 pages
    assert (alloc.num_tokens("a"), alloc.num_tokens("b"), alloc.num_free_pages) == (5, 8, 0)


def test_unknown_request_ids_raise_not_found() -> None:
    alloc = PageAllocator(4, 4)
    calls = [
        lambda: alloc.extend("x", 1),
        lambda: alloc.can_extend("x", 1),
        lambda: alloc.pages_needed("x", 1),
        lambda: alloc.truncate("x", 0),
        lambda: alloc.free("x"),
        lambda: alloc.num_tokens("x"),
        lambda: alloc.pages("x"),
        lambda: alloc.slot("x", 0),
        lambda: alloc.slot_mapping("x", 0, 0),
        lambda: alloc.page_table(["x"]),
    ]
    for call in calls:
        with pytest.raises(NotFound):
            call()
    assert alloc.num_free_pages == 4


# --- truncate and free -----------------------------------------------------------------------


def test_truncate_frees_whole_pages_only() -> None:
    alloc = PageAllocator(4, 4)
    alloc.allocate("a", 14)  # 4 pages
    alloc.truncate("a", 9)  # still needs 3 pages
    assert alloc.pages("a") == [1, 2, 3]
    assert alloc.num_tokens("a") == 9
    assert alloc.num_free_pages == 1
    alloc.truncate("a", 8)
    assert alloc.pages("a") == [1, 2]
    alloc.truncate("a", 0)
    assert alloc.pages("a") == []
    assert "a" in alloc
    assert alloc.num_free_pages == 4


@pytest.mark.parametrize("bad", [-1, 6])
def test_truncate_bounds(bad: int) -> None:
    alloc = PageAllocator(4, 4)
    alloc.allocate("a", 5)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.truncate("a", bad)
    assert alloc.num_tokens("a") == 5
    assert alloc.pages("a") == [1, 2]


def test_free_restores_pages_and_they_are_reused_lowest_first() -> None:
    alloc = PageAllocator(6, 2)
    alloc.allocate("a", 4)  # [1, 2]
    alloc.allocate("b", 2)  # [3]
    alloc.allocate("c", 4)  # [4, 5]
    alloc.free("a")
    assert alloc.num_free_pages == 3
    assert "a" not in alloc
    with pytest.raises(NotFound):
        alloc.free("a")
    alloc.allocate("d", 6)
    assert alloc.pages("d") == [1, 2, 6]
    for req_id in ("b", "c", "d"):
        alloc.free(req_id)
    assert alloc.num_free_pages == 6
    assert len(alloc) == 0


def test_pages_returns_a_copy() -> None:
    alloc = PageAllocator(4, 4)
    alloc.allocate("a", 4)
    alloc.pages("a").append(99)
    assert alloc.pages("a") == [1]


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


# --- property tests --------------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/extend/truncate/free sequences against a plain-dict model."""

    page_size = 1
    num_pages = 12

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(self.num_pages, self.page_size)
        self.model: dict[str, int] = {}  # req_id -> capacity in tokens
        self.next_id = 0

    def max_tokens(self) -> int:
        return 4 * self.page_size + 1

    def snapshot(self) -> tuple[int, dict[str, list[int]], dict[str, int]]:
        return (
            self.alloc.num_free_pages,
            {r: self.alloc.pages(r) for r in self.model},
            {r: self.alloc.num_tokens(r) for r in self.model},
        )

    @rule(target=requests, data=st.data())
    def allocate(self, data: st.DataObject) -> str:
        num_tokens = data.draw(st.integers(0, self.max_tokens()))
        req_id = f"r{self.next_id}"
        self.next_id += 1
        needed = math.ceil(num_tokens / self.page_size)
        if needed > self.alloc.num_free_pages:
            assert not self.alloc.can_allocate(num_tokens)
            before = self.snapshot()
            with pytest.raises(KVExhausted):
                self.alloc.allocate(req_id, num_tokens)
            assert self.snapshot() == before
            assert req_id not in self.alloc
        else:
            assert self.alloc.can_allocate(num_tokens)
            self.alloc.allocate(req_id, num_tokens)
            self.model[req_id] = num_tokens
        return req_id

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.model)))
        num_tokens = data.draw(st.integers(0, self.max_tokens()))
        capacity = self.model[req_id]
        needed = math.ceil((capacity + num_tokens) / self.page_size) - len(self.alloc.pages(req_id))
        assert self.alloc.pages_needed(req_id, num_tokens) == needed
        if needed > self.alloc.num_free_pages:
            assert not self.alloc.can_extend(req_id, num_tokens)
            before = self.snapshot()
            with pytest.raises(KVExhausted):
                self.alloc.extend(req_id, num_tokens)
            assert self.snapshot() == before
        else:
            self.alloc.extend(req_id, num_tokens)
            self.model[req_id] = capacity + num_tokens

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.model)))
        num_tokens = data.draw(st.integers(0, self.model[req_id]))
        kept = self.alloc.pages(req_id)[: math.ceil(num_tokens / self.page_size)]
        self.alloc.truncate(req_id, num_tokens)
        self.model[req_id] = num_tokens
        assert self.alloc.pages(req_id) == kept  # the surviving prefix does not move

    @rule(req_id=consumes(requests))
    def free(self, req_id: str) -> None:
        if req_id not in self.model:  # its allocation failed
            with pytest.raises(NotFound):
                self.alloc.free(req_id)
            return
        free_before = self.alloc.num_free_pages
        owned = len(self.alloc.pages(req_id))
        self.alloc.free(req_id)
        del self.model[req_id]
        assert req_id not in self.alloc
        assert self.alloc.num_free_pages == free_before + owned

    @invariant()
    def pages_are_consistent(self) -> None:
        alloc, size = self.alloc, self.page_size
        assert len(alloc) == len(self.model)
        all_pages: list[int] = []
        all_slots: list[int] = []
        req_ids = sorted(self.model)
        table = alloc.page_table(req_ids)
        for row, req_id in enumerate(req_ids):
            capacity = self.model[req_id]
            pages = alloc.pages(req_id)
            assert alloc.num_tokens(req_id) == capacity
            assert len(pages) == math.ceil(capacity / size)
            width = table.shape[1]
            assert table[row].tolist() == pages + [0] * (width - len(pages))
            slots = alloc.slot_mapping(req_id, 0, capacity)
            assert slots == [int(table[row, i // size]) * size + i % size for i in range(capacity)]
            all_pages += pages
            all_slots += slots
        assert len(set(all_pages)) == len(all_pages), "a page is owned twice"
        assert len(set(all_slots)) == len(all_slots), "a slot is mapped twice"
        assert all(1 <= page <= self.num_pages for page in all_pages), "null/out-of-range page"
        assert alloc.num_free_pages + len(all_pages) == self.num_pages

    def teardown(self) -> None:
        for req_id in list(self.model):
            self.alloc.free(req_id)
        assert len(self.alloc) == 0
        assert self.alloc.num_free_pages == self.num_pages


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_allocator_state_machine(page_size: int) -> None:
    machine = type(
        f"AllocatorMachinePage{page_size}", (AllocatorMachine,), {"page_size": page_size}
    )
    run_state_machine_as_test(
        machine, settings=settings(max_examples=40, stateful_step_count=30, deadline=None)
    )
