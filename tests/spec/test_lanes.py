"""Lanes in the engine: requests split into two lanes, moved between them at any step, give
exactly the target-only greedy output, and a tree only ever answers the state it was drafted
for (a moved request decodes one step without one, never with a stale one)."""

from __future__ import annotations

import random

import pytest

from tandem.errors import InvalidRequest
from tandem.spec.types import SpecConfig
from tandem.target.engine import MAX_LANES
from tests.spec.conftest import Checkpoints, greedy, ragged_prompts

SHAPES = {
    "chain": SpecConfig(num_steps=3, topk=1),
    "tree": SpecConfig(num_steps=3, topk=4, num_draft_tokens=8),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["eagle3", "model"])
def test_two_lanes_with_moves_equal_target_only(
    ckpts: Checkpoints, reference: list[list[int]], kind: str, shape: str
) -> None:
    engine = ckpts.engine(kind, SHAPES[shape], page_size=4)
    ids = [
        engine.add_request(prompt, greedy(), lane=i % 2)
        for i, prompt in enumerate(ragged_prompts())
    ]
    rng = random.Random(7)
    lanes_stepped, both_busy = [], []
    while engine.has_unfinished():
        if rng.random() < 0.3:  # the gateway rebalancing at an arbitrary moment
            engine.set_lane([rng.choice(ids)], rng.randrange(MAX_LANES))
        both_busy.append(engine.scheduler.lanes_with_work() == {0, 1})
        lanes_stepped.append(engine.step().lane)
    engine.flush_draft()
    results = [engine.pop_finished(i) for i in ids]
    assert [r.token_ids for r in results] == reference
    assert set(lanes_stepped) == {0, 1}
    # While both lanes have work they take turns.
    for i in range(1, len(lanes_stepped)):
        if both_busy[i]:
            assert lanes_stepped[i] != lanes_stepped[i - 1], lanes_stepped
    assert sum(both_busy) > 10
    assert sum(r.stats.draft_tokens for r in results) > 0
    alloc = engine.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages
    assert engine.drafter is not None and engine.drafter.num_tracked() == 0
    for kv in getattr(engine.drafter, "kvs", []):
        assert kv.allocator.num_free_pages == kv.allocator.num_pages


def test_a_request_moved_to_the_other_lane_keeps_its_tree(ckpts: Checkpoints) -> None:
    """A request moved right after its outcome went out in lane 0 steps in lane 1 with the
    tree of lane 0's answer, collected first (``DraftExchange.collect_moved``): a move costs
    it no step without a tree; the others of lane 0 keep theirs for lane 0's next step."""
    engine = ckpts.engine("model", SpecConfig(num_steps=3, topk=1), page_size=4)
    prompts = ragged_prompts()
    a = engine.add_request(prompts[1], greedy(24), lane=0)
    c = engine.add_request(prompts[0], greedy(24), lane=0)
    b = engine.add_request(prompts[2], greedy(24), lane=1)
    req, other = engine._requests[a], engine._requests[c]
    step = engine.step()  # lane 0: every prompt (b's too); their admits go to the draft
    assert step.lane == 0 and req.in_draft and req.tree is None
    engine.set_lane([a], 1)  # a's first tree is in lane 0's uncollected answer
    steps, drafted = req.stats.verify_steps, req.stats.draft_tokens
    step = engine.step()  # lane 1: lane 0's answer is collected first; a verifies its tree
    assert step.lane == 1
    assert (req.stats.verify_steps, req.stats.draft_tokens) == (steps + 1, drafted + 3)
    assert other.tree is not None  # c's tree waits for lane 0's step
    step = engine.step()
    assert step.lane == 0 and other.stats.draft_tokens == 3
    while engine.has_unfinished():
        engine.step()
    engine.flush_draft()
    assert engine.pop_finished(a).token_ids == _target_only(ckpts, prompts[1], 24)
    engine.pop_finished(b), engine.pop_finished(c)
    assert engine.drafter is not None and engine.drafter.num_tracked() == 0


def test_prompts_of_both_lanes_prefill_in_one_step(ckpts: Checkpoints) -> None:
    """A prompt is no lane's until it runs: a speculating step of lane 0 also prefills the
    prompts waiting in lane 1 (a burst the gateway split over two lanes takes the steps its
    tokens need, not one lane's share each), and they decode in lane 1 from then on, with
    the target's output."""
    engine = ckpts.engine("model", SpecConfig(num_steps=3, topk=1), page_size=4)
    prompts = ragged_prompts()[:4]
    ids = [engine.add_request(p, greedy(12), lane=i % 2) for i, p in enumerate(prompts)]
    assert engine.step().lane == 0 and not engine.scheduler.waiting
    assert all(len(engine._requests[r].output_ids) == 1 for r in ids)
    assert engine.step().lane == 1
    while engine.has_unfinished():
        engine.step()
    engine.flush_draft()
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert engine.pop_finished(request_id).token_ids == _target_only(ckpts, prompt, 12)


def test_lane_ids_are_checked(ckpts: Checkpoints) -> None:
    engine = ckpts.engine("model", SpecConfig(num_steps=1, topk=1))
    with pytest.raises(InvalidRequest, match="lane_id"):
        engine.add_request([1, 2], greedy(4), lane=MAX_LANES)
    rid = engine.add_request([1, 2], greedy(4))
    with pytest.raises(InvalidRequest, match="lane_id"):
        engine.set_lane([rid], -1)
    engine.set_lane(["unknown"], 1)  # finished or unknown ids are ignored
    assert engine.lane_sizes() == {0: 1}


def _target_only(ckpts: Checkpoints, prompt: list[int], n: int) -> list[int]:
    engine = ckpts.engine(None, None, page_size=4)
    return engine.generate([prompt], greedy(n))[0].token_ids
