"""Driving a speculative engine in the tests: a policy that speculates on the steps a pattern
says, a batch run to its end, and the check that a finished engine left nothing behind."""

from __future__ import annotations

from tandem.sampling import SamplingParams
from tandem.target.engine import Engine
from tandem.target.policy import SpecPolicy


class Scripted(SpecPolicy):
    """Speculates on the steps ``pattern(step)`` says, counting steps across batch sizes."""

    def __init__(self, pattern: list[bool]) -> None:
        super().__init__()
        self.pattern = pattern
        self.step = 0

    def speculate(self, batch_size: int) -> bool:
        on = self.pattern[self.step % len(self.pattern)]
        self.step += 1
        return on


def run_to_end(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """``prompts`` added together and stepped until all finish: their output tokens."""
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    engine.flush_draft()
    return [engine.pop_finished(i).token_ids for i in ids]


def assert_clean(engine: Engine) -> None:
    """Every page back in the target's pool and the drafter's, no request tracked by the draft
    and no outcome held back for it."""
    alloc = engine.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages
    assert engine.drafter is not None and engine.drafter.num_tracked() == 0
    assert engine.exchange is not None and not engine.exchange.held
    for kv in getattr(engine.drafter, "kvs", []):
        assert kv.allocator.num_free_pages == kv.allocator.num_pages
