"""Chi-square tests of the sampled distribution: frequencies match the processed distribution
(and the test rejects the unprocessed one), and filtered tokens are never drawn."""

from __future__ import annotations

import pytest
import torch

from tandem.sampling import (
    SamplingBatch,
    SamplingParams,
    make_generator,
    process_logits,
    sample,
)
from tests.helpers.sampling import (
    CHI2_CRITICAL_999,
    NEG_INF,
    VOCAB,
    hf_process,
    make_batch,
    make_logits,
    padded_ids,
)

# ----------------------------------------------------------------------------- distribution

SMALL_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.3, -0.8, -1.5])
DISTRIBUTION_CASES = {
    "temperature": (SamplingParams(temperature=0.8), []),
    "top_k": (SamplingParams(temperature=1.0, top_k=5), []),
    "top_p": (SamplingParams(temperature=1.2, top_p=0.8), []),
    "min_p": (SamplingParams(temperature=0.7, min_p=0.1), []),
    "all": (
        SamplingParams(temperature=1.5, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
        [0, 3],
    ),
}
NUM_ROWS, NUM_STEPS = 1000, 20  # 20000 draws


def draw_counts(p: SamplingParams, seen: list[int], seed: int) -> torch.Tensor:  # [8]
    params = [p] * NUM_ROWS
    generators = [make_generator(seed * NUM_ROWS + row, "cpu") for row in range(NUM_ROWS)]
    batch = SamplingBatch.build(params, generators, "cpu")
    logits = SMALL_LOGITS.expand(NUM_ROWS, -1)  # [rows, 8]
    ids = padded_ids([seen] * NUM_ROWS, width=2)
    counts = torch.zeros(len(SMALL_LOGITS), dtype=torch.int64)
    for _ in range(NUM_STEPS):
        counts += torch.bincount(sample(logits, batch, ids), minlength=len(SMALL_LOGITS))
    return counts


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the tokens with expected mass, and its degrees of freedom."""
    kept = expected_probs > 0
    expected = expected_probs[kept].double() * counts.sum()
    assert bool((expected >= 5).all()), "chi-square needs >= 5 expected draws per cell"
    stat = ((counts[kept].double() - expected) ** 2 / expected).sum()
    return float(stat), int(kept.sum()) - 1


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_sampled_frequencies_match_processed_distribution(case: str) -> None:
    p, seen = DISTRIBUTION_CASES[case]
    counts = draw_counts(p, seen, seed=list(DISTRIBUTION_CASES).index(case) + 1)
    expected = hf_process(SMALL_LOGITS[None], [p], [seen]).softmax(dim=-1)[0]  # [8]
    if case != "temperature":
        assert bool((expected == 0).any()), "the case should filter something"
    assert int(counts[expected == 0].sum()) == 0, "a filtered-out token was sampled"
    stat, dof = chi_square(counts, expected)
    assert stat < CHI2_CRITICAL_999[dof], f"chi2={stat:.1f} with {dof} dof: p < 1e-3"


def test_chi_square_rejects_the_unprocessed_distribution() -> None:
    """The statistical test has power: the raw softmax is not what min_p + temperature give."""
    p, seen = DISTRIBUTION_CASES["min_p"]
    counts = draw_counts(p, seen, seed=99)
    stat, dof = chi_square(counts, SMALL_LOGITS.softmax(dim=-1))
    assert stat > 100 * CHI2_CRITICAL_999[dof]


def test_filtered_tokens_are_never_sampled_on_a_large_vocabulary() -> None:
    params = [
        SamplingParams(temperature=1.5, top_k=3, seed=1),
        SamplingParams(temperature=2.0, top_p=0.3, seed=2),
        SamplingParams(temperature=3.0, min_p=0.5, seed=3),
    ]
    logits = make_logits(len(params), VOCAB, 12)
    batch = make_batch(params)
    allowed = process_logits(logits, batch, None) > NEG_INF  # [bs, V]
    assert bool((allowed.sum(dim=-1) < VOCAB // 10).all())
    drawn = torch.stack([sample(logits, batch, None) for _ in range(100)], dim=1)  # [bs, 100]
    assert bool(allowed.gather(1, drawn).all())
    assert bool(((allowed.sum(dim=-1) == 1) | (drawn.amin(1) != drawn.amax(1))).all())
