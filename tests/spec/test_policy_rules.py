"""The adaptive policy's rules, on synthetic steps: it picks the faster mode per batch-size
bucket, re-measures the other on a schedule and within an exploration budget, checks again at
once a decision that cold steps made, leaves the draft's catch-up out of a window but counts it
in what measuring that mode cost, and forgets everything on reset."""

from __future__ import annotations

import itertools

import pytest

from tandem.target.policy import Mode, PolicyConfig, SpecPolicy, _Bucket


def _decide(
    policy: SpecPolicy, batch_size: int, spec: tuple[int, int], plain: tuple[int, int]
) -> _Bucket:
    """Steps a bucket (``spec`` or ``plain`` tokens and ns a step) until its first decision."""
    while not (policy._buckets.get(batch_size) and policy._buckets[batch_size].decisions):
        on = policy.speculate(batch_size)
        policy.record(batch_size, *(spec if on else plain))
    return policy._buckets[batch_size]


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
    # It re-measures: the worse mode comes back for a window, then goes again.
    assert any(modes[64][60:]) and not all(modes[64][60:])


def test_neighbouring_batch_sizes_share_a_bucket() -> None:
    policy = SpecPolicy(PolicyConfig(window_steps=1, settle_steps=0))
    policy.record(9, 10, 1_000)  # speculate window of the 16 bucket
    assert not policy.speculate(15)  # now measuring plain for 9..16
    assert not policy.speculate(17)  # the 24 bucket starts over, in the mode of the last step
    assert policy.rates(17) == {}


def test_a_decision_from_a_cold_window_is_checked_again_soon() -> None:
    """The first speculative window of a bucket is slow (a cold start: its first two steps
    take 40 ms), so plain decoding wins the first decision; its typical step is fast, so the
    policy measures again after first_explore_steps and switches."""
    config = PolicyConfig(window_steps=4, settle_steps=1, explore_steps=400, first_explore_steps=8)
    policy = SpecPolicy(config)
    modes = []
    for step in range(90):
        on = policy.speculate(1)
        modes.append(on)
        cold = on and step < 2
        tokens, ns = (3, 40_000_000 if cold else 2_000_000) if on else (1, 1_000_000)
        policy.record(1, tokens, ns)
    assert modes[5:18] == [False] * 13  # plain measured, then run for 8 steps
    # Speculation is measured again (warm now) and wins. Plain decoding lost 1.33 ms in its
    # window (4 tokens in 4 ms against 2.67 ms): it is measured again once that is within 3%
    # of the time since, 22 speculative steps after the window.
    assert all(modes[18:46]) and not any(modes[46:51]) and all(modes[51:83])


@pytest.mark.parametrize("spec_ns", [30_000_000, 26_000_000])
def test_a_mode_slow_at_every_step_is_not_checked_again_at_once(spec_ns: int) -> None:
    """At bs 64 speculation is slower at every step (141 tokens in 30 ms, or in 26 ms: 0.73x
    and 0.85x of plain decoding's 64 tokens in 10 ms): the windows' median steps agree with
    their means, so the first decision is not re-checked after first_explore_steps; the
    explore budget spaces the re-check (at least 213 plain steps after, 100 at 26 ms)."""
    config = PolicyConfig(first_explore_steps=8, explore_steps=10_000)
    policy = SpecPolicy(config)
    modes = []
    for _ in range(300):
        on = policy.speculate(64)
        modes.append(on)
        tokens, ns = (141, spec_ns) if on else (64, 10_000_000)
        policy.record(64, tokens, ns)
    # Speculation measured first (settle + 8 steps), then plain; then plain for a long while.
    gap = 213 if spec_ns == 30_000_000 else 100
    assert all(modes[:9]) and not any(modes[9 : 9 + gap])


@pytest.mark.parametrize("budget", [0.03, 1.0])
def test_a_badly_losing_mode_is_rarely_measured_again(budget: float) -> None:
    """At bs 64 speculation commits 141 tokens in 30 ms against 64 in 10 ms: each window of it
    loses 8 ms a step. After the first re-check, the next waits until that loss is within the
    explore budget of the time spent decoding plainly since; without a budget (1.0) only the
    step schedule (32, 64, 128, ... steps) spaces them."""
    policy = SpecPolicy(PolicyConfig(explore_budget=budget, explore_steps=10_000))
    total = lost = 0.0
    modes = []
    for _ in range(1500):
        on = policy.speculate(64)
        modes.append(on)
        tokens, ns = (141, 30_000_000) if on else (64, 10_000_000)
        policy.record(64, tokens, ns)
        total += ns
        lost += ns - tokens / 6400 * 1e9 if on else 0.0
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert len(starts) >= 4 and lost / total < 0.03
    # A window (settle + 8 steps) loses 72 ms: 0.03 of 2.4 s, >= 213 plain steps after it.
    if budget < 1.0:
        assert min(gaps[1:]) >= 213, gaps
    else:
        assert min(gaps[1:]) < 213, gaps


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


