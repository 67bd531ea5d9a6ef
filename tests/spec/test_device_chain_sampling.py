"""Sampled requests in device-chain runs (``tandem/target/chain_sampling.py``).

A sampled row of a run is verified as the ordinary step verifies it, from the request's own
generator in the same blocks: a seeded request's tokens are the same whether its steps ran as
device-chain steps or as ordinary ones, greedy and sampled requests mixed in one run (one
opted out of speculation), with top-k and top-p. The verdict itself is checked against the
tree reference on chains, and by a chi-square test of the tokens one step commits.
"""

from __future__ import annotations

import pytest
import torch

import tests.kernels._interpret  # noqa: F401 (sets Triton's mode: import first)

# isort: split
from kernels.reference import build_tree_ref, verify_sampling_ref
from tandem.target.chain_sampling import sampled_verdict
from tests.driving import drive
from tests.helpers.device_chain import MIXED, chain_engine, check_pools_empty, ordinary_engine
from tests.helpers.sampling import CHI2_CRITICAL_999
from tests.spec.conftest import Checkpoints


def test_sampled_requests_run_in_device_chain_runs_with_their_own_random_streams(
    ckpts: Checkpoints,
) -> None:
    expected, _ = drive(ordinary_engine(ckpts, 3), MIXED)
    engine = chain_engine(ckpts, "eagle3", 3)
    outputs, _ = drive(engine, MIXED)
    chain = engine.chain
    assert chain is not None
    assert chain.runs >= 2 and chain.launches >= 10, (chain.runs, chain.launches)
    assert chain.target.sampled_steps >= 10, chain.target.sampled_steps
    assert chain.launches > chain.target.sampled_steps  # and greedy rows alone
    assert chain.opted_out >= 1
    assert outputs == expected
    greedy_alone, _ = drive(ordinary_engine(ckpts, 3), [MIXED[1]])
    assert outputs[1] == greedy_alone[0]  # the greedy one, beside sampled ones
    check_pools_empty(engine)


@pytest.mark.gpu
def test_captured_runs_sample_as_the_ordinary_cycle(ckpts: Checkpoints) -> None:
    """The same with the buckets captured: a graph per set of filters, replayed with the
    coins and noise drawn before each launch."""
    expected, _ = drive(ordinary_engine(ckpts, 3), MIXED)
    engine = chain_engine(ckpts, "eagle3", 3, page_size=16, capture=True, max_model_len=512)
    outputs, _ = drive(engine, MIXED)
    assert outputs == expected
    chain = engine.chain
    assert chain is not None and chain.target.sampled_steps >= 10
    keys = {key for static in chain.target._statics.values() for key in static.graphs}
    assert None in keys and len(keys) >= 2, keys  # greedy rows alone, and sampled ones
    check_pools_empty(engine)


@pytest.mark.parametrize("seed", range(4))
def test_the_chain_verdict_is_the_tree_reference_on_chains(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    bs, s, vocab = 64, 4, 12
    logits = torch.randn(bs * (s + 1), vocab, generator=gen) * 3
    logits[torch.rand(logits.shape, generator=gen) < 0.3] = float("-inf")  # filtered tokens
    logits[:, 0] = logits[:, 0].clamp(min=-5.0)  # one token stays possible
    logits[:8] = float("-inf")  # rows whose whole mass sits on one token: the rounding case
    logits[:8, 3] = 0.0
    probs = logits.softmax(-1).view(bs, s + 1, vocab)
    # Drafts mostly likely tokens, some impossible, some chains cut short.
    drafts = torch.multinomial(probs[:, :s].reshape(-1, vocab), 1, generator=gen).view(bs, s)
    drafts[::5, 1] = torch.randint(0, vocab, (len(drafts[::5]),), generator=gen)
    valid = torch.ones(bs, s, dtype=torch.bool)
    valid[::3, 2:] = False
    valid[::7, :] = False
    coins = torch.rand(bs, s + 1, generator=gen)
    noise = torch.empty(bs, vocab).exponential_(generator=gen).clamp_(min=1e-38)

    accepted, bonus = sampled_verdict(logits, drafts, valid, coins, noise)

    depth = torch.cumprod(valid.long(), 1).sum(1)
    for b in range(bs):
        n = int(depth[b]) + 1
        tokens = torch.tensor([[0, *drafts[b, : n - 1].tolist()]])
        parents = torch.tensor([[-1, *range(n - 1)]])
        _, _, first_child, next_sibling = build_tree_ref(parents, torch.tensor([n]))
        _, length, ref_bonus = verify_sampling_ref(
            tokens, probs[b : b + 1, :n], coins[b : b + 1, :n], noise[b : b + 1],
            first_child, next_sibling, torch.tensor([n]), n,
        )  # fmt: skip
        assert int(accepted[b]) == int(length[0]) - 1, b
        assert int(bonus[b]) == int(ref_bonus[0]), b


def _fits(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether ``tokens`` follow ``probs`` (chi-square at p = 0.001; none of zero
    probability)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    possible = probs > 0
    assert counts[~possible].sum() == 0, "a token of zero probability"
    expected = probs[possible].double() * counts.sum()
    stat = float(((counts[possible] - expected) ** 2 / expected).sum())
    return stat < CHI2_CRITICAL_999[int(possible.sum()) - 1]


def _new_tokens(coin_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """60,000 draws of one chain step: every node's distribution and the drafts fixed, the
    coins (scaled by ``coin_scale``) and the race's noise drawn. Returns the node
    distributions [S+1, V], the drafts [S] and the new tokens [n, S+1] (-1 past the bonus)."""
    gen = torch.Generator().manual_seed(11)
    n, s = 60_000, 2
    probs = torch.tensor(
        [
            [0.45, 0.25, 0.0, 0.15, 0.1, 0.05],  # node 0 (a token cut by a filter)
            [0.05, 0.1, 0.55, 0.2, 0.0, 0.1],  # after draft 1
            [0.3, 0.3, 0.1, 0.1, 0.1, 0.1],  # after draft 2
        ]
    )
    drafts = torch.tensor([0, 2])
    processed = probs.log().repeat(n, 1)  # [n * (S+1), V]: log 0 = -inf, a filtered token
    coins = torch.rand(n, s + 1, generator=gen) * coin_scale
    noise = torch.empty(n, probs.shape[1]).exponential_(generator=gen).clamp_(min=1e-38)
    valid = torch.ones(n, s, dtype=torch.bool)
    accepted, bonus = sampled_verdict(processed, drafts.repeat(n, 1), valid, coins, noise)
    j = torch.arange(s + 1)[None, :]
    shifted = torch.cat([drafts, torch.tensor([-1])])[None, :].expand(n, -1)
    new = torch.where(j < accepted[:, None], shifted, -1)
    new = torch.where(j == accepted[:, None], bonus[:, None], new)
    return probs, drafts, new


def test_a_chain_verdict_keeps_the_target_distribution() -> None:
    """Each new token follows the target's distribution at its node, given the ones before
    it (a lossless step); coins scaled down (drafts accepted too often) fail the same test."""
    probs, drafts, new = _new_tokens(1.0)
    assert _fits(new[:, 0], probs[0])
    after_first = new[new[:, 0] == drafts[0]]
    assert _fits(after_first[:, 1], probs[1])
    after_both = after_first[after_first[:, 1] == drafts[1]]
    assert _fits(after_both[:, 2], probs[2])
    biased_probs, _, biased = _new_tokens(0.7)
    assert not _fits(biased[:, 0], biased_probs[0])
