"""The adaptive policy's new buckets, on synthetic steps: a bucket above one that runs K=0, or
whose speculation led K=0 by less than ``inherit_k0_below``, starts decided for K=0 and
measures speculation once its rule allows (every explore_steps after a measured K=0 decision,
on a first decision's schedule after a narrow lead); other new buckets measure both modes.
Each expectation is the rule's (tests/helpers/policy.py), not a step index."""

from __future__ import annotations

import pytest

from tandem.target.policy import Mode, PolicyConfig, SpecPolicy
from tests.helpers.policy import decide, recheck_after


def test_a_bucket_above_one_that_runs_k0_starts_at_k0_owing_its_debt() -> None:
    """Through the services at bs 32 speculation lost: the 48 and 64 buckets a batch grows
    into start decided for K=0 (no windows of their own), and measure speculation after
    explore_steps once that debt is paid; a bucket below, or above one that speculates,
    measures as before."""
    config = PolicyConfig(window_steps=4, settle_steps=1, first_explore_steps=8)
    policy = SpecPolicy(config)
    spec, plain = (60, 20_000_000), (32, 6_000_000)  # 3000 against 5333 tok/s
    decided = decide(policy, 32, spec, plain)
    assert decided.mode is Mode.PLAIN and decided.debt_ns > 0
    # Speculation's window: 240 tokens in 80 ms, 45 ms at K=0's rate: 35 ms owed.
    assert decided.debt_ns == pytest.approx(35e6, rel=1e-3)
    modes = []
    for _ in range(500):
        on = policy.speculate(64)
        modes.append(on)
        policy.record(64, *((100, 30_000_000) if on else (64, 7_000_000)))
    # Re-checked after explore_steps, although 3% of K=0's time has paid the 35 ms sooner:
    # then one window measures speculation there.
    every = config.explore_steps
    assert recheck_after(config, decided.debt_ns, 7_000_000, 1) < every
    assert modes.index(True) == recheck_after(config, decided.debt_ns, 7_000_000, 1, every=every)
    bucket = policy._buckets[64]
    assert bucket.mode is Mode.PLAIN and bucket.decisions == 2  # measured, and K=0 again
    assert not policy.speculate(48)  # above 32 too: K=0 at once
    policy.speculate(8)  # below: measured first (from the last step's mode)
    assert policy._buckets[8].measuring and policy._buckets[8].decisions == 0
    fresh = SpecPolicy(config)  # nothing decided below: measured first
    assert fresh.speculate(64) and fresh._buckets[64].measuring


def test_a_bucket_above_one_re_checking_speculation_follows_its_decision() -> None:
    """Through the services a bs-64 batch arrived while the 32 bucket (K=0, from the 16
    bucket's decision) measured speculation for the first time: the 64 bucket goes by 32's
    decision, not by the mode it measures."""
    config = PolicyConfig(window_steps=4, settle_steps=1, first_explore_steps=8)
    policy = SpecPolicy(config)
    spec, plain = (30, 20_000_000), (16, 6_000_000)  # 1500 against 2667 tok/s
    decide(policy, 16, spec, plain)
    below = None
    for _ in range(1000):
        policy.speculate(32)
        below = policy._buckets[32]
        if below.measuring:
            break
        policy.record(32, 32, 6_000_000)
    assert below is not None and below.inherited and below.mode is Mode.SPECULATE
    assert not policy.speculate(64) and policy._buckets[64].inherited


@pytest.mark.parametrize(("spec_ns", "inherits"), [(10_000_000, True), (8_000_000, False)])
def test_a_bucket_above_a_narrow_lead_of_speculation_starts_at_k0(
    spec_ns: int, inherits: bool
) -> None:
    """In process at bs 32 speculation led K=0 by 1.26x, and at bs 64 not by the margin: the
    64 bucket above a lead under ``inherit_k0_below`` starts at K=0 (its prompts' steps never
    speculate), and measures speculation once its budget covers the catch-up of what K=0
    holds; above a wider lead it measures as before."""
    config = PolicyConfig(window_steps=4, settle_steps=1, first_explore_steps=8)
    policy = SpecPolicy(config)
    spec, plain = (96, spec_ns), (32, 4_000_000)  # 9600 or 12000 against 8000 tok/s
    assert decide(policy, 32, spec, plain).mode is Mode.SPECULATE
    lead = policy.rates(32)["speculate"] / policy.rates(32)["plain"]
    assert (lead < config.inherit_k0_below) is inherits
    modes = []
    for _ in range(500):
        on = policy.speculate(64)
        modes.append(on)
        policy.record(64, *((130, 14_000_000) if on else (64, 7_000_000)), held=1024)
    bucket = policy._buckets[64]
    if inherits:
        # A prediction: K=0 until 3% of its time covers 1024 held tokens' catch-up at the
        # prior, on a first decision's schedule, not explore_steps; then speculation is
        # measured, and K=0 kept.
        assert not bucket.predicted  # measured since
        owed = config.catch_up_prior_ns_per_token * 1024
        assert modes.index(True) == recheck_after(config, owed, 7_000_000, 1)
        assert modes.index(True) < config.explore_steps
        assert bucket.mode is Mode.PLAIN and bucket.decisions >= 2
    else:
        assert any(modes[:20]) and bucket.decisions >= 1  # both modes measured at once
