"""Shared checkpoints for the speculative-cycle tests: one target, a draft of every kind, and
the target-only reference outputs, written once per session."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.draft.drafter import ModelDrafter
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine, GenerationResult
from tandem.testing.random_drafts import (
    make_eagle3_checkpoint,
    make_eagle_checkpoint,
    make_mtp_checkpoint,
)
from tandem.testing.random_model import make_checkpoint
from tests.checkpoints import hf_greedy

# An odd vocabulary smaller than the foundation tests' keeps the 200-run parity matrix fast;
# 4 layers so EAGLE-3's aux layers (2, L//2, L-3) are three different states.
VOCAB = 1999
LAYERS = 4
NEW_TOKENS = 64
PROMPT_LENS = (1, 7, 20, 33)
# kind name in the tests -> (draft kind, mtp mode)
KINDS = {
    "eagle3": ("eagle3", "chain"),
    "eagle": ("eagle", "chain"),
    "mtp-chain": ("mtp", "chain"),
    "mtp-target": ("mtp", "target"),
    "model": ("model", "chain"),
    "ngram": ("ngram", "chain"),
}


@dataclass
class Checkpoints:
    target: Path
    drafts: dict[str, Path | None]  # kind name -> checkpoint dir

    def drafter(self, kind: str, *, page_size: int = 16, path: Path | None = None) -> object:
        draft_kind, mode = KINDS[kind]
        config = DraftConfig(
            kind=draft_kind,
            path=path or self.drafts[kind],
            target=self.target,
            mtp_mode=mode,
            page_size=page_size,
            num_pages=512,
        )
        return build_drafter(config, LAYERS)

    def engine(
        self, kind: str | None, spec: SpecConfig | None, *, page_size: int = 16, **kw: object
    ) -> Engine:
        drafter = None if kind is None else self.drafter(kind, page_size=page_size)
        config = EngineConfig(model=self.target, page_size=page_size, **kw)  # type: ignore[arg-type]
        return Engine(config, drafter=drafter, spec=spec)  # type: ignore[arg-type]


def make_drafter(
    ckpts: Checkpoints, kind: str, device: str, page_size: int = 4, num_pages: int = 512
) -> ModelDrafter:
    """A ``ModelDrafter`` of ``kind`` on ``device`` with its own pool, for the tests that reach
    its graphs and its half of a device cycle."""
    draft_kind, mode = KINDS[kind]
    config = DraftConfig(
        kind=draft_kind,
        path=ckpts.drafts[kind],
        target=ckpts.target,
        mtp_mode=mode,
        device=device,
        page_size=page_size,
        num_pages=num_pages,
    )
    drafter = build_drafter(config, LAYERS)
    assert isinstance(drafter, ModelDrafter)
    return drafter


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    root = tmp_path_factory.mktemp("spec")
    target = make_checkpoint(
        root / "target", "llama", seed=5, vocab_size=VOCAB, num_hidden_layers=LAYERS
    )
    drafts: dict[str, Path | None] = {
        "eagle3": make_eagle3_checkpoint(root / "eagle3", target, draft_vocab_size=512, seed=1),
        "eagle": make_eagle_checkpoint(root / "eagle", target, seed=2),
        "mtp-chain": make_mtp_checkpoint(root / "mtp", target, num_heads=2, seed=3),
        "model": make_checkpoint(
            root / "model", "llama", seed=4, vocab_size=VOCAB, num_hidden_layers=1
        ),
        "ngram": None,
    }
    drafts["mtp-target"] = drafts["mtp-chain"]
    return Checkpoints(target=target, drafts=drafts)


def ragged_prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    # A repeated motif gives the n-gram draft something to find; ids >= 3 avoid specials.
    motif = [rng.randrange(3, VOCAB) for _ in range(5)]
    out = []
    for n in PROMPT_LENS:
        body = [rng.randrange(3, VOCAB) for _ in range(n)]
        out.append((body[: n // 2] + motif + body)[:n] if n > 10 else body)
    return out


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="session")
def reference(ckpts: Checkpoints) -> list[list[int]]:
    """Target-only greedy output, checked against transformers' generate once."""
    prompts = ragged_prompts()
    results: list[GenerationResult] = ckpts.engine(None, None).generate(prompts, greedy())
    ours = [r.token_ids for r in results]
    assert hf_greedy(ckpts.target, prompts, NEW_TOKENS) == ours
    return ours
