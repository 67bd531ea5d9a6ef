"""Tests of the sampling parameters and the sampler's rows: validation, the batch's flags,
greedy rows, seeded streams that do not depend on the batch, and rows of NaN or -inf."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tandem.errors import InvalidRequest
from tandem.penalties import apply_repetition_penalty
from tandem.sampling import (
    SamplingBatch,
    SamplingParams,
    invalid_rows,
    make_generator,
    process_logits,
    sample,
)
from tests.helpers.sampling import (
    NEG_INF,
    VOCAB,
    make_batch,
    make_logits,
    padded_ids,
)

# ----------------------------------------------------------------------------- validation

INVALID = [
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1.0"),
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("min_p", -0.1),
    ("min_p", 1.0),
    ("min_p", math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.5),
    ("max_new_tokens", 0),
    ("max_new_tokens", -3),
    ("max_new_tokens", 1.0),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", (1, "2")),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("ignore_eos", None),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_field_raises_naming_it(field: str, value: object) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_boundary_values_are_accepted_and_normalised() -> None:
    loose: dict[str, Any] = {"temperature": 1, "top_p": 1, "min_p": 0, "stop_token_ids": [0, 7]}
    p = SamplingParams(seed=2**63 - 1, **loose)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop_token_ids == (0, 7)
    assert hash(p) == hash(dataclasses.replace(p))
    assert not p.greedy
    assert SamplingParams(seed=0).greedy


# ----------------------------------------------------------------------------- build


def test_build_flags_and_greedy_rows_are_neutral() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, top_k=9, seed=1),
    ]
    gen = make_generator(1, "cpu")
    batch = SamplingBatch.build(params, [make_generator(0, "cpu"), gen], "cpu")
    assert batch.generators == [None, gen]
    assert batch.top_k.tolist() == [0, 9] and batch.top_p.tolist() == [1.0, 1.0]
    assert batch.min_p.tolist() == [0.0, 0.0]
    assert batch.repetition_penalty.tolist() == pytest.approx([1.2, 1.0])
    assert (batch.all_greedy, batch.any_top_k, batch.max_top_k) == (False, True, 9)
    assert (batch.any_top_p, batch.any_min_p, batch.any_penalty) == (False, False, True)
    assert batch.temperature.dtype == torch.float32 and batch.top_k.dtype == torch.int64


def test_build_rejects_missing_generator_and_length_mismatch() -> None:
    with pytest.raises(ValueError, match="generator"):
        SamplingBatch.build([SamplingParams(temperature=1.0)], [None], "cpu")
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.build([SamplingParams()], [], "cpu")


def test_penalty_without_token_ids_raises() -> None:
    batch = make_batch([SamplingParams(repetition_penalty=1.5)])
    with pytest.raises(ValueError, match="token_ids"):
        process_logits(torch.zeros(1, 5), batch, None)


# ----------------------------------------------------------------------------- greedy


def test_greedy_rows_take_the_argmax_of_penalised_logits() -> None:
    params = [
        SamplingParams(),
        SamplingParams(top_k=3, top_p=0.2, min_p=0.9),  # filters do not apply to greedy rows
        SamplingParams(repetition_penalty=5.0),
        SamplingParams(temperature=1.0, seed=1),
    ]
    logits = make_logits(len(params), VOCAB, 8)
    seen = [[], [], logits[2].topk(3).indices.tolist(), []]
    ids = padded_ids(seen)
    batch = make_batch(params)
    tokens = sample(logits, batch, ids)
    penalised = apply_repetition_penalty(logits, ids, batch.repetition_penalty)
    assert tokens.dtype == torch.int64 and tokens.shape == (4,)
    assert tokens[:3].tolist() == penalised[:3].argmax(dim=-1).tolist()
    assert tokens[:2].tolist() == logits[:2].argmax(dim=-1).tolist()
    assert tokens[2] != logits[2].argmax(), "the penalty should move row 2's choice"
    greedy_processed = process_logits(logits, batch, ids)[:3]
    assert torch.equal(greedy_processed, penalised[:3]), "greedy rows: penalty only"


def test_all_greedy_batch_equals_argmax() -> None:
    logits = make_logits(5, VOCAB, 9)
    batch = make_batch([SamplingParams()] * 5)
    assert torch.equal(sample(logits, batch, None), logits.argmax(dim=-1))


# ----------------------------------------------------------------------------- seeded streams


def stream(
    requests: Sequence[tuple[str, SamplingParams]],
    row_logits: dict[str, torch.Tensor],
    steps: int,
) -> dict[str, list[int]]:
    """Tokens each named request draws over `steps` steps in a batch of `requests`, in order."""
    params = [p for _, p in requests]
    generators = [None if p.greedy else make_generator(p.seed or 0, "cpu") for p in params]
    batch = SamplingBatch.build(params, generators, "cpu")
    logits = torch.stack([row_logits[name] for name, _ in requests])  # [bs, V]
    out: dict[str, list[int]] = {name: [] for name, _ in requests}
    for _ in range(steps):
        tokens = sample(logits, batch, None)
        for (name, _), token in zip(requests, tokens.tolist(), strict=True):
            out[name].append(token)
    return out


def test_same_seed_same_stream_whatever_the_batch() -> None:
    base = make_logits(1, VOCAB, 10)[0] / 3  # flat enough that streams are long and varied
    a = ("a", SamplingParams(temperature=1.0, seed=11))
    b = ("b", SamplingParams(temperature=0.8, top_k=500, top_p=0.95, seed=12))
    c = ("c", SamplingParams(temperature=1.0, seed=13))
    g = ("g", SamplingParams())
    row_logits = {"a": base, "b": base, "c": base, "g": base}
    first = stream([a, b, c], row_logits, steps=12)
    again = stream([a, b, c], row_logits, steps=12)
    shuffled = stream([c, g, a, b], row_logits, steps=12)
    alone = stream([b], row_logits, steps=12)
    assert first == again
    for name in ("a", "b", "c"):
        assert shuffled[name] == first[name]
    assert alone["b"] == first["b"]
    assert first["a"] != first["c"], "different seeds should give different streams"
    assert len(set(first["a"])) > 6, "a stream should not repeat one token"


# ----------------------------------------------------------------------------- broken rows


def test_nan_and_all_masked_rows_do_not_crash() -> None:
    vocab = 11
    logits = torch.randn(6, vocab)
    logits[0] = NEG_INF  # all -inf, greedy
    logits[1] = NEG_INF  # all -inf, sampled
    logits[2] = math.nan  # all NaN, sampled
    logits[3, 5] = math.nan  # one NaN, greedy: the NaN's id
    logits[4, 5] = math.nan  # one NaN, sampled: its softmax is all NaN
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.5, min_p=0.1, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, seed=2),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=0.5, top_k=2, seed=3),
        SamplingParams(temperature=0.5, seed=4),
    ]
    ids = padded_ids([[1, 2]] * 6, width=2)
    tokens = sample(logits, make_batch(params), ids)
    assert tokens[:5].tolist() == [0, 0, 0, 5, 0]
    assert 0 <= int(tokens[5]) < vocab
    assert invalid_rows(logits).tolist() == [True, True, True, True, True, False]
    with_inf = torch.zeros(2, vocab)
    with_inf[0, 3] = math.inf
    assert invalid_rows(with_inf).tolist() == [True, False]
