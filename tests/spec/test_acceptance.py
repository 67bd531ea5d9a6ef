"""Acceptance logic is neither always-accept nor always-reject: a perfect draft accepts every
draft, an always-wrong one none; K=1's fused top-1 path gives the same drafts as softmax+topk."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tandem.config import DraftConfig
from tandem.draft.build import build_drafter
from tandem.spec.base import Drafter
from tandem.spec.types import DraftAdmit, SpecConfig, Tree, VerifyOutcome
from tests.spec.conftest import LAYERS, Checkpoints, greedy, ragged_prompts


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_perfect_draft_accepts_every_draft(
    ckpts: Checkpoints, reference: list[list[int]], steps: int
) -> None:
    # The target itself as a standalone draft proposes exactly the target's greedy choices.
    spec = SpecConfig(num_steps=steps, topk=1)
    engine = ckpts.engine(None, None)
    engine = type(engine)(
        engine.config,
        drafter=ckpts.drafter("model", path=ckpts.target),
        spec=spec,
    )
    results = engine.generate(ragged_prompts(), greedy())
    assert [r.token_ids for r in results] == reference
    for r in results:
        st = r.stats
        assert st.accepted_tokens == st.draft_tokens > 0
        # Every step accepts its whole chain: S+1 tokens, except where the request's last
        # tokens leave room for a shorter chain.
        full = [a for a in st.accept_lengths if a == steps + 1]
        assert len(full) >= len(st.accept_lengths) - 1, st.accept_lengths
        assert max(st.accept_lengths) == steps + 1


class WrongDrafter(Drafter):
    """Proposes, at every depth, a token other than the one the target will choose (it knows
    the reference output), so no draft can ever be accepted."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], spec: SpecConfig):
        self.truth = {tuple(p): p + o for p, o in zip(prompts, outputs, strict=True)}
        self.spec = spec
        self.seqs: dict[str, list[int]] = {}

    def num_tracked(self) -> int:
        return len(self.seqs)

    def step(
        self,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> dict[str, Tree]:
        for r in released:
            self.seqs.pop(r)
        for a in admits:
            self.seqs[a.request_id] = list(a.token_ids)
        for o in outcomes:
            self.seqs[o.request_id] += [*o.accepted_token_ids, o.bonus_token_id]
        trees = {}
        for r in [a.request_id for a in admits] + [o.request_id for o in outcomes]:
            tokens = self.seqs[r]
            truth = next(t for t in self.truth.values() if t[: len(tokens)] == tokens)
            chain = [
                (truth[i] + 1) % 1999 if i < len(truth) else 5
                for i in range(len(tokens), len(tokens) + self.spec.num_steps)
            ]
            trees[r] = Tree(
                tokens=(tokens[-1], *chain), parents=tuple(range(-1, self.spec.num_steps))
            )
        return trees


def test_always_wrong_draft_accepts_nothing(ckpts: Checkpoints, reference: list[list[int]]) -> None:
    spec = SpecConfig(num_steps=3, topk=1)
    prompts = ragged_prompts()
    engine = ckpts.engine(None, None)
    engine = type(engine)(engine.config, drafter=WrongDrafter(prompts, reference, spec), spec=spec)
    results = engine.generate(prompts, greedy())
    assert [r.token_ids for r in results] == reference
    for r in results:
        assert r.stats.draft_tokens > 0
        assert r.stats.accepted_tokens == 0
        assert set(r.stats.accept_lengths) == {1}


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp-chain", "mtp-target", "model"])
def test_top1_fast_path_gives_the_same_drafts(ckpts: Checkpoints, kind: str) -> None:
    spec = SpecConfig(num_steps=3, topk=1)
    runs = []
    for fast in (True, False):
        from tests.spec.conftest import KINDS

        draft_kind, mode = KINDS[kind]
        drafter = build_drafter(
            DraftConfig(
                kind=draft_kind,
                path=ckpts.drafts[kind],
                target=ckpts.target,
                mtp_mode=mode,
                fast_top1=fast,
            ),
            LAYERS,
        )
        engine = ckpts.engine(None, None)
        engine = type(engine)(engine.config, drafter=drafter, spec=spec)
        results = engine.generate(ragged_prompts(), greedy(24))
        runs.append([(r.token_ids, r.stats.accept_lengths, r.stats.draft_tokens) for r in results])
    assert runs[0] == runs[1]
