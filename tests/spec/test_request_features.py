"""Logit bias, presence and frequency penalties and min_tokens are lossless under speculation:
target-only greedy output equals transformers' ``generate`` with the same processors
(``sequence_bias``, ``repetition_penalty``, ``min_new_tokens``, and presence and frequency as a
processor over the generated tokens), and speculative output equals target-only for chains and
trees, page sizes 1 and 16, every draft kind. EOS stops generation here (no ``ignore_eos``), so
min_tokens decides where outputs end."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tandem.errors import InvalidRequest
from tandem.request import TopLogprobs
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tests.checkpoints import load_hf
from tests.spec.conftest import KINDS, Checkpoints, ragged_prompts

EOS = 2  # make_checkpoint's
NEW = 40
PARAMS = [
    # EOS pushed up: without min_tokens it would end at once; with it, at 12 or soon after.
    SamplingParams(max_new_tokens=NEW, logit_bias=((EOS, 6.0), (17, 3.0)), min_tokens=12),
    SamplingParams(max_new_tokens=NEW, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(
        max_new_tokens=NEW, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias=((5, -100),)
    ),
    # EOS certain as soon as min_tokens allows it: exactly 6 tokens, the last one EOS.
    SamplingParams(
        max_new_tokens=NEW, presence_penalty=-1.0, min_tokens=5, logit_bias=((EOS, 100),)
    ),
]


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens after the prompt."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0)  # type: ignore[return-value]


def hf_generate(target: Path, prompt: list[int], p: SamplingParams) -> list[int]:
    hf = load_hf(target)
    with torch.inference_mode():
        ids = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=p.max_new_tokens,
            min_new_tokens=p.min_tokens or None,
            eos_token_id=EOS,
            pad_token_id=0,
            repetition_penalty=p.repetition_penalty,
            sequence_bias=[[[t], b] for t, b in p.logit_bias] or None,
            logits_processor=LogitsProcessorList(
                [PresenceFrequency(len(prompt), p.presence_penalty, p.frequency_penalty)]
            ),
        )
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def features_reference(ckpts: Checkpoints) -> list[list[int]]:
    prompts = ragged_prompts()
    ours = [r.token_ids for r in ckpts.engine(None, None).generate(prompts, PARAMS)]
    assert ours == [hf_generate(ckpts.target, q, p) for q, p in zip(prompts, PARAMS, strict=True)]
    assert 12 <= len(ours[0]) < NEW and ours[0][-1] == EOS
    assert len(ours[3]) == 6 and ours[3][-1] == EOS and EOS not in ours[3][:-1]
    return ours


# Every draft kind, chains and trees of K 2 and 4, both page sizes: each case once (the whole
# product is tests/spec/test_parity.py's, without the features).
CASES = [
    ("eagle3", 1, 3, 4, 1),
    ("eagle3", 4, 5, 16, 16),
    ("eagle", 2, 3, 8, 16),
    ("mtp-chain", 4, 5, 16, 1),
    ("mtp-target", 1, 3, 4, 16),
    ("model", 2, 3, 8, 1),
    ("ngram", 4, 5, 16, 16),
]
assert {c[0] for c in CASES} == set(KINDS)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "k", "s", "n", "page_size"),
    CASES,
    ids=[f"{kind}-K{k}S{s}N{n}-page{page}" for kind, k, s, n, page in CASES],
)
def test_features_are_lossless_under_speculation(
    ckpts: Checkpoints,
    features_reference: list[list[int]],
    kind: str,
    k: int,
    s: int,
    n: int,
    page_size: int,
) -> None:
    engine = ckpts.engine(
        kind, SpecConfig(num_steps=s, topk=k, num_draft_tokens=n), page_size=page_size
    )
    results = engine.generate(ragged_prompts(), PARAMS)
    assert [r.token_ids for r in results] == features_reference
    assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages
    assert sum(r.stats.draft_tokens for r in results) > 0, "the draft never proposed anything"


def test_logit_bias_ids_past_the_vocabulary_are_refused(ckpts: Checkpoints) -> None:
    engine = ckpts.engine(None, None)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        engine.add_request([5, 6], SamplingParams(logit_bias=((10**6, 1.0),)))


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": float("nan")}),
        ("min_tokens", {"min_tokens": 9, "max_new_tokens": 8}),
        ("min_tokens", {"min_tokens": -1}),
        ("logit_bias", {"logit_bias": ((3, 101.0),)}),
        ("logit_bias", {"logit_bias": ((3, 1.0), (3, 2.0))}),
        ("logit_bias", {"logit_bias": ((-1, 1.0),)}),
        ("logit_bias", {"logit_bias": tuple((i, 1.0) for i in range(1025))}),
        ("logit_bias", {"logit_bias": ((3, "x"),)}),
    ],
)
def test_out_of_range_features_are_refused(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field


def hf_top_logprobs(target: Path, prompt: list[int], new: int, n: int) -> tuple[list[int], Any]:
    """transformers' greedy tokens and, per token, the n most likely under log_softmax."""
    hf = load_hf(target)
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tops = [torch.log_softmax(step[0].float(), dim=-1).topk(n) for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), tops


def assert_same_tops(ours: list[TopLogprobs], ref: list[Any], n: int) -> None:
    assert len(ours) == len(ref)
    for top, want in zip(ours, ref, strict=True):
        assert top.token_ids == want.indices.tolist()[:n]
        torch.testing.assert_close(torch.tensor(top.logprobs), want.values[:n], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [None, "eagle3", "mtp-chain"])
def test_top_logprobs_are_transformers_and_survive_speculation(
    ckpts: Checkpoints, kind: str | None
) -> None:
    prompts = ragged_prompts()
    params = [
        SamplingParams(max_new_tokens=12, ignore_eos=True, top_logprobs=n) for n in (5, 0, 1, 20)
    ]
    spec = (
        None
        if kind is None
        else SpecConfig(
            num_steps=3,
            topk=4 if kind == "eagle3" else 1,
            num_draft_tokens=8 if kind == "eagle3" else 4,
        )
    )
    results = ckpts.engine(kind, spec).generate(prompts, params)
    for prompt, p, r in zip(prompts, params, results, strict=True):
        tokens, tops = hf_top_logprobs(ckpts.target, prompt, 12, max(p.top_logprobs, 1))
        assert r.token_ids == tokens
        if p.top_logprobs:
            assert_same_tops(r.top_logprobs, tops, p.top_logprobs)
            assert [t.token_ids[0] for t in r.top_logprobs] == tokens
        else:
            assert r.top_logprobs == []


def test_top_logprobs_leave_out_what_the_filters_exclude(ckpts: Checkpoints) -> None:
    params = SamplingParams(temperature=1.0, top_k=2, seed=4, max_new_tokens=6, top_logprobs=5)
    (result,) = ckpts.engine(None, None).generate([[5, 6, 7]], [params])
    assert len(result.top_logprobs) == 6
    for token, top in zip(result.token_ids, result.top_logprobs, strict=True):
        assert 1 <= len(top.token_ids) <= 2 and token in top.token_ids
        # What the filter keeps is the whole distribution.
        assert sum(math.exp(v) for v in top.logprobs) == pytest.approx(1.0, abs=1e-4)
