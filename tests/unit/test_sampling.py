"""Tests of logits processing and sampling: validation, parity with transformers' processors,
greedy rows, seeded streams, and chi-square tests of the sampled distribution."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tandem.errors import InvalidRequest
from tandem.sampling import (
    SamplingBatch,
    SamplingParams,
    apply_repetition_penalty,
    invalid_rows,
    make_generator,
    probs_from_logits,
    process_logits,
    sample,
)

NEG_INF = float("-inf")
VOCAB = 6007  # odd, so nothing lines up with a power of two
MAX_SEEN = 40

# Upper 0.001 quantiles of the chi-square distribution by degrees of freedom (standard table,
# e.g. NIST/SEMATECH e-Handbook 1.3.6.7.4): statistic below it <=> p-value above 1e-3.
CHI2_CRITICAL_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


# ----------------------------------------------------------------------------- helpers


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
