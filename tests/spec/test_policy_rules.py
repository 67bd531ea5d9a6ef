"""The adaptive policy's rules, on synthetic steps: it picks the faster mode per batch-size
bucket and measures the other again on its schedule, checks again at once a decision that
cold steps made, compares a re-check with what the running mode did since its decision, leaves
the draft's catch-up and intake out of a window, and forgets everything on reset. Each
expectation is the rule's (tests/helpers/policy.py), not a step index. The budget's rules:
tests/spec/test_policy_budget.py."""

from __future__ import annotations

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from tandem.target.policy import Mode, PolicyConfig, SpecPolicy
from tests.helpers.policy import (
    drive,
    loss_ns,
    rate,
    recheck_after,
    runs,
    steady_runs,
    window,
    window_loss,
)


def test_policy_picks_the_faster_mode_per_batch_size() -> None:
    config = PolicyConfig(window_steps=4, settle_steps=1, explore_steps=50)
    policy = SpecPolicy(config)
    # Fake costs: at bs 1 speculation commits 3 tokens in 2 ms against 1 in 1 ms; at bs 64 it
    # commits 2.2 x 64 tokens in 30 ms against 64 in 10 ms.
    cost = {1: ((3, 2_000_000), (1, 1_000_000)), 64: ((141, 30_000_000), (64, 10_000_000))}
    modes: dict[int, list[bool]] = {1: [], 64: []}
    for _ in range(200):
        for bs in (1, 64):
            on = policy.speculate(bs)
            modes[bs].append(on)
            tokens, ns = cost[bs][0] if on else cost[bs][1]
            policy.record(bs, tokens, ns)
    # After both windows (2 x 5 steps) each bucket runs its faster mode, except while it
    # measures the other one again (one window of 5 steps in every 55).
    assert sum(modes[1][10:]) / len(modes[1][10:]) > 0.85
    assert sum(modes[64][10:]) / len(modes[64][10:]) < 0.15
    assert policy.rates(1)["speculate"] == pytest.approx(1500.0)
    assert policy.rates(64)["plain"] == pytest.approx(6400.0)
    # Each bucket runs the faster mode and measures the slower one again, one window at a
    # time, on its schedule and within its budget.
    for bs, faster in ((1, True), (64, False)):
        assert runs(modes[bs]) == steady_runs(config, *cost[bs], 200)
        slower = [n for mode, n in runs(modes[bs]) if mode is not faster]
        assert len(slower) >= 2 and set(slower) == {window(config)}


@settings(max_examples=60, deadline=None)
@example(  # speculation faster, but not by the margin: K=0 runs
    spec=(21, 2_000_000),
    plain=(10, 1_000_000),
    window_steps=4,
    settle_steps=1,
    first_explore_steps=8,
    explore_budget=0.03,
)
@given(
    spec=st.tuples(st.integers(1, 400), st.integers(1_000_000, 40_000_000)),
    plain=st.tuples(st.integers(1, 100), st.integers(1_000_000, 20_000_000)),
    window_steps=st.integers(1, 8),
    settle_steps=st.integers(0, 2),
    first_explore_steps=st.integers(1, 40),
    explore_budget=st.sampled_from([0.01, 0.03, 0.1, 1.0]),
)
def test_steady_costs_run_the_faster_mode_and_explore_within_the_budget(
    spec: tuple[int, int],
    plain: tuple[int, int],
    window_steps: int,
    settle_steps: int,
    first_explore_steps: int,
    explore_budget: float,
) -> None:
    """Whatever the costs: after both windows the faster mode (speculation by the margin)
    runs; the slower one comes back one window at a time, each time once the schedule allows
    and the budget covers its last window's loss; so what the re-checks lose is at most the
    budget's share of the time the better mode ran before them."""
    assume(abs(rate(spec) / rate(plain) / 1.1 - 1) > 1e-3)  # not a tie at the margin
    config = PolicyConfig(
        window_steps=window_steps,
        settle_steps=settle_steps,
        first_explore_steps=first_explore_steps,
        explore_steps=4 * first_explore_steps,
        explore_budget=explore_budget,
    )
    policy = SpecPolicy(config)
    modes = drive(policy, 8, 600, lambda _, on: spec if on else plain)
    assert runs(modes) == steady_runs(config, spec, plain, 600)
    faster = rate(spec) > rate(plain) * config.margin
    best, slower = (spec, plain) if faster else (plain, spec)
    # the slower mode only ever runs for a window, to be measured again
    assert {n for mode, n in runs(modes)[:-1] if mode is not faster} == {window(config)}
    ran = lost = 0.0
    for i, (mode, n) in enumerate(runs(modes)[2:]):
        if mode is faster:
            ran = n * best[1]
        elif i and n == window(config):  # a whole re-check window
            lost = window_loss(config, slower, best)
            assert lost <= explore_budget * ran + 1e-6 * ran


def test_neighbouring_batch_sizes_share_a_bucket() -> None:
    policy = SpecPolicy(PolicyConfig(window_steps=1, settle_steps=0))
    policy.record(9, 10, 1_000)  # speculate window of the 16 bucket
    assert not policy.speculate(15)  # now measuring plain for 9..16
    assert not policy.speculate(17)  # the 24 bucket starts over, in the mode of the last step
    assert policy.rates(17) == {}


