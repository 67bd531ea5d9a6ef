"""The paged KV pool's allocator as a state machine (hypothesis): random allocations,
extensions, truncations and frees against a model of its pages, checked after every step."""

from __future__ import annotations

import math

import pytest
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
from tandem.kv import PageAllocator


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
