"""Independent oracles and inputs the kernel tests share: logits with every special row
(ties, -inf, NaN, +inf), a softmax-and-sort top-k, the logprob tolerance, random padded trees
for verify_sampling, and the chi-square test of its losslessness."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels.reference import build_tree_ref

NEG_INF = float("-inf")
I64 = torch.int64
Verify = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


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


def tree(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded tree as (parents [1, N], num_nodes [1])."""
    return torch.tensor([parents], dtype=I64), torch.tensor([len(parents)], dtype=I64)


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
