"""The adaptive policy's exploration budget, on synthetic steps: a re-check of the slower mode
comes once the budget covers what its last window lost (the catch-up before it and, after K=0,
the catch-up on what K=0 holds now included), not before its schedule; a speculation window
that only saw the draft take in prompts gives up, and speculation is then re-checked every
explore_steps. Each expectation is the rule's (tests/helpers/policy.py), not a step index."""

from __future__ import annotations

import pytest

from tandem.target.policy import Mode, PolicyConfig, SpecPolicy
from tests.helpers.policy import (
    decide,
    drive,
    loss_ns,
    rate,
    recheck_after,
    runs,
    starts,
    window,
    window_loss,
)


@pytest.mark.parametrize("spec_ns", [30_000_000, 26_000_000])
def test_a_mode_slow_at_every_step_is_not_checked_again_at_once(spec_ns: int) -> None:
    """At bs 64 speculation is slower at every step (141 tokens in 30 ms, or in 26 ms: 0.73x
    and 0.85x of plain decoding's 64 tokens in 10 ms): the windows' median steps agree with
    their means, so the first decision is not re-checked after first_explore_steps; the
    explore budget spaces the re-check."""
    config = PolicyConfig(first_explore_steps=8, explore_steps=10_000)
    policy = SpecPolicy(config)
    spec, plain = (141, spec_ns), (64, 10_000_000)
    modes = drive(policy, 64, 300, lambda _, on: spec if on else plain)
    lost = window_loss(config, spec, plain)
    ran = recheck_after(config, lost, plain[1], 1)
    assert ran > config.first_explore_steps  # the budget, not the schedule
    # Speculation measured first (a window), then plain, run until the budget covers the loss.
    w = window(config)
    assert runs(modes)[:3] == [(True, w), (False, w + ran), (True, w)]


@pytest.mark.parametrize("budget", [0.03, 1.0])
def test_a_badly_losing_mode_is_rarely_measured_again(budget: float) -> None:
    """At bs 64 speculation commits 141 tokens in 30 ms against 64 in 10 ms: each window of it
    loses 8 ms a step. Each re-check waits until that loss is within the explore budget of the
    time spent decoding plainly since; without a budget (1.0) only the step schedule (32, 64,
    128, ... steps) spaces them."""
    config = PolicyConfig(explore_budget=budget, explore_steps=10_000)
    policy = SpecPolicy(config)
    spec, plain = (141, 30_000_000), (64, 10_000_000)
    total = lost = 0.0
    modes = []
    for _ in range(1500):
        on = policy.speculate(64)
        modes.append(on)
        tokens, ns = spec if on else plain
        policy.record(64, tokens, ns)
        total += ns
        lost += ns - tokens / 6400 * 1e9 if on else 0.0
    assert len(starts(modes)) >= 4 and lost / total < 0.03
    # Every run of K=0 after the first lasts until both the schedule and the budget allow.
    lost = window_loss(config, spec, plain)
    plain_runs = [n for on, n in runs(modes)[3:-1] if not on]
    schedule = [recheck_after(config, 0.0, plain[1], d) for d in range(2, 2 + len(plain_runs))]
    expected = [recheck_after(config, lost, plain[1], d) for d in range(2, 2 + len(plain_runs))]
    assert len(plain_runs) >= 3 and plain_runs == expected
    # With the budget, a window's loss spaces the first ones beyond the schedule; without, not.
    assert (plain_runs[:2] != schedule[:2]) is (budget < 1.0)


def test_a_costly_catch_up_counts_in_what_measuring_speculation_cost() -> None:
    """At bs 64 speculation loses (141 tokens in 30 ms against 64 in 10 ms), and each re-check
    from K=0 first pays the draft's catch-up: 5 steps of 100 ms for 64 tokens. The window skips
    them, so the rate is speculation's own, but the debt counts them: the next re-check waits
    on the window's loss and the catch-up's."""
    config = PolicyConfig(
        window_steps=4, settle_steps=0, first_explore_steps=8, explore_steps=100_000
    )
    policy = SpecPolicy(config)
    spec, plain, catch_up = (141, 30_000_000), (64, 10_000_000), (64, 100_000_000)
    modes, since_plain = [], 0
    for _ in range(2000):
        on = policy.speculate(64)
        modes.append(on)
        since_plain = since_plain + 1 if on else 0
        catching_up = on and len(modes) > since_plain and since_plain <= 5  # not the first
        if catching_up:
            policy.record(64, *catch_up, settled=False)
        else:
            policy.record(64, *(spec if on else plain))
    assert policy.rates(64)["speculate"] == pytest.approx(rate(spec))
    # Speculation, then plain measured. The first re-check waits on the first window's loss
    # only (no catch-up before it); the second (5 catch-up steps + a window) on that window's
    # loss plus its catch-up.
    n = config.window_steps
    plain_rate = rate((n * plain[0], n * plain[1]))  # K=0's window
    lost = window_loss(config, spec, plain)
    with_catch_up = loss_ns(
        n * spec[0] + 5 * catch_up[0], n * spec[1] + 5 * catch_up[1], plain_rate
    )
    first = 2 * window(config) + recheck_after(config, lost, plain[1], 1)
    second = first + 5 + window(config) + recheck_after(config, with_catch_up, plain[1], 2)
    assert starts(modes) == [first, second]


