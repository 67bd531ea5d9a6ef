"""The plain-torch KV compaction references (`kernels/reference.py`): accepted_slots on a
hand example, and compact_accepted against a copy-based snapshot oracle, position by
position."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import accepted_slots_ref, compact_accepted_ref


def test_accepted_slots_hand_example() -> None:
    page_table = torch.tensor([[7, 2]], dtype=torch.int32)
    src, dst = accepted_slots_ref(
        page_table, torch.tensor([2]), torch.tensor([[0, 2, 3, -1]]), torch.tensor([3]), 4
    )
    assert src.tolist() == [30, 8, 9] and dst.tolist() == [30, 31, 8]


@pytest.mark.parametrize("page_size", [1, 16])
def test_compact_accepted_moves_paths(page_size: int) -> None:
    g = torch.Generator().manual_seed(page_size)
    paths = [[0, 2, 3], [0, 1, 2, 3], [0, 3, 5, 6], [0], [0, 4]]
    base_lens = torch.tensor([5, 30, 14, 0, 15])  # 14 and 15 straddle a page boundary at 16
    bs, width, max_tokens = len(paths), 6, 48
    max_pages = -(-max_tokens // page_size)
    num_pages = bs * max_pages + 3
    page_table = torch.randperm(num_pages, generator=g)[: bs * max_pages].view(bs, max_pages)
    accept_index = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
    accept_len = torch.tensor([len(p) for p in paths])
    src, dst = accepted_slots_ref(page_table.int(), base_lens, accept_index, accept_len, page_size)
    caches = [torch.randn(num_pages * page_size, 2, 3, generator=g) for _ in range(4)]
    caches[1] = caches[1].to(torch.bfloat16)
    before = [c.clone() for c in caches]
    compact_accepted_ref(caches, src, dst)

    def slot(b: int, pos: int) -> int:
        return int(page_table[b, pos // page_size]) * page_size + pos % page_size

    for old, new in zip(before, caches, strict=True):
        snapshot = old.clone()
        snapshot[dst] = old[src]  # the copy-based oracle
        assert torch.equal(new, snapshot)
        for b, path in enumerate(paths):  # position by position
            for j, node in enumerate(path):
                base = int(base_lens[b])
                assert torch.equal(new[slot(b, base + j)], old[slot(b, base + node)])
        untouched = torch.ones(len(old), dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(new[untouched], old[untouched])


def test_compact_accepted_rejects_bad_slots() -> None:
    cache = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="distinct"):
        compact_accepted_ref([cache], torch.tensor([0, 1]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="outside"):
        compact_accepted_ref([cache], torch.tensor([4]), torch.tensor([1]))
    with pytest.raises(ValueError, match="dtype"):
        compact_accepted_ref([cache], torch.tensor([1], dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="page table"):
        accepted_slots_ref(
            torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([3]),
            torch.tensor([[0, 1]]),
            torch.tensor([2]),
            4,
        )
