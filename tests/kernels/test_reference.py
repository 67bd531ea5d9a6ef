"""Tests of the plain-torch kernel references (`kernels/reference.py`) against independent
oracles: softmax and sorting for top1/topk, recursive tree walks for build_tree and
verify_greedy, a scalar walker and a chi-square losslessness test for verify_sampling, and
snapshot copies for KV compaction."""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.reference import (
    accepted_slots_ref,
    build_tree_ref,
    compact_accepted_ref,
    top1_ref,
    topk_ref,
    verify_greedy_ref,
    verify_sampling_ref,
)

NEG_INF = float("-inf")
I64 = torch.int64
Verify = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

# ----------------------------------------------------------------------------- top1 / topk


def nasty_logits(vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:  # [R, V]
    """Random rows plus every special row the kernels must survive."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, vocab, generator=g) * 3
    x[1, [0, vocab // 2, vocab - 1]] = 50.0  # a three-way tie across chunks; index 0 wins
    x[2, torch.rand(vocab, generator=g) < 0.3] = NEG_INF  # -inf entries in a valid row
    x[2, vocab // 2] = 1.0
    x[3] = NEG_INF  # all -inf: invalid
    x[4, vocab // 3] = float("nan")  # one NaN: invalid
    x[5, vocab - 1] = float("inf")  # +inf: invalid
    x[6] = -1e4 + torch.randn(vocab, generator=g)  # all very negative, still valid
    x[7] = 1.5  # the whole row ties
    x[8, :] = NEG_INF
    x[8, vocab - 1] = 2.0  # the only finite entry is the last one
    x[9] = torch.round(x[9])  # many ties below the top
    x[10] = float("nan")  # all NaN
    return x.to(dtype)


def oracle_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax in fp64 plus a Python sort by (-value, index) for lowest-index ties."""
    x = logits.float()  # the values the kernels see
    valid = ~(x.isnan() | (x == float("inf"))).any(dim=1) & (x > NEG_INF).any(dim=1)
    logprobs = torch.log_softmax(x.double(), dim=1)
    ids = torch.arange(k).repeat(len(x), 1)
    out = torch.full((len(x), k), NEG_INF, dtype=torch.float64)
    for r in range(len(x)):
        if valid[r]:
            row = x[r].tolist()
            ids[r] = torch.tensor(sorted(range(len(row)), key=lambda i: (-row[i], i))[:k])
            out[r] = logprobs[r, ids[r]]
            top_values = torch.topk(x[r], k).values  # torch agrees on the values
            assert torch.equal(x[r, ids[r]], top_values)
    return ids, out, valid


def assert_logprobs_close(ours: torch.Tensor, ref: torch.Tensor, *, fp32_ulps: int = 0) -> None:
    """Probabilities within 1e-6 relative: |log p - log p_ref| <= 1e-6. A logprob far below 0
    cannot be held that closely in fp32 (at -40 one ulp is 3.8e-6), so `fp32_ulps` adds that
    many ulps of the value; top-1 logprobs are near 0 and need none."""
    assert ours.dtype == torch.float32
    assert (ours <= 0).all()
    assert torch.equal(ours == NEG_INF, ref == NEG_INF)
    finite = ref > NEG_INF
    error = (ours.double() - ref)[finite].abs()
    assert (error <= 1e-6 + fp32_ulps * 2.0**-23 * ref[finite].abs()).all(), error.max()


# Thousands of sequential chunks drift past 1e-6 in fp32, so chunks of 2 only on tiny vocabularies.
VOCAB_CHUNKS = [(v, c) for v in (6000, 6007) for c in (4096, 1000, 64)] + [
    (v, c) for v in (1, 3) for c in (4096, 2)
]


@pytest.mark.parametrize(("vocab", "chunk_size"), VOCAB_CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top1_matches_softmax(vocab: int, dtype: torch.dtype, chunk_size: int) -> None:
    logits = nasty_logits(vocab, dtype, seed=vocab)
    ids, logprob, valid = top1_ref(logits, chunk_size=chunk_size)
    ref_ids, ref_logprobs, ref_valid = oracle_topk(logits, 1)
    assert ids.dtype == I64 and valid.dtype == torch.bool
    assert ((ids >= 0) & (ids < vocab)).all()
    assert torch.equal(valid, ref_valid)
    assert torch.equal(ids, ref_ids[:, 0])
    assert_logprobs_close(logprob, ref_logprobs[:, 0])
    assert valid[[0, 1, 2, 6, 7, 8, 9]].all() and not valid[[3, 4, 5, 10]].any()
    assert ids[1] == 0 and ids[7] == 0 and ids[8] == vocab - 1


@pytest.mark.parametrize("vocab", [6007, 3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunk_size", [4096, 64])
def test_topk_matches_softmax(vocab: int, dtype: torch.dtype, chunk_size: int) -> None:
    logits = nasty_logits(vocab, dtype, seed=vocab + 1)
    k_max = vocab if vocab < 10 else 64
    all_ids, all_logprobs, ref_valid = oracle_topk(logits, k_max)
    for k in sorted({1, min(5, vocab), k_max}):
        ids, logprobs, valid = topk_ref(logits, k, chunk_size=chunk_size)
        ref_ids = all_ids[:, :k]  # invalid rows: arange(k_max)[:k]
        ref_logprobs = all_logprobs[:, :k]
        assert ids.shape == logprobs.shape == (len(logits), k)
        assert ((ids >= 0) & (ids < vocab)).all()
        assert torch.equal(valid, ref_valid)
        assert torch.equal(ids, ref_ids)
        assert_logprobs_close(logprobs, ref_logprobs, fp32_ulps=1)
        assert torch.equal(ids[~valid], torch.arange(k).expand(int((~valid).sum()), k))
    one_ids, one_logprobs, one_valid = topk_ref(logits, 1, chunk_size=chunk_size)
    top_ids, top_logprob, top_valid = top1_ref(logits, chunk_size=chunk_size)
    assert torch.equal(one_ids[:, 0], top_ids) and torch.equal(one_logprobs[:, 0], top_logprob)
    assert torch.equal(one_valid, top_valid)


def test_top_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k must be"):
        topk_ref(torch.zeros(2, 5), 6)
    with pytest.raises(ValueError, match="k must be"):
        topk_ref(torch.zeros(2, 5), 0)
    with pytest.raises(ValueError, match="floating"):
        top1_ref(torch.zeros(2, 5, dtype=I64))
    with pytest.raises(ValueError, match="shape"):
        top1_ref(torch.zeros(5))
    with pytest.raises(ValueError, match="chunk_size"):
        top1_ref(torch.zeros(2, 5), chunk_size=0)


# ----------------------------------------------------------------------------- trees


def tree(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded tree as (parents [1, N], num_nodes [1])."""
    return torch.tensor([parents], dtype=I64), torch.tensor([len(parents)], dtype=I64)


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


# ----------------------------------------------------------------------------- verify_sampling


def f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def scalar_sampling(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    coins: torch.Tensor,
    noise: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    num_nodes: torch.Tensor,
    width: int,
    *,
    cumulative: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verify_sampling one request at a time in plain Python, as a kernel thread walks a tree
    (fp32 sums emulated; no rounding fallback). `cumulative=False` is the classic bug: accept
    c_k when u < p(c_k); the chi-square test must catch it."""
    toks, p_all, u_all = tokens.tolist(), probs.tolist(), coins.tolist()
    e_all, fc, ns = noise.tolist(), first_child.tolist(), next_sibling.tolist()
    accept_index: list[list[int]] = []
    accept_len: list[int] = []
    bonus: list[int] = []
    for b in range(len(toks)):
        path = [0]
        while True:
            x, total, nxt, seen = path[-1], 0.0, -1, set()
            p, residual, c = p_all[b][x], list(p_all[b][x]), fc[b][x]
            while c != -1 and nxt == -1:
                t = toks[b][c]
                if t not in seen:  # a repeated sibling token is skipped
                    seen.add(t)
                    residual[t] = 0.0
                    total = f32(total + p[t]) if cumulative else p[t]
                    nxt = c if u_all[b][x] < total else -1
                c = ns[b][c]
            if nxt == -1:
                break
            path.append(nxt)
        race = [f32(r / e) if r > 0 else -1.0 for r, e in zip(residual, e_all[b], strict=True)]
        bonus.append(max(range(len(race)), key=lambda v: (race[v], -v)))
        accept_index.append(path + [-1] * (width - len(path)))
        accept_len.append(len(path))
    return torch.tensor(accept_index), torch.tensor(accept_len), torch.tensor(bonus)


def sample_one(
    p_root: list[float], coin: float, noise: list[float], children: list[int]
) -> list[Any]:
    tokens = [7, *children]  # node 0's token (here outside the vocabulary) is never read
    parents, num = tree([-1] + [0] * len(children))
    _, _, fc, ns = build_tree_ref(parents, num)
    probs = torch.tensor([[p_root] * len(tokens)])
    coins = torch.tensor([[coin] * len(tokens)])
    out = verify_sampling_ref(
        torch.tensor([tokens]), probs, coins, torch.tensor([noise]), fc, ns, num, 2
    )
    return [t[0].tolist() for t in out]


def test_verify_sampling_hand_coins() -> None:
    p, ones = [0.1, 0.2, 0.3, 0.4], [1.0] * 4
    # An accepted leaf draws the bonus from its own p: argmax p / 1 = token 3.
    assert sample_one(p, 0.1, ones, [1, 2]) == [[0, 1], 2, 3]  # 0.1 < 0.2: first child
    assert sample_one(p, 0.25, ones, [1, 2]) == [[0, 2], 2, 3]  # 0.25 < 0.2 + 0.3: second
    assert sample_one(p, 0.6, ones, [1, 2]) == [[0, -1], 1, 3]  # residual [.1, 0, 0, .4]
    assert sample_one(p, 0.6, [0.1, 1, 1, 1], [1, 2]) == [[0, -1], 1, 0]  # .1/.1 beats .4
    assert sample_one(p, 0.3, ones, [1, 1, 2]) == [[0, 3], 2, 3]  # the repeated 1 is skipped
    # A leaf draws from p itself, and a zero-probability token never wins the race.
    assert sample_one([0.0, 0.5, 0.5, 0.0], 0.5, [1e-30, 1, 2, 1e-30], []) == [[0, -1], 1, 1]
    # Rounding: the children hold all the mass, yet their fp32 sum ends just below u.
    below_one = 1.0 - 2.0**-24
    p_edge = [0.0, 0.5, 0.5 - 2.0**-24, 0.0]
    assert sample_one(p_edge, below_one, ones, [1, 2]) == [[0, 2], 2, 1]


def random_sampling_batch(bs: int, n: int, vocab: int, seed: int) -> tuple[Any, ...]:
    """Random padded trees with repeated sibling tokens and zero-probability tokens."""
    g = torch.Generator().manual_seed(seed)
    num = torch.randint(1, n + 1, (bs,), generator=g)
    parents = torch.full((bs, n), -1, dtype=I64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bs,), generator=g)
    _, _, fc, ns = build_tree_ref(parents, num)
    tokens = torch.randint(0, vocab, (bs, n), generator=g)
    logits = torch.randn(bs, n, vocab, generator=g) * 2
    logits[torch.rand(bs, n, vocab, generator=g) < 0.3] = NEG_INF
    logits[..., 0] = 0.0  # keep every row normalisable
    probs = torch.softmax(logits, dim=-1)
    coins = torch.rand(bs, n, generator=g)
    noise = torch.empty(bs, vocab).exponential_(generator=g)
    return tokens, probs, coins, noise, fc, ns, num, n


def test_verify_sampling_matches_scalar_walker() -> None:
    args = random_sampling_batch(bs=300, n=9, vocab=5, seed=3)
    ours, scalar = verify_sampling_ref(*args), scalar_sampling(*args)
    for a, b in zip(ours, scalar, strict=True):
        assert torch.equal(a, b)
    assert (ours[1] > 1).any() and (ours[1] > 2).any()  # the walk went deep somewhere


def test_verify_sampling_one_hot_is_greedy() -> None:
    tokens, probs, coins, noise, fc, ns, num, n = random_sampling_batch(200, 8, 4, seed=5)
    target_ids = probs.argmax(dim=-1)
    one_hot = torch.nn.functional.one_hot(target_ids, 4).float()
    ours = verify_sampling_ref(tokens, one_hot, coins, noise, fc, ns, num, n)
    for a, b in zip(ours, verify_greedy_ref(tokens, target_ids, fc, ns, num, n), strict=True):
        assert torch.equal(a, b)


# Upper 0.001 quantile of chi-square with 63 degrees of freedom (64 token pairs): 103.442
# (NIST/SEMATECH e-Handbook 1.3.6.7.4, table of upper critical values); a statistic below it
# <=> p-value above 1e-3. The test re-derives it from the regularised incomplete gamma.
CHI2_CRITICAL_999_DF63 = 103.442


def two_token_chi2(verify: Verify, num_samples: int = 40_000) -> float:
    """Chi-square of the first two generated tokens against p_root(a) * p_next[a](b).

    The tree: node 0 with children of tokens 3, 5, 1; the 5 has children of tokens 5 and 6.
    Each node's target distribution is the target's next-token distribution after its path.
    Generated tokens = accepted drafts + bonus; a lone bonus is followed by a plain draw from
    p_next[bonus], as the next cycle would.
    """
    vocab, g = 8, torch.Generator().manual_seed(2024)
    p_root = torch.softmax(torch.randn(vocab, generator=g) * 0.5, dim=0)
    p_next = torch.softmax(torch.randn(vocab, vocab, generator=g) * 0.5, dim=1)  # [a, b]
    node_tokens = torch.tensor([0, 3, 5, 1, 5, 6])
    node_probs = torch.stack([p_root, p_next[3], p_next[5], p_next[1], p_root, p_root])
    parents, num = tree([-1, 0, 0, 0, 2, 2])
    _, _, fc, ns = build_tree_ref(parents, num)
    bs = num_samples
    accept_index, accept_len, bonus = verify(
        node_tokens.expand(bs, -1),
        node_probs.expand(bs, -1, -1).contiguous(),
        torch.rand(bs, 6, generator=g),
        torch.empty(bs, vocab).exponential_(generator=g),
        fc.expand(bs, -1),
        ns.expand(bs, -1),
        num.expand(bs),
        3,
    )
    path_tokens = node_tokens[accept_index.clamp(min=0)]  # [bs, 3]
    first = torch.where(accept_len >= 2, path_tokens[:, 1], bonus)
    after = torch.multinomial(p_next[first], 1, generator=g)[:, 0]
    second = torch.where(
        accept_len >= 3, path_tokens[:, 2], torch.where(accept_len == 2, bonus, after)
    )
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab).double()
    expected = bs * (p_root[:, None] * p_next).flatten().double()
    assert expected.min() > 20  # the chi-square approximation holds
    return float(((counts - expected) ** 2 / expected).sum())


def test_verify_sampling_is_lossless() -> None:
    tail = torch.special.gammaincc(torch.tensor(63 / 2), torch.tensor(CHI2_CRITICAL_999_DF63 / 2))
    assert math.isclose(float(tail), 1e-3, rel_tol=1e-3)
    assert two_token_chi2(verify_sampling_ref) < CHI2_CRITICAL_999_DF63


def test_chi2_catches_acceptance_without_cumulative_sum() -> None:
    def wrong(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return scalar_sampling(*args, cumulative=False)

    assert two_token_chi2(wrong) > CHI2_CRITICAL_999_DF63


# ----------------------------------------------------------------------------- KV compaction


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
