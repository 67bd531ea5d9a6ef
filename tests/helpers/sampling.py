"""What the sampling tests share: transformers' processors as `generate` builds them (the
reference), batches, logits with ties and masked entries, seen tokens, and the parity params."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tandem.sampling import (
    SamplingBatch,
    SamplingParams,
    make_generator,
)

NEG_INF = float("-inf")
VOCAB = 6007  # odd, so nothing lines up with a power of two
MAX_SEEN = 40

# Upper 0.001 quantiles of the chi-square distribution by degrees of freedom (standard table,
# e.g. NIST/SEMATECH e-Handbook 1.3.6.7.4): statistic below it <=> p-value above 1e-3.
CHI2_CRITICAL_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def hf_processors(p: SamplingParams) -> list[LogitsProcessor]:
    """The processors `generate` builds for `p` (transformers' generation/utils.py order)."""
    procs: list[LogitsProcessor] = []
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.greedy:
        return procs
    if p.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k != 0:
        procs.append(TopKLogitsWarper(top_k=p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=p.top_p))
    if p.min_p > 0.0:
        procs.append(MinPLogitsWarper(min_p=p.min_p))
    return procs


def hf_process(
    logits: torch.Tensor,  # [bs, V]
    params: Sequence[SamplingParams],
    seen: Sequence[list[int]],
) -> torch.Tensor:  # [bs, V]
    """HF's processors applied row by row, each row with its own params."""
    rows = []
    for row, p in enumerate(params):
        scores = logits[row : row + 1].clone()  # [1, V]
        input_ids = torch.tensor([seen[row]], dtype=torch.int64).reshape(1, -1)  # [1, T]
        for proc in hf_processors(p):
            scores = proc(input_ids, scores)
        rows.append(scores)
    return torch.cat(rows)


def padded_ids(seen: Sequence[list[int]], width: int = MAX_SEEN) -> torch.Tensor:  # [bs, width]
    ids = torch.full((len(seen), width), -1, dtype=torch.int64)
    for row, tokens in enumerate(seen):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return ids


def make_batch(params: Sequence[SamplingParams], seed_base: int = 0) -> SamplingBatch:
    generators = [
        None if p.greedy else make_generator(seed_base + (p.seed or 0), "cpu") for p in params
    ]
    return SamplingBatch.build(params, generators, "cpu")


def make_logits(bs: int, vocab: int, seed: int) -> torch.Tensor:  # [bs, V]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bs, vocab, generator=g) * 3
    x[1::3] = torch.round(x[1::3] * 2) / 2  # many ties, also at the top-k / top-p boundaries
    x[torch.rand(bs, vocab, generator=g) < 0.05] = NEG_INF
    x[:, :3] = -1e4  # finite, but exp underflows to 0: rows without top-p must keep them
    if bs > 7:
        x[7] = torch.where(x[7].isinf(), x[7], 0.0)  # uniform row: top-p cuts through a tie
    return x


def make_seen(bs: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    seen = []
    for row in range(bs):
        length = row * 5 % (MAX_SEEN + 1)  # row 0 has seen nothing
        seen.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    return seen


def assert_same_as_hf(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    assert torch.equal(ours == NEG_INF, ref == NEG_INF), "different -inf masks"
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


PARITY_PARAMS = [
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, top_p=0.5, seed=2),
    SamplingParams(temperature=1.3, top_k=1, repetition_penalty=0.7, seed=3),
    SamplingParams(temperature=0.0, top_k=20, top_p=0.8, min_p=0.3, repetition_penalty=0.8),
    SamplingParams(temperature=2.0, min_p=0.2, repetition_penalty=1.1, seed=5),
    SamplingParams(temperature=0.5, top_k=100_000, top_p=0.95, seed=6),  # k above the vocab
    SamplingParams(temperature=1.0, top_k=7, top_p=0.6, min_p=0.1, seed=7),
    SamplingParams(temperature=1.0, top_p=0.9, seed=8),  # the uniform row
    SamplingParams(temperature=0.9, seed=9),
]


def only(p: SamplingParams, processor: str) -> SamplingParams:
    """`p` with every processor but `processor` neutral (greedy rows stay greedy)."""
    neutral: dict[str, Any] = {
        "temperature": p.temperature if p.greedy else 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    neutral[processor] = getattr(p, processor)
    return dataclasses.replace(p, **neutral)