def test_a_recheck_after_k0_owes_the_catch_up_on_what_k0_holds() -> None:
    """Through the services the draft catches up on everything K=0 held before speculation is
    measured again. The policy learns what a catch-up cost per token taken in and waits, to
    measure again, until its budget covers the last loss and the catch-up of what is held now
    (which grows with every K=0 step)."""
    config = PolicyConfig(window_steps=4, settle_steps=1, first_explore_steps=8)
    policy = SpecPolicy(config)
    spec, plain = (60, 20_000_000), (32, 6_000_000)  # 3000 against 5333 tok/s
    held = 0
    bucket = decide(policy, 32, spec, plain)
    # Nothing was held: no catch-up measured yet, the prior stands.
    assert policy.catch_up_ns_per_token == config.catch_up_prior_ns_per_token
    waited = 0
    while not policy.speculate(32):  # K=0, every step's tokens held for the draft
        held = min(held + 32, 2048)  # (requests finish and others arrive)
        waited += 1
        policy.record(32, *plain, held=held)
        assert waited < 10_000
    assert bucket.held_at_switch == held == 2048
    # The prior priced that first re-check: 3% of the K=0 time covered the debt and it.
    owed = bucket.debt_ns + config.catch_up_prior_ns_per_token * held
    assert waited * 6e6 * 0.03 >= owed > (waited - 1) * 6e6 * 0.03
    # The resume catches up for three 40 ms steps (trees missing), then measures.
    for _ in range(3):
        policy.record(32, 60, 40_000_000, settled=False, held=0)
    for _ in range(5):
        policy.record(32, *spec, held=0)
    assert not policy.speculate(32) and bucket.decisions == 2
    # 180 tokens in 120 ms, 33.75 ms at K=0's rate: 86.25 ms lost over what was held.
    assert policy.catch_up_ns_per_token == pytest.approx(86.25e6 / held)
    debt, per_token = bucket.debt_ns, policy.catch_up_ns_per_token
    # Requests finish and others arrive: what is held levels off at 2048 tokens.
    held, waited = 0, 0
    while not policy.speculate(32):
        held = min(held + 32, 2048)
        waited += 1
        policy.record(32, *plain, held=held)
        if bucket.mode is Mode.PLAIN:  # (not yet switched to measure speculation)
            assert policy._owed(bucket) == pytest.approx(debt + per_token * held)
        assert waited < 10_000
    # Measured again only once 3% of the K=0 time covers the debt and the held catch-up,
    # later than the debt alone would have it.
    budget = waited * 6e6 * 0.03
    assert budget >= debt + per_token * held > budget - 6e6 * 0.03
    assert budget > debt + 1e6


def test_a_recheck_of_k0_owes_the_catch_up_it_causes() -> None:
    """Through the services at bs 32 speculation leads K=0 (96 tokens in 8 ms against 32 in
    5 ms), so a window of K=0 loses little itself; but speculation then resumes with the
    draft catching up on what the window held: two steps of 30 ms that commit a token a
    request. Each re-check of K=0 waits on the window's loss and that catch-up's, so the two
    together take about the explore budget's share of the time."""
    config = PolicyConfig(
        window_steps=4, settle_steps=0, first_explore_steps=8, explore_steps=100_000
    )
    policy = SpecPolicy(config)
    spec, plain, catch_up = (96, 8_000_000), (32, 5_000_000), (32, 30_000_000)
    spec_rate = rate(spec)
    modes: list[bool] = []
    behind = 0  # catch-up steps left after K=0
    total_ns = lost_ns = 0.0
    for _ in range(4000):
        on = policy.speculate(32)
        if on and modes and not modes[-1]:
            behind = 2
        modes.append(on)
        if on and behind:
            behind -= 1
            policy.record(32, *catch_up, settled=False)
            cost = catch_up
        else:
            cost = spec if on else plain
            policy.record(32, *cost)
        total_ns += cost[1]
        lost_ns += loss_ns(*cost, spec_rate)
    lost = window_loss(config, plain, spec)
    resume = loss_ns(2 * catch_up[0], 2 * catch_up[1], spec_rate)
    assert resume > 5 * lost  # the catch-up, not the window, is what a re-check of K=0 costs
    # Speculation, then K=0 measured; then speculation (its catch-up first) until 3% of the
    # time since covers the window's loss and the catch-up's.
    assert runs(modes)[:2] == [(True, window(config)), (False, window(config))]
    ran = [steps for on, steps in runs(modes)[2:-1] if on]
    paid = 2
    while (2 * catch_up[1] + (paid - 2) * spec[1]) * config.explore_budget < lost + resume:
        paid += 1
    assert len(ran) >= 3 and ran[0] == paid > recheck_after(config, lost, spec[1], 1)
    # Re-checks paced by the window's loss alone would lose about 15% of the time.
    assert lost_ns / total_ns < 1.2 * config.explore_budget
