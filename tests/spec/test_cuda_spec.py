"""The speculative cycle on a CUDA device: greedy parity with target-only decoding there."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.spec.build import DraftConfig, build_drafter
from tandem.spec.types import SpecConfig
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