def test_steps_decoding_plainly_while_the_draft_ingests_measure_neither_mode() -> None:
    """While a draft service takes in new prompts the engine decodes with K=0 whatever the
    policy chose (1 token in 1 ms here); such steps (up to max_unsettled_steps) are no part of
    a speculation window: speculation (1 token in 2 ms) loses to K=0 (0.9 tokens a ms).
    Counted, thirty of them would have made speculation 1000 tokens/s, and chosen it."""
    config = PolicyConfig(window_steps=4, settle_steps=0, max_unsettled_steps=30)
    policy = SpecPolicy(config)
    for _ in range(30):  # a new bucket measures speculation first
        assert policy.speculate(1)
        policy.record(1, 1, 1_000_000, ingesting=True)
    for _ in range(4):
        policy.record(1, 1, 2_000_000)
    assert not policy.speculate(1)  # K=0 measured next
    for _ in range(4):
        policy.record(1, 9, 10_000_000)
    assert policy.rates(1) == pytest.approx({"speculate": 500.0, "plain": 900.0})
    assert not policy.speculate(1)
    for _ in range(3):  # decided: a step ingesting counts as time in its mode, as any
        policy.record(1, 1, 1_000_000, ingesting=True)
    assert policy._bucket(1).steps == 3


def test_a_speculation_window_that_only_sees_the_draft_ingest_gives_up() -> None:
    """Past max_unsettled_steps steps of ingest a speculation window gives up for K=0: measured
    when the bucket is new, decided (re-checked later, as after any decision) when K=0 has a
    window; speculation's rate is never made of plain steps."""
    config = PolicyConfig(window_steps=4, settle_steps=0, max_unsettled_steps=5)
    policy = SpecPolicy(config)
    for _ in range(6):  # a new bucket measures speculation first: it only ingests
        assert policy.speculate(1)
        policy.record(1, 1, 1_000_000, ingesting=True)
    assert not policy.speculate(1) and policy._bucket(1).measuring  # K=0 measured
    for _ in range(4):
        policy.record(1, 1, 1_000_000)
    assert policy.rates(1) == {"plain": 1000.0}
    bucket = policy._bucket(1)
    # K=0 decided, not speculation measured again at once: it gave up
    assert not policy.speculate(1) and not bucket.measuring and bucket.decisions == 1
    bucket.mode, bucket.measuring = Mode.SPECULATE, True  # a re-check
    policy.record(1, 0, 60_000_000, settled=False)  # a step that waited 60 ms on the draft
    for _ in range(6):
        policy.record(1, 1, 1_000_000, ingesting=True)
    assert not policy.speculate(1) and not bucket.measuring  # K=0, decided
    assert policy.rates(1) == {"plain": 1000.0} and bucket.decisions == 2
    # The wait is the debt: 66 ms for 6 tokens at 1000 tokens/s. The next re-check waits for
    # 60 ms / 0.03 = 2 s of K=0, not the 32 steps after a first decision.
    assert bucket.debt_ns == pytest.approx(60_000_000)
    waited = 0
    while not policy.speculate(1):
        policy.record(1, 1, 1_000_000)
        waited += 1
    assert waited == 2000


def test_after_a_give_up_speculation_is_re_checked_every_explore_steps() -> None:
    """Each attempt at speculation while a draft service takes in new prompts sends it the
    batch's prompts; after a give-up the re-checks come every explore_steps (not after 32, 64,
    ... steps), until a speculation window is measured again."""
    config = PolicyConfig(window_steps=4, settle_steps=0, max_unsettled_steps=5, explore_steps=300)
    policy = SpecPolicy(config)
    modes = []
    for step in range(1000):
        on = policy.speculate(8)
        modes.append(on)
        # the draft takes in prompts until step 700; then speculation is measured (and loses)
        policy.record(
            8, 8 if not on else 12, 1_000_000 if not on else 2_000_000, ingesting=on and step < 700
        )
    starts = [i for i in range(len(modes)) if modes[i] and (i == 0 or not modes[i - 1])]
    # an attempt (6 steps), K=0 measured (4 steps) and decided; every 300 plain steps another
    assert starts[:3] == [0, 310, 616], starts
    bucket = policy._bucket(8)
    assert not bucket.gave_up and policy.rates(8)["speculate"] == pytest.approx(6000.0)


