"""Tests of the paged KV pool's allocator bookkeeping: allocation, extension, truncation and
freeing, all-or-none on exhaustion, and unknown requests."""

from __future__ import annotations

import pytest

from tandem.errors import KVExhausted, NotFound
from tandem.kv import PageAllocator

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
