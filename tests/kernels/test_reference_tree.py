"""The plain-torch tree references (`kernels/reference.py`) against recursive oracles:
build_tree's depths, masks and child links, and verify_greedy's accepted paths, on hand trees
and random padded ones."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.reference import build_tree_ref, verify_greedy_ref
from tests.helpers.kernel_oracles import I64, tree


@st.composite
def padded_trees(draw: st.DrawFn) -> tuple[list[list[int]], list[int], int]:
    """(parents rows, num_nodes, N) with garbage in the padding."""
    bs, n = draw(st.integers(1, 3)), draw(st.integers(1, 10))
    rows, num_nodes = [], []
    for _ in range(bs):
        k = draw(st.integers(1, n))
        real = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, k)]
        rows.append(real + [draw(st.integers(-5, 20)) for _ in range(k, n)])
        num_nodes.append(k)
    return rows, num_nodes, n


def naive_children(parents: list[int], k: int) -> list[list[int]]:
    return [[c for c in range(1, k) if parents[c] == x] for x in range(k)]


@given(padded_trees())
@settings(max_examples=150, deadline=None)
def test_build_tree_matches_recursive_oracle(trees: tuple[list[list[int]], list[int], int]) -> None:
    rows, num_nodes, n = trees
    depth, mask, first_child, next_sibling = build_tree_ref(
        torch.tensor(rows, dtype=I64), torch.tensor(num_nodes, dtype=I64)
    )
    for b, (parents, k) in enumerate(zip(rows, num_nodes, strict=True)):

        def ancestors(i: int, parents: list[int] = parents) -> set[int]:
            return {i} if i == 0 else {i} | ancestors(parents[i])

        children = naive_children(parents, k)
        want_fc, want_ns = [-1] * n, [-1] * n
        for x, kids in enumerate(children):
            want_fc[x] = kids[0] if kids else -1
            for a, c in itertools.pairwise(kids):
                want_ns[a] = c
        assert first_child[b].tolist() == want_fc and next_sibling[b].tolist() == want_ns
        assert depth[b].tolist() == [len(ancestors(i)) - 1 for i in range(k)] + [0] * (n - k)
        for i in range(n):
            seen = ancestors(i) if i < k else set()
            assert mask[b, i].tolist() == [j in seen for j in range(n)]


def test_build_tree_hand_tree_with_padding() -> None:
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 99, -7, 0]], dtype=I64)
    depth, mask, first_child, next_sibling = build_tree_ref(parents, torch.tensor([6, 3]))
    assert depth.tolist() == [[0, 1, 1, 2, 2, 2], [0, 1, 2, 0, 0, 0]]
    assert first_child.tolist() == [[1, 3, 5, -1, -1, -1], [1, 2, -1, -1, -1, -1]]
    assert next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1], [-1, -1, -1, -1, -1, -1]]
    assert mask[0, 4].tolist() == [True, True, False, False, True, False]
    lower = [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert mask[1].int().tolist() == [row + [0] * 3 for row in lower] + [[0] * 6] * 3


@pytest.mark.parametrize(
    ("parents", "num_nodes", "match"),
    [
        ([[-1, 0], [0, 0]], [2, 2], "request 1, node 0"),
        ([[-1, 0, 2]], [3], "request 0, node 2: parent 2"),
        ([[-1, 0, -1]], [3], "request 0, node 2: parent -1"),
        ([[-1, 0, 0]], [4], "request 0: num_nodes = 4"),
        ([[-1, 0, 0]], [0], "request 0: num_nodes = 0"),
    ],
)
def test_build_tree_rejects_invalid_trees(
    parents: list[list[int]], num_nodes: list[int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        build_tree_ref(torch.tensor(parents, dtype=I64), torch.tensor(num_nodes, dtype=I64))
    with pytest.raises(ValueError, match="dtype"):
        build_tree_ref(torch.tensor([[-1]], dtype=torch.int32), torch.tensor([1]))


# ----------------------------------------------------------------------------- verify_greedy


def greedy(parents: list[int], tokens: list[int], target: list[int], width: int) -> list[Any]:
    p, n = tree(parents)
    _, _, fc, ns = build_tree_ref(p, n)
    out = verify_greedy_ref(torch.tensor([tokens]), torch.tensor([target]), fc, ns, n, width)
    return [t[0].tolist() for t in out]


def test_verify_greedy_tables() -> None:
    chain = [-1, 0, 1, 2]
    assert greedy(chain, [9, 5, 6, 7], [5, 6, 7, 8], 4) == [[0, 1, 2, 3], 4, 8]
    assert greedy(chain, [9, 5, 6, 7], [5, 3, 7, 8], 4) == [[0, 1, -1, -1], 2, 3]
    assert greedy(chain, [9, 5, 6, 7], [4, 6, 7, 8], 6) == [[0, -1, -1, -1, -1, -1], 1, 4]
    branchy = [-1, 0, 0, 1, 2, 2]  # the second child matches at both levels
    assert greedy(branchy, [9, 10, 11, 12, 13, 14], [11, 0, 14, 0, 0, 99], 3) == [[0, 2, 5], 3, 99]
    assert greedy([-1, 0, 0], [9, 4, 4], [4, 7, 8], 2) == [[0, 1], 2, 7]  # equal siblings: first
    assert greedy([-1], [9], [42], 1) == [[0], 1, 42]  # a bare verified token


@given(padded_trees(), st.integers(0, 2**31))
@settings(max_examples=100, deadline=None)
def test_verify_greedy_matches_recursive_walk(
    trees: tuple[list[list[int]], list[int], int], seed: int
) -> None:
    rows, num_nodes, n = trees
    g = torch.Generator().manual_seed(seed)
    tokens, target_ids = torch.randint(0, 3, (2, len(rows), n), generator=g)
    parents_t, num_t = torch.tensor(rows, dtype=I64), torch.tensor(num_nodes, dtype=I64)
    depth, _, fc, ns = build_tree_ref(parents_t, num_t)
    width = int(depth.max()) + 2  # one spare column stays -1
    accept_index, accept_len, bonus = verify_greedy_ref(tokens, target_ids, fc, ns, num_t, width)
    assert accept_index.shape == (len(rows), width)
    for b, (parents, k) in enumerate(zip(rows, num_nodes, strict=True)):
        children, path = naive_children(parents, k), [0]
        while True:
            hits = [c for c in children[path[-1]] if tokens[b, c] == target_ids[b, path[-1]]]
            if not hits:
                break
            path.append(hits[0])
        assert accept_index[b].tolist() == path + [-1] * (width - len(path))
        assert accept_len[b] == len(path) and bonus[b] == target_ids[b, path[-1]]


def test_verify_greedy_ignores_padding_and_checks_width() -> None:
    parents, num = torch.tensor([[-1, 0, 1, 1]]), torch.tensor([2])
    _, _, fc, ns = build_tree_ref(parents, num)
    fc[0, 2:] = 0  # garbage links in the padding are never followed
    tokens, target = torch.tensor([[9, 5, 6, 7]]), torch.tensor([[5, 6, 7, 8]])
    out = verify_greedy_ref(tokens, target, fc, ns, num, 2)
    assert [t[0].tolist() for t in out] == [[0, 1], 2, 6]
    with pytest.raises(ValueError, match="accept_width 1 < max depth"):
        verify_greedy_ref(tokens, target, fc, ns, num, 1)
    fc[0, 1] = 1  # a link that does not point forward
    with pytest.raises(ValueError, match="first_child"):
        verify_greedy_ref(tokens, target, fc, ns, num, 2)
