"""Adaptive speculation in the engine: what the engine tells the policy (catch-up steps, the
size a batch grows to, the time between steps, a service's warm-up) and when it asks, with the
output target-only's. K=0 steps themselves: test_k0_holding.py; the policy's own rules:
test_policy_rules.py."""

from __future__ import annotations

import time

from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tandem.target.engine import RESUME_MIN_TOKENS
from tandem.target.policy import PolicyConfig, SpecPolicy
from tests.helpers.spec_engine import Scripted, assert_clean, run_to_end
from tests.spec.conftest import Checkpoints, greedy, ragged_prompts


def test_adaptive_engine_equals_target_only(ckpts: Checkpoints, reference: list[list[int]]) -> None:
    engine = ckpts.engine(
        "eagle3", SpecConfig(num_steps=3, topk=4, num_draft_tokens=8), spec_policy="adaptive"
    )
    assert isinstance(engine.policy, SpecPolicy)
    # Re-checks whenever due (budget 1.0), so the short run switches both ways.
    config = PolicyConfig(window_steps=2, settle_steps=1, explore_steps=6, explore_budget=1.0)
    engine.policy = SpecPolicy(config)
    assert run_to_end(engine, ragged_prompts(), greedy()) == reference
    assert engine.policy.switches >= 2
    assert_clean(engine)


class _Recording(Scripted):
    """Scripted, and remembers what each measured step told the policy."""

    def __init__(self, pattern: list[bool]) -> None:
        super().__init__(pattern)
        self.told: list[tuple[bool, bool]] = []  # (speculated, settled)

    def record(self, *args: int, settled: bool = True, **kwargs: bool) -> None:
        self.told.append((self.pattern[(self.step - 1) % len(self.pattern)], settled))


def test_the_step_that_collects_the_catch_up_is_not_settled(ckpts: Checkpoints) -> None:
    """After K=0 the first speculative step sends the held runs (it has no trees) and the
    next one waits for the draft's extend over them: neither measures speculation, so both
    are reported unsettled; the steps after are settled."""
    engine = ckpts.engine("eagle3", SpecConfig(num_steps=3, topk=1), page_size=4)
    engine.policy = policy = _Recording([True] * 6 + [False] * 10 + [True] * 100)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    run_to_end(engine, ragged_prompts()[:2], params)
    told = policy.told  # speculative steps, K=0 steps, then speculative to the end
    resume = next(i for i in range(1, len(told)) if told[i][0] and not told[i - 1][0])
    assert all(on for on, _ in told[resume:])
    assert [settled for _, settled in told[resume : resume + 6]] == [False, False] + [True] * 4
    assert all(settled for _, settled in told[:resume])
    assert_clean(engine)


