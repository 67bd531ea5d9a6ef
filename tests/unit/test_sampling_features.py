"""The request features' processors row by row against transformers' own (``sequence_bias``,
``min_new_tokens``) and OpenAI's definition of presence and frequency, on a mixed batch; the
caller's logits are never written."""

from __future__ import annotations

import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tandem.sampling import SamplingBatch, SamplingParams, process_logits

VOCAB = 97
EOS = 2


def test_processors_match_their_definitions_row_by_row() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    prompts = [[5, 6, 7], [9], [11, 11, 12, 13], [20, 21]]
    generated = [[6, 6, 30, 31, 30], [], [11, 40, 40, 40], [EOS, 50]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=1.5, logit_bias=((6, 4.0),)),
        SamplingParams(min_tokens=3, logit_bias=((EOS, 50.0), (9, -3.0))),
        SamplingParams(repetition_penalty=1.4, frequency_penalty=-0.75, min_tokens=5),
        SamplingParams(presence_penalty=2.0, min_tokens=1),  # min_tokens reached
    ]
    blocked = [
        (EOS,) if len(gen) < p.min_tokens else () for p, gen in zip(params, generated, strict=True)
    ]
    batch = SamplingBatch.build(params, [None] * 4, "cpu", blocked)
    rows = [p + gen for p, gen in zip(prompts, generated, strict=True)]
    history = torch.full((4, max(map(len, rows))), -1)
    for i, row in enumerate(rows):
        history[i, : len(row)] = torch.tensor(row)
    before = logits.clone()
    ours = process_logits(logits, batch, history, torch.tensor([len(p) for p in prompts]))
    assert torch.equal(logits, before)
    for i, p in enumerate(params):
        ids = torch.tensor([rows[i]])
        ref = logits[i : i + 1].clone()
        if p.logit_bias:
            ref = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias})(ids, ref)
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, ref)
        counts = torch.bincount(torch.tensor(generated[i], dtype=torch.int64), minlength=VOCAB)
        ref = ref - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        ref = MinNewTokensLengthLogitsProcessor(len(prompts[i]), p.min_tokens, EOS)(ids, ref)
        torch.testing.assert_close(ours[i : i + 1], ref, rtol=1e-6, atol=1e-6)
    assert ours[1, EOS] == ours[2, EOS] == float("-inf")
    assert ours[0, EOS].isfinite() and ours[3, EOS].isfinite()


def test_plain_greedy_is_only_the_argmax() -> None:
    assert SamplingParams().plain_greedy
    for kwargs in (
        {"presence_penalty": 0.1},
        {"frequency_penalty": -0.1},
        {"min_tokens": 1},
        {"logit_bias": ((1, 0.0),)},
        {"repetition_penalty": 1.1},
        {"temperature": 0.5},
    ):
        assert not SamplingParams(**kwargs).plain_greedy, kwargs  # type: ignore[arg-type]
