"""The Triton tree kernels (`build_tree`, `verify_greedy`, `verify_sampling`, `accepted_slots`)
against their references: exact outputs on random padded trees up to 64 nodes with garbage in
the padding, deep accepted paths, repeated sibling tokens, zero-probability tokens, the rounding
case of `verify_sampling`, page sizes 1 and 16, and the references' validation errors. Without
CUDA the kernels run interpreted; the `gpu` tests add big batches and the chi-square
losslessness test of `verify_sampling` on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
import kernels
from kernels.reference import (
    _link_depths,
    accepted_slots_ref,
    build_tree_ref,
    verify_greedy_ref,
    verify_sampling_ref,
)
from kernels.tree import (
    _build_tree_kernel,
    accepted_slots,
    build_tree,
    verify_greedy,
    verify_sampling,
)
from tests.helpers.kernel_oracles import (
    CHI2_CRITICAL_999_DF63,
    random_sampling_batch,
    two_token_chi2,
)

check_mode(_build_tree_kernel)

I64 = torch.int64
NEG_INF = float("-inf")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = [(1, 1), (3, 2), (5, 7), (3, 17), (2, 64)]  # (bs, N)


def random_trees(bs: int, n: int, seed: int, device: torch.device = DEVICE) -> tuple[Any, Any]:
    """(parents [bs, N], num_nodes [bs]) with garbage in the padding; request 0 is full."""
    g = torch.Generator().manual_seed(seed)
    num = torch.randint(1, n + 1, (bs,), generator=g)
    num[0] = n
    parents = torch.full((bs, n), -1, dtype=I64)
    for i in range(1, n):  # mostly recent parents: deep trees
        lo = torch.clamp(torch.tensor(i - 3), min=0)
        parents[:, i] = torch.randint(int(lo), i, (bs,), generator=g)
    for b in range(bs):
        parents[b, int(num[b]) :] = torch.randint(-5, 99, (n - int(num[b]),), generator=g)
    return parents.to(device), num.to(device)


def assert_same(ours: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def same_error(ours: Callable[[], object], ref: Callable[[], object]) -> str:
    """Both raise ValueError with the same message; returns it."""
    with pytest.raises(ValueError) as want:
        ref()
    with pytest.raises(ValueError) as got:
        ours()
    assert str(got.value) == str(want.value)
    return str(want.value)


# ----------------------------------------------------------------------------- build_tree


@pytest.mark.parametrize(("bs", "n"), SHAPES)
def test_build_tree_matches_reference(bs: int, n: int) -> None:
    parents, num = random_trees(bs, n, seed=bs * 100 + n)
    assert_same(build_tree(parents, num), build_tree_ref(parents, num))
    star = torch.tensor([[-1] + [0] * (n - 1)], device=DEVICE)
    full = torch.tensor([n], device=DEVICE)
    assert_same(build_tree(star, full), build_tree_ref(star, full))


@pytest.mark.parametrize(
    ("parents", "num_nodes"),
    [
        ([[-1, 0], [0, 0]], [2, 2]),
        ([[-1, 0, 2]], [3]),
        ([[-1, 0, -1]], [3]),
        ([[-1, 0, 0]], [4]),
        ([[-1, 0, 0]], [0]),
    ],
)
def test_build_tree_rejects_what_the_reference_rejects(
    parents: list[list[int]], num_nodes: list[int]
) -> None:
    p = torch.tensor(parents, device=DEVICE)
    num = torch.tensor(num_nodes, device=DEVICE)
    same_error(lambda: build_tree(p, num), lambda: build_tree_ref(p, num))
    same_error(lambda: build_tree(p.int(), num), lambda: build_tree_ref(p.int(), num))


def test_trusted_values_skips_only_the_value_checks() -> None:
    """Inside ``trusted_values`` (the engine's verification of checked trees) the wrappers do
    not read their inputs back: a bad parent passes; shapes are still checked; outside and
    after the (nested) blocks the values are checked again."""
    bad = torch.tensor([[-1, 2, 0]], device=DEVICE)  # node 1's parent comes after it
    num = torch.tensor([3], device=DEVICE)
    with pytest.raises(ValueError, match="parent"):
        build_tree(bad, num)
    with kernels.trusted_values():
        with kernels.trusted_values():
            build_tree(bad, num)
        build_tree(bad, num)
        with pytest.raises(ValueError, match="num_nodes"):
            build_tree(bad, num[None])  # a shape: always checked
    with pytest.raises(ValueError, match="parent"):
        build_tree(bad, num)


# ----------------------------------------------------------------------------- verify_greedy


@pytest.mark.parametrize(("bs", "n"), SHAPES)
def test_verify_greedy_matches_reference(bs: int, n: int) -> None:
    parents, num = random_trees(bs, n, seed=bs * 10 + n)
    depth, _, fc, ns = build_tree_ref(parents, num)
    g = torch.Generator().manual_seed(n)
    tokens, target = torch.randint(0, 2, (2, bs, n), generator=g).to(DEVICE)  # deep paths
    width = int(depth.max()) + 1
    for w in (width, width + 2):
        ours = verify_greedy(tokens, target, fc, ns, num, w)
        assert_same(ours, verify_greedy_ref(tokens, target, fc, ns, num, w))
    # A chain whose every draft matches: the whole tree is accepted.
    chain = torch.arange(-1, n - 1, device=DEVICE)[None]
    full = torch.tensor([n], device=DEVICE)
    _, _, cfc, cns = build_tree_ref(chain, full)
    toks = torch.arange(n, device=DEVICE)[None]
    index, length, bonus = verify_greedy(toks, toks + 1, cfc, cns, full, n)
    assert index.tolist() == [list(range(n))] and length.tolist() == [n] and bonus.tolist() == [n]


def test_verify_greedy_rejects_what_the_reference_rejects() -> None:
    parents = torch.tensor([[-1, 0, 1, 1]], device=DEVICE)
    num = torch.tensor([4], device=DEVICE)
    _, _, fc, ns = build_tree_ref(parents, num)
    tokens = torch.tensor([[9, 5, 6, 7]], device=DEVICE)
    args = (tokens, tokens, fc, ns, num)
    message = same_error(lambda: verify_greedy(*args, 2), lambda: verify_greedy_ref(*args, 2))
    assert "accept_width" in message
    bad = fc.clone()
    bad[0, 1] = 1  # a link that does not point forward
    args = (tokens, tokens, bad, ns, num)
    same_error(lambda: verify_greedy(*args, 3), lambda: verify_greedy_ref(*args, 3))
    args = (tokens, tokens[:, :3], fc, ns, num)
    same_error(lambda: verify_greedy(*args, 3), lambda: verify_greedy_ref(*args, 3))


# ----------------------------------------------------------------------------- verify_sampling


def peaked_batch(bs: int, n: int, vocab: int, seed: int) -> tuple[Any, ...]:
    """Trees whose target mass sits on the drafted children (deep acceptance), with repeated
    sibling tokens, zero-probability tokens and 2 spare width columns."""
    g = torch.Generator().manual_seed(seed)
    parents, num = random_trees(bs, n, seed, device=torch.device("cpu"))
    depth, _, fc, ns = build_tree_ref(parents, num)
    tokens = torch.randint(0, min(vocab, 6), (bs, n), generator=g)
    logits = torch.randn(bs, n, vocab, generator=g)
    logits[torch.rand(bs, n, vocab, generator=g) < 0.2] = NEG_INF
    logits[..., 0] = 0.0  # every row normalisable
    for i in range(1, n):  # raise each child's token at its parent
        p = torch.where(i < num, parents[:, i], 0)  # padding parents are garbage
        logits[torch.arange(bs), p, tokens[:, i]] = 2.0 + math.log(vocab)
    probs = torch.softmax(logits, dim=-1)
    coins = torch.rand(bs, n, generator=g)
    noise = torch.empty(bs, vocab).exponential_(generator=g)
    args = (tokens, probs, coins, noise, fc, ns, num, int(depth.max()) + 2)
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


def on_device(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize(("bs", "n", "vocab"), [(30, 9, 5), (7, 16, 1000), (3, 64, 300), (5, 2, 1)])
def test_verify_sampling_matches_reference(bs: int, n: int, vocab: int) -> None:
    args = on_device(random_sampling_batch(bs, n, vocab, seed=bs + n))
    assert_same(verify_sampling(*args), verify_sampling_ref(*args))
    args = peaked_batch(bs, n, vocab, seed=n)
    ours = verify_sampling(*args)
    assert_same(ours, verify_sampling_ref(*args))
    if n > 8 and vocab > 5:
        assert int(ours[1].max()) >= 4  # the walks went deep
    # fp64 coins and noise are compared as torch promotes them.
    args = (*args[:2], args[2].double(), args[3].double(), *args[4:])
    assert_same(verify_sampling(*args), verify_sampling_ref(*args))


def test_verify_sampling_hand_cases() -> None:
    def one(p_root: list[float], coin: float, noise: list[float], children: list[int]) -> Any:
        tokens = torch.tensor([[7, *children]], device=DEVICE)
        parents = torch.tensor([[-1] + [0] * len(children)], device=DEVICE)
        num = torch.tensor([len(children) + 1], device=DEVICE)
        _, _, fc, ns = build_tree_ref(parents, num)
        probs = torch.tensor([[p_root] * (len(children) + 1)], device=DEVICE)
        coins = torch.full((1, len(children) + 1), coin, device=DEVICE)
        args = (tokens, probs, coins, torch.tensor([noise], device=DEVICE), fc, ns, num, 2)
        ours = verify_sampling(*args)
        assert_same(ours, verify_sampling_ref(*args))
        return [t[0].tolist() for t in ours]

    p, ones = [0.1, 0.2, 0.3, 0.4], [1.0] * 4
    assert one(p, 0.1, ones, [1, 2]) == [[0, 1], 2, 3]
    assert one(p, 0.25, ones, [1, 2]) == [[0, 2], 2, 3]
    assert one(p, 0.6, ones, [1, 2]) == [[0, -1], 1, 3]
    assert one(p, 0.6, [0.1, 1, 1, 1], [1, 2]) == [[0, -1], 1, 0]
    assert one(p, 0.3, ones, [1, 1, 2]) == [[0, 3], 2, 3]  # the repeated 1 is skipped
    assert one(p, 0.9, [1, 0.01, 0.01, 1], [1, 2]) == [[0, -1], 1, 3]  # rejected: never drawn
    assert one([0.0, 0.5, 0.5, 0.0], 0.5, [1e-30, 1, 2, 1e-30], []) == [[0, -1], 1, 1]
    below_one = 1.0 - 2.0**-24  # rounding: the children's fp32 sum ends just below u
    assert one([0.0, 0.5, 0.5 - 2.0**-24, 0.0], below_one, ones, [1, 2]) == [[0, 2], 2, 1]


def test_verify_sampling_rejects_what_the_reference_rejects() -> None:
    tokens, probs, coins, noise, fc, ns, num, width = on_device(random_sampling_batch(3, 4, 6, 1))
    cases = [
        (tokens, probs * 2, coins, noise),
        (tokens, probs, coins + 1, noise),
        (tokens, probs, coins, -noise),
        (tokens + 10, probs, coins, noise),
        (tokens, probs.double(), coins, noise),
    ]
    for t, p, c, e in cases:
        args = (t, p, c, e, fc, ns, num, width)
        same_error(partial(verify_sampling, *args), partial(verify_sampling_ref, *args))


# ----------------------------------------------------------------------------- link depths


def walk_depths(first_child: torch.Tensor, next_sibling: torch.Tensor, real: torch.Tensor) -> Any:
    """The depth walk `_link_depths` replaces: one node at a time, in node order."""
    bs, n = first_child.shape
    rows = torch.arange(bs)
    depth = torch.zeros(bs, n, dtype=I64)
    for x in range(n):
        for link, step in ((first_child, 1), (next_sibling, 0)):
            has = real[:, x] & (link[:, x] >= 0)
            depth[rows[has], link[has, x]] = depth[has, x] + step
    return depth


@pytest.mark.parametrize("n", [1, 2, 5, 33])
def test_link_depths_equal_the_node_order_walk(n: int) -> None:
    """Forward links as `_check_links` admits them, nodes linked twice included."""
    g = torch.Generator().manual_seed(n)
    bs = 50
    num = torch.randint(1, n + 1, (bs,), generator=g)
    real = torch.arange(n)[None] < num[:, None]
    links = []
    for _ in range(2):
        offset = torch.randint(1, n + 1, (bs, n), generator=g)
        link = torch.arange(n)[None] + offset
        link = torch.where((link < num[:, None]) & (torch.rand(bs, n, generator=g) < 0.7), link, -1)
        links.append(link)
    first_child, next_sibling = links
    next_sibling[:, 0] = -1
    assert torch.equal(
        _link_depths(first_child, next_sibling, real), walk_depths(first_child, next_sibling, real)
    )


# ----------------------------------------------------------------------------- accepted_slots


@pytest.mark.parametrize("page_size", [1, 16])
def test_accepted_slots_matches_reference(page_size: int) -> None:
    g = torch.Generator().manual_seed(page_size)
    paths = [[0, 2, 3], [0, 1, 2, 3], [0, 3, 5, 6], [0], [0, 4]]
    base_lens = torch.tensor([5, 30, 14, 0, 15])  # 14 and 15 straddle a page boundary at 16
    bs, width = len(paths), 6
    max_pages = -(-48 // page_size)
    page_table = torch.randperm(bs * max_pages + 3, generator=g)[: bs * max_pages]
    page_table = page_table.view(bs, max_pages).int()
    accept_index = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
    accept_len = torch.tensor([len(p) for p in paths])
    args = on_device((page_table, base_lens, accept_index, accept_len, page_size))
    assert_same(accepted_slots(*args), accepted_slots_ref(*args))
    bad = on_device((page_table, base_lens + 40, accept_index, accept_len, page_size))
    same_error(lambda: accepted_slots(*bad), lambda: accepted_slots_ref(*bad))
    bad = on_device((page_table, base_lens, accept_index, accept_len + 3, page_size))
    same_error(lambda: accepted_slots(*bad), lambda: accepted_slots_ref(*bad))


# ----------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@gpu
def test_tree_kernels_on_cuda_at_scale() -> None:
    parents, num = random_trees(64, 64, seed=1, device=torch.device("cuda"))
    tree = build_tree(parents, num)
    assert_same(tree, build_tree_ref(parents, num))
    depth, _, fc, ns = tree
    g = torch.Generator(device="cuda").manual_seed(2)
    tokens, target = torch.randint(0, 2, (2, 64, 64), device="cuda", generator=g)
    width = int(depth.max()) + 1
    assert_same(
        verify_greedy(tokens, target, fc, ns, num, width),
        verify_greedy_ref(tokens, target, fc, ns, num, width),
    )
    args: tuple[Any, ...] = tuple(
        a.cuda() if isinstance(a, torch.Tensor) else a for a in peaked_batch(64, 64, 32000, 3)
    )
    assert_same(verify_sampling(*args), verify_sampling_ref(*args))


@pytest.mark.gpu
@gpu
def test_verify_sampling_is_lossless_on_cuda() -> None:
    def kernel(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        moved: list[Any] = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        index, length, bonus = verify_sampling(*moved)
        return index.cpu(), length.cpu(), bonus.cpu()

    assert two_token_chi2(kernel) < CHI2_CRITICAL_999_DF63
