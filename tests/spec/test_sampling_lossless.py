"""Speculative sampling preserves the target distribution: with a 32-token vocabulary,
temperature 1 and top-p 0.9, the first three generated tokens follow the target's exact
distribution (chi-square against probabilities computed from the target itself), and a
deliberately biased verifier fails the same test. Seeds make it deterministic."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem.spec.verify as verify_module
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.sampling import SamplingBatch, SamplingParams, process_logits
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.testing.random_model import make_checkpoint

VOCAB = 32
PROMPT = [5, 9, 17, 3]
SAMPLES = 20000
TOKENS = 3
PARAMS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 0.9,
    "max_new_tokens": TOKENS,
    "ignore_eos": True,
}
# Every processor that reads the tokens so far, and a bias: their distribution depends on the
# tree path each node sits on.
PENALISED = PARAMS | {
    "presence_penalty": 0.8,
    "frequency_penalty": 0.6,
    "repetition_penalty": 1.2,
    "logit_bias": ((3, 2.0), (7, -1.5)),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("tiny")
    target = make_checkpoint(
        root / "target",
        "llama",
        seed=8,
        vocab_size=VOCAB,
        tokenizer=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    # Sharpen the output layer so the distributions are far from uniform (and top-p bites).
    weights = load_file(target / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 8
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    draft = make_checkpoint(
        root / "draft", "llama", seed=9, vocab_size=VOCAB, num_hidden_layers=1, tokenizer=False
    )
    return target, draft


def target_probs(
    target: Path, contexts: list[list[int]], kwargs: dict[str, Any]
) -> torch.Tensor:  # [n, V]
    """The target's processed next-token distribution after each context (transformers)."""
    from tests.checkpoints import load_hf

    hf = load_hf(target)
    with torch.inference_mode():
        logits = hf(torch.tensor(contexts)).logits[:, -1].float()
    params = [SamplingParams(**kwargs)] * len(contexts)
    batch = SamplingBatch.build(params, [torch.Generator()] * len(contexts), "cpu")
    history = torch.tensor(contexts)  # [n, T]: one length per level
    prompt_lens = torch.full((len(contexts),), len(PROMPT))
    return process_logits(logits, batch, history, prompt_lens).softmax(dim=-1)


def expected_distributions(
    target: Path, kwargs: dict[str, Any] = PARAMS
) -> list[dict[tuple[int, ...], float]]:
    """Exact probabilities of every 1-, 2- and 3-token prefix of the output."""
    out: list[dict[tuple[int, ...], float]] = []
    level: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(TOKENS):
        prefixes = [p for p, q in level.items() if q > 0]
        probs = target_probs(target, [PROMPT + list(p) for p in prefixes], kwargs)
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, row in zip(prefixes, probs, strict=True):
            for token in torch.nonzero(row > 0).flatten().tolist():
                nxt[(*prefix, token)] = level[prefix] * float(row[token])
        out.append(nxt)
        level = nxt
    return out


def chi_square(
    counts: Counter[tuple[int, ...]], expected: dict[tuple[int, ...], float]
) -> tuple[float, int]:
    """Pearson's statistic with cells of expected count < 5 pooled into one."""
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e = p * SAMPLES
        if e < 5:
            pool_obs += counts.get(cell, 0)
            pool_exp += e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        dof += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        dof += 1
    unexpected = sum(c for cell, c in counts.items() if cell not in expected)
    assert unexpected == 0, f"{unexpected} samples of zero-probability sequences"
    return stat, dof


def critical(dof: int) -> float:
    """Chi-square quantile at p = 0.001 (Wilson-Hilferty; within 1% for dof >= 10)."""
    z = 3.090232  # standard normal quantile at 0.999
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def sample_outputs(
    target: Path, draft: Path | None, spec: SpecConfig | None, kwargs: dict[str, Any] = PARAMS
) -> list[list[int]]:
    drafter = None
    if draft is not None:
        drafter = build_drafter(DraftConfig(kind="model", path=draft, target=target), 4)
    engine = Engine(
        EngineConfig(model=target, max_num_seqs=1000, max_num_batched_tokens=8192, num_pages=4096),
        drafter=drafter,
        spec=spec,
    )
    outputs = []
    for start in range(0, SAMPLES, 1000):
        params = [SamplingParams(**kwargs, seed=1_000_003 * (start + i)) for i in range(1000)]
        outputs += [r.token_ids for r in engine.generate([PROMPT] * 1000, params)]
    return outputs


def check(outputs: list[list[int]], expected: list[dict[tuple[int, ...], float]]) -> list[bool]:
    verdicts = []
    for n in range(1, TOKENS + 1):
        counts = Counter(tuple(o[:n]) for o in outputs)
        stat, dof = chi_square(counts, expected[n - 1])
        verdicts.append(stat < critical(dof))
    return verdicts


@pytest.mark.slow
def test_speculative_sampling_matches_the_target_distribution(tiny: tuple[Path, Path]) -> None:
    target, draft = tiny
    expected = expected_distributions(target)
    assert max(expected[0].values()) > 0.2, "the target distribution is too flat to test"
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=5)
    outputs = sample_outputs(target, draft, spec)
    assert all(len(o) == TOKENS for o in outputs)
    assert check(outputs, expected) == [True] * TOKENS
    # Target-only sampling passes the same test.
    assert check(sample_outputs(target, None, None), expected) == [True] * TOKENS


@pytest.mark.slow
def test_penalties_and_bias_keep_the_target_distribution(tiny: tuple[Path, Path]) -> None:
    target, draft = tiny
    expected = expected_distributions(target, PENALISED)
    assert expected != expected_distributions(target), "the processors changed nothing"
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=5)
    outputs = sample_outputs(target, draft, spec, PENALISED)
    assert check(outputs, expected) == [True] * TOKENS
    # The same samples are far from the distribution without the processors: some have no
    # probability there at all (top-p cut them), or the test fails.
    plain = expected_distributions(target)
    impossible = sum(tuple(o) not in plain[-1] for o in outputs)
    assert impossible > 0 or check(outputs, plain) != [True] * TOKENS


@pytest.mark.slow
def test_a_biased_verifier_fails_the_same_test(
    tiny: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = tiny
    expected = expected_distributions(target)
    real = verify_module.verify_sampling_ref

    def biased(tokens: torch.Tensor, probs: torch.Tensor, coins: torch.Tensor, *a: Any) -> Any:
        # Accepts a child whenever the coin is below its own probability times 3: too often.
        return real(tokens, probs, (coins / 3).clamp(max=0.999), *a)

    monkeypatch.setattr(verify_module, "verify_sampling_ref", biased)
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=5)
    outputs = sample_outputs(target, draft, spec)
    assert check(outputs, expected) != [True] * TOKENS