def test_a_decision_from_a_cold_window_is_checked_again_soon() -> None:
    """The first speculative window of a bucket is slow (a cold start: its first two steps
    take 40 ms), so plain decoding wins the first decision; its typical step is fast, so the
    policy measures again after first_explore_steps, long before the budget would allow, and
    switches; from then on the budget spaces the re-checks."""
    config = PolicyConfig(window_steps=4, settle_steps=1, explore_steps=400, first_explore_steps=8)
    policy = SpecPolicy(config)
    warm, cold, plain = (3, 2_000_000), (3, 40_000_000), (1, 1_000_000)

    def cost(step: int, on: bool) -> tuple[int, int]:
        return (cold if step < 2 else warm) if on else plain

    modes = drive(policy, 1, 90, cost)
    w = window(config)
    # The cold window: one cold and three warm steps (the settle step is not measured).
    cold_loss = loss_ns(12, cold[1] + 3 * warm[1], rate(plain))
    assert recheck_after(config, cold_loss, plain[1], 1) > config.first_explore_steps
    # Speculation wins the second decision: plain decoding's window lost against it, and it
    # is measured again once the budget covers that, and the doubled interval has passed.
    plain_loss = window_loss(config, plain, warm)
    second, third = (recheck_after(config, plain_loss, warm[1], d) for d in (2, 3))
    expected = [
        (True, w),
        (False, w + config.first_explore_steps),  # checked again at once
        (True, w + second),  # measured warm, then run
        (False, w),
        (True, third),
        (False, w),
    ]
    assert runs(modes) == [*expected, (True, 90 - sum(n for _, n in expected))]


def test_a_re_check_compares_against_what_the_running_mode_did() -> None:
    """Speculation's window is lucky (3 tokens in 2 ms, 1.5x plain decoding); then it runs at
    3 tokens in 4 ms (0.75x). At the re-check plain decoding's new window is compared with
    speculation's steps since its decision, not its old window: plain decoding wins."""
    config = PolicyConfig(window_steps=4, settle_steps=1, first_explore_steps=16)
    policy = SpecPolicy(config)
    lucky, later, plain = (3, 2_000_000), (3, 4_000_000), (1, 1_000_000)
    modes = drive(policy, 1, 80, lambda step, on: (lucky if step < 5 else later) if on else plain)
    w = window(config)
    ran = recheck_after(config, window_loss(config, plain, lucky), later[1], 1)
    assert ran == config.first_explore_steps  # the budget allowed it sooner
    # speculation measured, plain measured, speculation run, plain measured again: it wins
    assert runs(modes) == [(True, w), (False, w), (True, ran), (False, 80 - 2 * w - ran)]
    assert policy.rates(1)["speculate"] == pytest.approx(rate(later)) == 750.0
    # 0.75x is rarely measured again: not within the rest of the run
    lost = window_loss(config, later, plain)
    assert recheck_after(config, lost, plain[1], 2) > 80 - 2 * w - ran - w


def test_a_window_skips_the_drafts_catch_up() -> None:
    """Speculative steps while the draft catches up after K=0 (no trees yet, 1 token in
    10 ms) are left out of the window, up to max_unsettled_steps; the window then measures
    speculation itself (3 tokens in 2 ms) and keeps it."""
    config = PolicyConfig(window_steps=4, settle_steps=0, max_unsettled_steps=5)
    policy = SpecPolicy(config)
    for _ in range(4):  # speculation first: 3 tokens in 2 ms
        policy.record(1, 3, 2_000_000)
    for _ in range(4):  # then K=0: 1 token in 1 ms; K=0 loses
        assert not policy.speculate(1)
        policy.record(1, 1, 1_000_000)
    assert policy.speculate(1) and policy.rates(1)["speculate"] == pytest.approx(1500.0)
    lagging = SpecPolicy(config)
    lagging.record(1, 1, 1_000_000)  # a new bucket measures speculation first
    for _ in range(3):
        lagging.record(1, 1, 1_000_000)
    assert not lagging.speculate(1)  # K=0 measured next
    for _ in range(4):
        lagging.record(1, 1, 1_000_000)
    # Both measured at 1000 tokens/s: K=0 (the margin wants 10% more). Re-check speculation
    # with 7 catch-up steps: 5 are skipped, 2 counted, then 2 settled ones.
    lagging._bucket(1).mode = Mode.SPECULATE
    lagging._bucket(1).measuring = True
    for _ in range(7):
        lagging.record(1, 1, 10_000_000, settled=False)
    for _ in range(2):
        lagging.record(1, 3, 2_000_000)
    # (1 + 1 + 3 + 3) tokens in 24 ms: the two catch-up steps past the cap count.
    assert lagging.rates(1)["speculate"] == pytest.approx(8 / 0.024)


def test_reset_forgets_every_decision() -> None:
    """A bucket decided on cold steps (a service's warm-up) starts over after reset: it
    measures speculation first again, whatever it ran before."""
    policy = SpecPolicy(PolicyConfig(window_steps=2, settle_steps=0))
    for _ in range(2):
        policy.record(1, 3, 500_000_000)  # speculation, cold: 3 tokens in 0.5 s
    for _ in range(2):
        assert not policy.speculate(1)
        policy.record(1, 1, 1_000_000)
    assert not policy.speculate(1) and policy.rates(1)
    policy.reset()
    assert policy.rates(1) == {} and policy.speculate(1)
