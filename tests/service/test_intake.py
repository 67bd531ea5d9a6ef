"""Through a real draft service, every request verifies a tree at every decode step, as in
process: new prompts go to the draft on the intake lane and sit out speculating steps until it
has taken them in (the running requests keep their trees meanwhile); a late answer costs the
steps until it is in, after which the draft is waited for as long as it took; a request the
draft lost (a restart) is recomputed and taken in again."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.spec.base import Drafter
from tandem.target import exchange
from tandem.target.engine import Engine, GenerationResult
from tandem.target.policy import SpecPolicy
from tests.helpers.draft_service import (
    SPEC,
    Ckpts,
    Feed,
    ServerThread,
    assert_draft_released_all,
    remote_drafter,
    serve,
    wait_until,
)


class Always(SpecPolicy):
    """Speculates at every step (the adaptive policy's choices are not under test here)."""

    def speculate(self, batch_size: int) -> bool:
        return True


def run(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    arrivals: dict[int, int],
    during: Callable[[int], None] = lambda step: None,
) -> list[GenerationResult]:
    """Adds prompt i at step ``arrivals.get(i, 0)`` and steps to the end; ``during(step)``
    runs before each step."""
    ids: dict[int, str] = {}
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        for i, prompt in enumerate(prompts):
            if i not in ids and arrivals.get(i, 0) <= step:
                ids[i] = engine.add_request(prompt, params)
        during(step)
        if engine.has_unfinished():
            engine.step()
        step += 1
    engine.flush_draft()
    return [engine.pop_finished(ids[i]) for i in range(len(prompts))]


def per_request(results: list[GenerationResult]) -> list[tuple[int, int, int]]:
    """(verify steps, steps that verified a draft, accepted drafts) of each request."""
    return [(r.stats.verify_steps, r.stats.drafts, r.stats.accepted_tokens) for r in results]


def in_process(
    ckpts: Ckpts, prompts: list[list[int]], params: SamplingParams, arrivals: dict[int, int]
) -> list[GenerationResult]:
    engine = Engine(EngineConfig(model=ckpts.target, page_size=4), drafter=ckpts.local(), spec=SPEC)
    engine.policy = Always()
    return run(engine, prompts, params, arrivals)


def through(
    drafter: Drafter,
    ckpts: Ckpts,
    prompts: list[list[int]],
    params: SamplingParams,
    arrivals: dict[int, int],
    during: Callable[[int], None] = lambda step: None,
) -> tuple[Engine, list[GenerationResult]]:
    engine = Engine(EngineConfig(model=ckpts.target, page_size=4), drafter=drafter, spec=SPEC)
    engine.policy = Always()
    return engine, run(engine, prompts, params, arrivals, during)


def assert_pools_free(engine: Engine, server: ServerThread) -> None:
    alloc = engine.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages
    assert_draft_released_all(server)


@pytest.mark.parametrize("intake_bytes", [exchange.INTAKE_BYTES, 1])
def test_requests_verify_a_tree_at_every_step_as_in_process(
    server: ServerThread,
    ckpts: Ckpts,
    intake_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst and requests arriving while others decode: each request's tokens, steps,
    drafted steps and accepted drafts equal in-process speculation's (one prompt per intake
    message, too: the burst's requests are taken in one after another)."""
    monkeypatch.setattr(exchange, "INTAKE_BYTES", intake_bytes)
    feed = Feed(21)
    prompts = [feed.ids(n) for n in (9, 14, 5, 11, 7, 12)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    arrivals = {3: 4, 4: 9, 5: 10}  # three at once, then one by one while they decode
    expected = in_process(ckpts, prompts, params, arrivals)
    remote = remote_drafter(server, deadline_s=10.0)
    try:
        engine, results = through(remote, ckpts, prompts, params, arrivals)
        assert [r.token_ids for r in results] == [r.token_ids for r in expected]
        assert per_request(results) == per_request(expected)
        assert all(r.stats.drafts > 0 for r in results)
        assert remote.late_steps == 0 and remote.take_dropped() == []
        assert_pools_free(engine, server)
    finally:
        remote.close()


def test_a_late_answer_costs_the_steps_until_it_is_in(server: ServerThread, ckpts: Ckpts) -> None:
    """With the draft's worker held past the deadline, steps decode plainly without sending
    it more (``Drafter.behind``) and do not wait; once the answer is in, speculation resumes,
    later steps allow the draft as long as that answer took, and the output is target-only's."""
    feed = Feed(22)
    prompts = [feed.ids(n) for n in (6, 10)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = EngineConfig(model=ckpts.target, page_size=4)
    reference = [r.token_ids for r in Engine(config).generate(prompts, params)]
    remote = remote_drafter(server, deadline_s=0.3)
    gate = threading.Event()
    held_at = 4
    steps_while_behind: list[bool] = []
    allowed: list[float] = []

    def hold(step: int) -> None:
        if step == held_at:  # the worker waits: the next step finds its answer late
            server.server.engine._executor.submit(gate.wait)
        elif held_at + 1 < step <= held_at + 4:
            steps_while_behind.append(remote.behind())
        elif step == held_at + 5:
            gate.set()
            wait_until(lambda: not remote.behind())
        elif step == held_at + 6:
            allowed.append(remote.step_deadline_s())

    try:
        engine, results = through(remote, ckpts, prompts, params, {}, hold)
        assert [r.token_ids for r in results] == reference
        assert remote.late_steps >= 1 and all(steps_while_behind)
        assert allowed[0] > 0.3  # what the late answer took is allowed from then on
        spoke = sum(r.stats.drafts for r in results)
        assert spoke > 2 * held_at  # speculation resumed after the late answer
        assert remote.take_dropped() == []
        assert_pools_free(engine, server)
    finally:
        gate.set()
        remote.close()


def test_requests_the_draft_lost_are_taken_in_again(ckpts: Ckpts) -> None:
    """The draft service restarts mid-generation: its requests are dropped, recomputed once
    the new one is up, and speculate again; the output is target-only's."""
    feed = Feed(23)
    prompts = [feed.ids(n) for n in (8, 13)]
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    config = EngineConfig(model=ckpts.target, page_size=4)
    reference = [r.token_ids for r in Engine(config).generate(prompts, params)]
    server = serve(ckpts)
    port = server.server.port
    remote = remote_drafter(server, deadline_s=10.0)
    engine = Engine(config, drafter=remote, spec=SPEC)
    engine.policy = Always()
    drafts_before: list[int] = []

    def restart(step: int) -> None:
        nonlocal server
        if step == 6:
            server.stop()
        elif step == 10:
            server = serve(ckpts, port=port)
            wait_until(lambda: remote.connects == 2)
            drafts_before.extend(r.stats.drafts for r in engine._requests.values())

    try:
        results = run(engine, prompts, params, {}, restart)
        assert [r.token_ids for r in results] == reference
        assert all(r.num_preemptions == 1 for r in results)  # recomputed once each
        assert all(r.stats.drafts > d + 10 for r, d in zip(results, drafts_before, strict=True))
        assert_pools_free(engine, server)
    finally:
        remote.close()
        server.stop()
