"""The speculative cycle on a CUDA device: greedy parity with target-only decoding there."""

from __future__ import annotations

import pytest

from tandem.apps.embedded import family_dir
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.models.config import ModelConfig
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.train.prompts import read_prompts
from tests.spec.conftest import KINDS, LAYERS, Checkpoints, greedy, ragged_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_speculation_on_cuda(ckpts: Checkpoints, kind: str) -> None:
    config = EngineConfig(model=ckpts.target, device="cuda", page_size=16)
    reference = [r.token_ids for r in Engine(config).generate(ragged_prompts(), greedy())]
    draft_kind, mode = KINDS[kind]
    for shape in ((1, 3, 4), (4, 5, 16)):
        k, s, n = shape
        drafter = build_drafter(
            DraftConfig(
                kind=draft_kind,
                path=ckpts.drafts[kind],
                target=ckpts.target,
                mtp_mode=mode,
                device="cuda",
            ),
            LAYERS,
        )
        engine = Engine(
            config, drafter=drafter, spec=SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
        )
        results = engine.generate(ragged_prompts(), greedy())
        assert [r.token_ids for r in results] == reference, shape
        assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages


def test_bf16_speculation_is_bit_equal_under_batch_invariant_kernels() -> None:
    """The embedded family in bf16, 64 held-out prompts at once, EAGLE-3 chains (K=1, S=3):
    with ``batch_invariant`` speculation commits exactly target-only's tokens. Without it a
    few of these 64 prompts part at a bf16 near-tie (docs/performance.md, "GPU greedy
    parity")."""
    from transformers import AutoTokenizer

    family = family_dir()
    target = family / "target"
    tokenizer = AutoTokenizer.from_pretrained(target)
    records = read_prompts(family / "prompts" / "heldout.jsonl")[:64]
    prompts = [tokenizer(r["text"])["input_ids"] for r in records]
    params = greedy(128)
    config = EngineConfig(
        model=target, device="cuda", dtype="bfloat16", max_num_seqs=64, batch_invariant=True
    )
    reference = [r.token_ids for r in Engine(config).generate(prompts, params)]
    layers = ModelConfig.from_pretrained(target).num_layers
    drafter = build_drafter(
        DraftConfig(kind="eagle3", path=family / "eagle3", target=target, device="cuda",
                    dtype="bfloat16"),
        layers,
    )  # fmt: skip
    engine = Engine(config, drafter=drafter, spec=SpecConfig(num_steps=3, topk=1))
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == reference
    verified = sum(r.stats.verify_steps for r in results)
    assert sum(r.stats.accepted_tokens for r in results) > 1.5 * verified  # drafts did commit