def test_a_growing_batch_is_decided_at_the_size_it_grows_to(ckpts: Checkpoints) -> None:
    """Four prompts arrive together: the policy is asked about a batch of four from the first
    step on (the prompts' steps included), so a small batch's choice never admits them to the
    draft when the full batch decodes plainly; steps are measured in the bucket decided."""

    class Sizes(SpecPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[int] = []
            self.measured: list[int] = []

        def speculate(self, batch_size: int) -> bool:
            self.asked.append(batch_size)
            return super().speculate(batch_size)

        def record(self, batch_size: int, *args: int, **kwargs: bool) -> None:
            self.measured.append(batch_size)
            super().record(batch_size, *args, **kwargs)

    engine = ckpts.engine("eagle3", SpecConfig(num_steps=3, topk=1), page_size=4)
    engine.policy = policy = Sizes()
    prompts = ragged_prompts()[:4]
    run_to_end(engine, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert policy.asked[0] == 4 and set(policy.asked[: len(policy.measured)]) == {4}
    assert policy.measured[0] == 4 and max(policy.measured) == 4
    assert_clean(engine)


def test_the_policy_counts_the_time_between_steps(ckpts: Checkpoints) -> None:
    """What the caller does between steps (a service's loop; a thread holding the GIL) is part
    of a step's cost for the policy: with 30 ms between decode steps no step is measured
    faster than 1 token per 30 ms, except after a pause of a second or more."""

    class Times(SpecPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[tuple[int, int]] = []

        def record(self, batch_size: int, tokens: int, ns: int, **kwargs: bool) -> None:
            self.steps.append((tokens, ns))
            super().record(batch_size, tokens, ns, **kwargs)

    engine = ckpts.engine("eagle3", SpecConfig(num_steps=3, topk=1), page_size=4)
    engine.policy = policy = Times()
    engine.add_request(ragged_prompts()[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.03)
    assert len(policy.steps) >= 2
    assert all(ns >= 30_000_000 for _, ns in policy.steps)
    engine._last_step_end = time.perf_counter_ns() - 2_000_000_000  # a pause of 2 s
    assert engine._policy_ns(time.perf_counter_ns()) < 1_000_000_000
    assert_clean(engine)


def test_requests_that_opted_out_leave_the_policy_alone(ckpts: Checkpoints) -> None:
    """A batch whose requests all opted out of speculation decodes plainly (ahead) without
    asking the policy or counting in its windows: such steps say nothing about speculation.
    One speculating request among them brings the policy back."""

    class Counted(SpecPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.asked = self.measured = 0

        def speculate(self, batch_size: int) -> bool:
            self.asked += 1
            return super().speculate(batch_size)

        def record(self, *args: int, **kwargs: bool) -> None:
            self.measured += 1
            super().record(*args, **kwargs)

    engine = ckpts.engine("eagle3", SpecConfig(num_steps=3, topk=1), page_size=4)
    engine.policy = policy = Counted()
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = ragged_prompts()[:3]
    ids = [engine.add_request(p, params, speculate=False) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert policy.asked == policy.measured == 0 and policy._buckets == {}
    assert engine.ahead.launches > 0  # decoded ahead, as K=0 does
    target_only = [r.token_ids for r in ckpts.engine(None, None).generate(prompts, params)]
    assert [engine.pop_finished(i).token_ids for i in ids] == target_only
    engine.add_request(prompts[0], params)
    engine.add_request(prompts[1], params, speculate=False)
    while engine.has_unfinished():
        engine.step()
    assert policy.asked > 0 and policy.measured > 0
    engine.flush_draft()
    assert_clean(engine)


def test_a_batch_about_to_end_does_not_resume_speculation(ckpts: Checkpoints) -> None:
    """After K=0 the draft must catch up before speculation pays: a batch whose requests all
    end within RESUME_MIN_TOKENS stays at K=0 (its steps unmeasured); one with more to go
    resumes. Output is target-only's either way."""

    class Switch(SpecPolicy):
        """K=0 for the first ``at`` decisions, then speculation."""

        def __init__(self, at: int) -> None:
            super().__init__()
            self.at, self.calls, self.measured = at, 0, 0

        def speculate(self, batch_size: int) -> bool:
            self.calls += 1
            return self.calls > self.at

        def record(self, *args: int, **kwargs: bool) -> None:
            self.measured += self.calls > self.at

    prompts = ragged_prompts()[:3]
    params = SamplingParams(max_new_tokens=RESUME_MIN_TOKENS + 8, ignore_eos=True)
    target_only = [r.token_ids for r in ckpts.engine(None, None).generate(prompts, params)]
    for at, resumes in ((12, False), (2, True)):
        engine = ckpts.engine("eagle3", SpecConfig(num_steps=3, topk=1), page_size=4)
        engine.policy = policy = Switch(at)
        ids = [engine.add_request(p, params) for p in prompts]
        speculated = []
        while engine.has_unfinished():
            speculated.append(engine.step().speculated)
        assert any(speculated) is resumes, (at, speculated)
        assert (policy.measured > 0) is resumes
        assert [engine.pop_finished(i).token_ids for i in ids] == target_only
        engine.flush_draft()
        assert_clean(engine)


def test_the_target_services_warm_up_leaves_the_policy_unmeasured(ckpts: Checkpoints) -> None:
    from target_service.__main__ import warm_up

    engine = ckpts.engine("eagle3", SpecConfig(num_steps=3, topk=1), spec_policy="adaptive")
    assert isinstance(engine.policy, SpecPolicy)
    warm_up(engine)  # its steps opened bucket 1's first window: gone, nothing counted
    assert engine.policy._buckets == {} and engine.policy.speculate(1)
    assert_clean(engine)
