"""The sacred invariant: greedy speculative output equals target-only greedy output (and so
transformers' generate) for every draft kind, tree shape and page size, with no KV leaks."""

from __future__ import annotations

import pytest

from tandem.spec.types import SpecConfig
from tests.spec.conftest import KINDS, Checkpoints, greedy, ragged_prompts


def valid_shapes() -> list[tuple[int, int, int]]:
    shapes = []
    for k in (1, 2, 4):
        for s in (1, 3, 5):
            for n in sorted({s + 1, 8, 16}):
                try:
                    SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
                except ValueError:
                    continue
                shapes.append((k, s, n))
    return shapes


SHAPES = valid_shapes()


def test_the_matrix_is_what_the_issue_asks() -> None:
    assert len(SHAPES) == 16
    assert (1, 5, 6) in SHAPES and (4, 5, 16) in SHAPES and (2, 1, 2) in SHAPES


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("k", "s", "n"), SHAPES, ids=[f"K{k}S{s}N{n}" for k, s, n in SHAPES])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_speculation_equals_target_only(
    ckpts: Checkpoints,
    reference: list[list[int]],
    kind: str,
    k: int,
    s: int,
    n: int,
    page_size: int,
) -> None:
    spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
    engine = ckpts.engine(kind, spec, page_size=page_size)
    results = engine.generate(ragged_prompts(), greedy())
    assert [r.token_ids for r in results] == reference
    alloc = engine.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages and len(alloc) == 0
    assert engine.drafter is not None and engine.drafter.num_tracked() == 0
    for kv in getattr(engine.drafter, "kvs", []):
        assert kv.allocator.num_free_pages == kv.allocator.num_pages
    stats = [r.stats for r in results]
    assert all(st.verify_steps > 0 for st in stats)
    assert sum(st.draft_tokens for st in stats) > 0, "the draft never proposed anything"