def test_a_costly_catch_up_counts_in_what_measuring_speculation_cost() -> None:
    """At bs 64 speculation loses (141 tokens in 30 ms against 64 in 10 ms), and each re-check
    from K=0 first pays the draft's catch-up: 5 steps of 100 ms for 64 tokens. The window skips
    them, so the rate is speculation's own, but the debt counts them: 482 ms instead of 32 ms,
    so the next re-check waits 16 s of plain decoding (1607 steps), not 1.1 s (107)."""
    config = PolicyConfig(
        window_steps=4, settle_steps=0, first_explore_steps=8, explore_steps=100_000
    )
    policy = SpecPolicy(config)
    modes, since_plain = [], 0
    for _ in range(2000):
        on = policy.speculate(64)
        modes.append(on)
        since_plain = since_plain + 1 if on else 0
        catching_up = on and len(modes) > since_plain and since_plain <= 5  # not the first
        if catching_up:
            policy.record(64, 64, 100_000_000, settled=False)
        else:
            tokens, ns = (141, 30_000_000) if on else (64, 10_000_000)
            policy.record(64, tokens, ns)
    assert policy.rates(64)["speculate"] == pytest.approx(141 / 0.030)
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    # Speculation, then plain measured (steps 0-7). The first re-check waits on the first
    # window's loss only (no catch-up before it): 4 x 30 ms - 564 tokens / 6400 tokens/s =
    # 31.9 ms, 3% of 1.07 s: 107 plain steps. The second (5 catch-up steps + a window of 4)
    # waits on that window's loss plus its catch-up: 482 ms, 1607 plain steps.
    assert starts == [8 + 107, 8 + 107 + 9 + 1607], starts


def test_a_re_check_compares_against_what_the_running_mode_did() -> None:
    """Speculation's window is lucky (3 tokens in 2 ms, 1.5x plain decoding); then it runs at
    3 tokens in 4 ms (0.75x). At the re-check plain decoding's new window is compared with
    speculation's steps since its decision, not its old window: plain decoding wins."""
    config = PolicyConfig(window_steps=4, settle_steps=1, first_explore_steps=16)
    policy = SpecPolicy(config)
    modes = []
    for step in range(80):
        on = policy.speculate(1)
        modes.append(on)
        lucky = step < 5
        tokens, ns = (3, 2_000_000 if lucky else 4_000_000) if on else (1, 1_000_000)
        policy.record(1, tokens, ns)
    # speculation measured (5 steps), plain (5), speculation run for 16, plain measured again
    assert modes[:5] == [True] * 5 and modes[5:10] == [False] * 5
    assert all(modes[10:26]) and not any(modes[26:31])
    assert policy.rates(1)["speculate"] == pytest.approx(750.0)
    assert not any(modes[31:])  # plain decoding wins; 0.75x is rarely measured again


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


def test_a_bucket_above_one_that_runs_k0_starts_at_k0_owing_its_debt() -> None:
    """Through the services at bs 32 speculation lost: the 48 and 64 buckets a batch grows
    into start decided for K=0 (no windows of their own), and measure speculation after
    explore_steps once that debt is paid; a bucket below, or above one that speculates,
    measures as before."""
    config = PolicyConfig(window_steps=4, settle_steps=1, first_explore_steps=8)
    policy = SpecPolicy(config)
    spec, plain = (60, 20_000_000), (32, 6_000_000)  # 3000 against 5333 tok/s
    decided = _decide(policy, 32, spec, plain)
    assert decided.mode is Mode.PLAIN and decided.debt_ns > 0
    # Speculation's window: 240 tokens in 80 ms, 45 ms at K=0's rate: 35 ms owed.
    assert decided.debt_ns == pytest.approx(35e6, rel=1e-3)
    modes = []
    for _ in range(500):
        on = policy.speculate(64)
        modes.append(on)
        policy.record(64, *((100, 30_000_000) if on else (64, 7_000_000)))
    # Re-checked after explore_steps (400; 3% of K=0's time has paid the 35 ms after 167
    # steps of 7 ms): then one window measures speculation there.
    assert modes[:400] == [False] * 400 and any(modes)
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
    _decide(policy, 16, spec, plain)
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
    assert _decide(policy, 32, spec, plain).mode is Mode.SPECULATE
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
        # prior (20.5 ms: 98 steps of 7 ms), not explore_steps (400); then speculation is
        # measured, and K=0 kept.
        assert not bucket.predicted  # measured since
        assert modes.index(True) == 98
        assert bucket.mode is Mode.PLAIN and bucket.decisions >= 2
    else:
        assert any(modes[:20]) and bucket.decisions >= 1  # both modes measured at once


def test_a_recheck_after_k0_owes_the_catch_up_on_what_k0_holds() -> None:
    """Through the services the draft catches up on everything K=0 held before speculation is
    measured again. The policy learns what a catch-up cost per token taken in and waits, to
    measure again, until its budget covers the last loss and the catch-up of what is held now
    (which grows with every K=0 step)."""
    config = PolicyConfig(window_steps=4, settle_steps=1, first_explore_steps=8)
    policy = SpecPolicy(config)
    spec, plain = (60, 20_000_000), (32, 6_000_000)  # 3000 against 5333 tok/s
    held = 0
    bucket = _decide(policy, 32, spec, plain)
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
