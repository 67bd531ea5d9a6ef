"""Logits processing against transformers' processors (repetition penalty, temperature, top-k,
top-p, min-p): the same logits row by row, on ties, exact thresholds and half precision, and
the probabilities as the softmax of the processed logits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    RepetitionPenaltyLogitsProcessor,
)

from tandem.penalties import apply_repetition_penalty
from tandem.sampling import (
    SamplingParams,
    probs_from_logits,
    process_logits,
)
from tests.helpers.sampling import (
    NEG_INF,
    PARITY_PARAMS,
    VOCAB,
    assert_same_as_hf,
    hf_process,
    make_batch,
    make_logits,
    make_seen,
    only,
    padded_ids,
)

# ----------------------------------------------------------------------------- HF parity


def test_repetition_penalty_matches_hf() -> None:
    bs = len(PARITY_PARAMS)
    logits, seen = make_logits(bs, VOCAB, 0), make_seen(bs, VOCAB, 1)
    seen[3] = seen[3] + seen[3][:3]  # repeated ids are penalised once
    penalty = torch.tensor([0.5, 1.0, 1.3, 2.0, 0.9, 1.1, 3.0, 1.2, 0.7])
    ours = apply_repetition_penalty(logits, padded_ids(seen), penalty)
    ref = torch.cat(
        [
            RepetitionPenaltyLogitsProcessor(float(p))(
                torch.tensor([seen[row]], dtype=torch.int64).reshape(1, -1),
                logits[row : row + 1].clone(),
            )
            for row, p in enumerate(penalty.tolist())
        ]
    )
    assert_same_as_hf(ours, ref)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize(
    "processor", ["repetition_penalty", "temperature", "top_k", "top_p", "min_p", "chain"]
)
def test_processing_matches_hf(processor: str) -> None:
    params = PARITY_PARAMS if processor == "chain" else [only(p, processor) for p in PARITY_PARAMS]
    bs = len(params)
    logits, seen = make_logits(bs, VOCAB, 2), make_seen(bs, VOCAB, 3)
    before = logits.clone()
    ours = process_logits(logits, make_batch(params), padded_ids(seen))
    assert_same_as_hf(ours, hf_process(logits, params, seen))
    assert torch.equal(logits, before), "process_logits modified its input"


def test_processing_accepts_half_precision_logits() -> None:
    params = PARITY_PARAMS
    logits = make_logits(len(params), VOCAB, 4).bfloat16()
    seen = make_seen(len(params), VOCAB, 5)
    ours = process_logits(logits, make_batch(params), padded_ids(seen))
    assert_same_as_hf(ours, hf_process(logits.float(), params, seen))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_processing_matches_hf_on_small_vocabularies(data: st.DataObject) -> None:
    vocab = data.draw(st.integers(1, 40), label="vocab")
    bs = data.draw(st.integers(1, 4), label="bs")
    params = data.draw(
        st.lists(
            st.builds(
                SamplingParams,
                temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
                top_k=st.integers(0, vocab + 2),
                top_p=st.sampled_from([1e-9, 0.1, 0.5, 0.75, 0.9, 1.0]),
                min_p=st.sampled_from([0.0, 0.05, 0.5, 0.9]),
                repetition_penalty=st.sampled_from([0.5, 1.0, 1.5]),
            ),
            min_size=bs,
            max_size=bs,
        ),
        label="params",
    )
    # Values on a coarse grid, so ties are common; -inf anywhere, except a whole row.
    cells = st.sampled_from([NEG_INF, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0])
    row = st.lists(cells, min_size=vocab, max_size=vocab)
    logits = torch.tensor(data.draw(st.lists(row, min_size=bs, max_size=bs)))  # [bs, V]
    logits[:, 0] = torch.where(logits.amax(dim=-1) == NEG_INF, 0.0, logits[:, 0])
    seen = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=6)) for _ in range(bs)]
    ours = process_logits(logits, make_batch(params), padded_ids(seen, width=6))
    assert_same_as_hf(ours, hf_process(logits, params, seen))


@pytest.mark.parametrize(
    ("logits", "params"),
    [
        ([0.0] * 5, SamplingParams(temperature=1.0, top_p=0.6)),
        ([0.0] * 5, SamplingParams(temperature=1.0, top_p=0.8)),
        ([0.0] * 25, SamplingParams(temperature=1.0, top_p=0.72)),
        ([0.0, math.log(0.5), -1.0], SamplingParams(temperature=1.0, min_p=0.5)),
        ([0.0, math.log(0.25), -1.0], SamplingParams(temperature=1.0, min_p=0.25)),
    ],
)
def test_thresholds_hit_exactly_round_like_hf(logits: list[float], params: SamplingParams) -> None:
    """Cumulative or relative probabilities equal to the threshold, where rounding decides."""
    x = torch.tensor([logits])  # [1, V]
    ours = process_logits(x, make_batch([params]), None)
    assert_same_as_hf(ours, hf_process(x, [params], [[]]))


def test_probs_are_the_softmax_of_processed_logits() -> None:
    params = PARITY_PARAMS
    logits, seen = make_logits(len(params), VOCAB, 6), make_seen(len(params), VOCAB, 7)
    batch, ids = make_batch(params), padded_ids(seen)
    probs = probs_from_logits(logits, batch, ids)
    processed = process_logits(logits, batch, ids)
    assert probs.dtype == torch.float32
    assert torch.equal(probs, processed.softmax(dim=-1))
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(params)))
    assert bool((probs[processed == NEG_INF] == 0).all())
    assert bool((probs[3] > 0).all() == (processed[3] > NEG_INF).all()), "greedy row: no filter"
