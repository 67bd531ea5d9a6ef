"""K=0 steps against a real draft service: they never wait on the draft (answers still being
drafted are left out and made stale), held runs and admits go out on a lane with no answer
outstanding, and switching modes at any step leaves greedy output and both pools unchanged."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.target.engine import Engine
from tests.helpers.draft_service import (
    SPEC,
    Ckpts,
    Feed,
    ServerThread,
    assert_draft_released_all,
    remote_drafter,
)
from tests.helpers.spec_engine import Scripted


def assert_pools_free(engine: Engine, server: ServerThread) -> None:
    """Every page back in the target's pool and the draft's."""
    alloc = engine.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages
    assert_draft_released_all(server)


def workload(
    ckpts: Ckpts,
    feed: Feed,
    lengths: tuple[int, ...],
    max_new_tokens: int,
) -> tuple[list[list[int]], SamplingParams, EngineConfig, list[list[int]]]:
    """Prompts of ``lengths``, greedy params, the engine config and target-only's output."""
    prompts = [feed.ids(n) for n in lengths]
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    config = EngineConfig(model=ckpts.target, page_size=4)
    return prompts, params, config, [r.token_ids for r in Engine(config).generate(prompts, params)]


@pytest.mark.parametrize("two_lanes", [False, True])
def test_k0_stretches_through_the_draft_service_equal_target_only(
    server: ServerThread,
    ckpts: Ckpts,
    two_lanes: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tandem.target import hold

    monkeypatch.setattr(hold, "HELD_BYTES", 64 << 10)  # part flushed during the stretch
    monkeypatch.setattr(hold, "HELD_MAX_BYTES", 64 << 10)
    prompts, params, config, reference = workload(ckpts, Feed(9), (2, 7, 12, 5, 16), 104)
    remote = remote_drafter(server, deadline_s=10.0)
    try:
        engine = Engine(config, drafter=remote, spec=SPEC)
        # Short switches (answers in flight when K=0 starts) and one long stretch.
        engine.policy = Scripted(
            [True, False, True, True, False, False] + [False] * 66 + [True] * 8
        )
        lanes = (lambda i: i % 2) if two_lanes else (lambda i: 0)
        ids = [engine.add_request(p, params, lane=lanes(i)) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        engine.flush_draft()
        results = [engine.pop_finished(i) for i in ids]
        assert [r.token_ids for r in results] == reference
        assert sum(r.stats.draft_tokens for r in results) > 0  # trees verified after K=0
        assert engine.exchange is not None and not engine.exchange.held
        assert engine.exchange.unwaited_answers > 0  # K=0 steps went ahead of answers
        assert remote.take_dropped() == []
        assert_pools_free(engine, server)
    finally:
        remote.close()


def test_k0_holds_features_for_a_draft_service_as_in_process(
    server: ServerThread,
    ckpts: Ckpts,
) -> None:
    """Toward a draft service K=0 holds features where the step left them (the device on
    CUDA), under the same cap as in process (on CPU the floor HELD_BYTES): a stretch under it
    sends the draft nothing, so no flush makes the draft extend mid-stretch; the output is
    target-only's."""
    from tandem.target import hold

    prompts, params, config, reference = workload(ckpts, Feed(3), (6, 11, 4), 40)
    remote = remote_drafter(server, deadline_s=10.0)
    try:
        engine = Engine(config, drafter=remote, spec=SPEC)
        engine.policy = Scripted([False])
        assert engine.exchange is not None
        sent: list[int] = []
        submit = remote.submit

        def counting(lane, admits, outcomes, released):  # type: ignore[no-untyped-def]
            sent.append(len(admits) + len(outcomes) + len(released))
            return submit(lane, admits, outcomes, released)

        remote.submit = counting  # type: ignore[method-assign]
        ids = [engine.add_request(p, params) for p in prompts]
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.exchange._held_bytes([]))
        engine.flush_draft()
        assert [engine.pop_finished(i).token_ids for i in ids] == reference
        assert engine.exchange.held_cap == hold.device_cap(torch.device("cpu"))
        assert 0 < peak <= hold.HELD_BYTES and sent == []
        assert_draft_released_all(server)
    finally:
        remote.close()
