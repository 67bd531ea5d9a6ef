"""Adaptive speculation (docs/design.md section 5): per batch size, speculate only while it pays.

Whether speculation pays depends on the batch size (verify cost grows with batch x tree width
once the forward stops being memory-bound), on the acceptance of the traffic, and on where the
draft runs. None of that is known in advance, so the policy measures it: for each batch-size
bucket it keeps the committed tokens per second of the last window of steps in each mode, with
speculation (the deployment's K, S, N) and without (K=0: plain decoding, the target-only
path), and runs the better one. After ``first_explore_steps`` steps it measures the other mode
again for one window, then after twice as many, up to every ``explore_steps`` steps: a
bucket's first windows may carry cold-start costs, and acceptance drifts with the traffic. A
bucket starts by measuring both. A window of the slower mode costs the time it lost against
the better one. A re-check compares the other mode's new window with what the running mode
did since its decision (all its steps, catch-ups and a draft's intake of new prompts included:
at bs 8 through the services one lucky window of speculation, 1474 tok/s against K=0's 1239,
held speculation for the whole run, which ran at 0.95x of target-only). It waits until the
loss is at most ``explore_budget`` of the time spent in the better mode since (speculation
that loses badly is rarely measured again), except a bucket's first re-check when the
windows' median steps would have decided otherwise (a few cold steps decided it), which comes
at once.

The catch-up steps a window skips (below) are no part of its rate, but they are part of
what measuring that mode cost: when it loses, they count in the debt with its window. A
window of K=0 that loses costs, beyond itself, the catch-up when speculation runs again (the
draft takes in what the window held): that counts in its debt too.

A new bucket starts in the mode the last step ran (a batch growing or shrinking across a
bucket boundary keeps its mode until measured), except above a bucket that runs K=0 by its
measurements, or whose speculation led K=0 by less than ``inherit_k0_below``: it starts
decided for K=0 and measures speculation once its budget covers the catch-up, after
``explore_steps`` (a measured decision, not a cold one) or, when predicted from a narrow lead,
on a first decision's schedule (at bs 8 through the services a lead of 1.31x at bs 1 predicted
K=0, and speculation won there by 1.14x). Speculation gains less the larger the batch
(its verify grows with batch x tree width once the forward is no longer memory-bound; a draft
service's exchange grows with the batch), so measuring it again at each larger size only
costs: through the services at bs 64 one round's first windows and re-check lost 5-10% of a
two-round row; in process, where speculation led by 1.26x at bs 32, a cold bs 64 batch
speculated through its prefill steps (the drafter's intake of every prompt) and its row ran at
0.945x of target-only, K=0 at 0.98-1.0x.

The first ``settle_steps`` steps after a switch are not measured: the first speculative step
after K=0 has no trees yet (the draft catches up on the tokens committed meanwhile) and the
first K=0 step may still verify nothing.

The policy only chooses; ``Engine.step`` carries it out (``DraftExchange`` holds the K=0
outcomes back and hands them to the draft in one extend when speculation resumes). Known
limit: S, K and N are the deployment's; a lane's choice is between them and K=0.
"""

from __future__ import annotations

import enum
import logging
import statistics
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Batch sizes are grouped like the graph buckets: the throughput of 9 and 15 requests is alike.
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class Mode(enum.Enum):
    SPECULATE = "speculate"
    PLAIN = "plain"  # K=0


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    window_steps: int = 8  # measured steps per window
    settle_steps: int = 1  # steps after a switch that are not measured
    explore_steps: int = 400  # steps in the better mode before measuring the other again
    # The first decisions are checked again sooner (the interval doubles up to explore_steps):
    # a bucket's first windows can carry cold-start costs (a draft's first shapes, say).
    first_explore_steps: int = 32
    # Speculation must beat plain decoding by this factor to be chosen: the windows leave out
    # what a switch costs (the draft's catch-up after K=0, the step decoding ahead that is
    # read before a speculative step), so near-equal rates stay with plain decoding.
    margin: float = 1.1
    # At most this share of the time goes to measuring the slower mode again.
    explore_budget: float = 0.03
    # Steps of a window skipped while the draft catches up after K=0 (at most).
    max_unsettled_steps: int = 16
    # What a resume's catch-up loses per token the draft takes in, until one is measured
    # (``SpecPolicy.catch_up_ns_per_token``). About twice what measured catch-ups lost
    # (bench/results/), so an unmeasured re-check waits rather than loses.
    catch_up_prior_ns_per_token: float = 20_000.0
    # A new bucket above one whose speculation led K=0 by less than this factor starts at K=0
    # (and measures speculation when its budget allows): the lead shrinks with the batch, so
    # a narrow lead below predicts a loss above (the measured leads: docs/performance.md).
    inherit_k0_below: float = 1.35

    def __post_init__(self) -> None:
        if min(self.window_steps, self.explore_steps, self.first_explore_steps) < 1:
            raise ValueError("window_steps, explore_steps, first_explore_steps: must be >= 1")
        if self.settle_steps < 0:
            raise ValueError("settle_steps: must be >= 0")
        if self.margin <= 0:
            raise ValueError("margin: must be > 0")
        if not 0 < self.explore_budget <= 1:
            raise ValueError("explore_budget: must be in (0, 1]")
        if self.catch_up_prior_ns_per_token < 0:
            raise ValueError("catch_up_prior_ns_per_token: must be >= 0")
        if self.inherit_k0_below < 0:
            raise ValueError("inherit_k0_below: must be >= 0")


@dataclass
class _Bucket:
    """One batch-size bucket's measurements and what it runs now."""

    mode: Mode = Mode.SPECULATE
    measuring: bool = True  # this window's rate is recorded for ``mode``
    windows: dict[Mode, tuple[int, int]] = field(default_factory=dict)  # last (tokens, ns)
    typical: dict[Mode, float] = field(default_factory=dict)  # last window's median step rate
    step_rates: list[float] = field(default_factory=list)  # this window's, per step
    contested: bool = False  # the windows' median steps would have decided otherwise
    steps: int = 0  # steps in the current phase (settle + window, or exploit)
    decisions: int = 0  # exploit phases so far (each one doubles the next phase's length)
    tokens: int = 0  # measured so far in this window
    ns: int = 0  # the window's time, or (exploiting) the time since the decision
    debt_ns: float = 0.0  # what the last window of the slower mode lost against the better
    unsettled: int = 0  # steps of this window skipped while the draft caught up
    # Decided from the bucket below (``SpecPolicy._new_bucket``) and not measured since:
    # re-checks every explore_steps (a measured decision, not a cold one).
    inherited: bool = False
    # Decided for K=0 from the narrow lead of speculation below (or from a bucket so
    # decided), not measured since: a prediction, re-checked on a first decision's schedule,
    # as soon as the budget covers the catch-up.
    predicted: bool = False
    catch_up: tuple[int, int] = (0, 0)  # their (tokens, ns)
    # Speculation runs again after a window of K=0 lost to it: the draft's catch-up on what
    # that window held is part of what measuring K=0 cost (added to ``debt_ns`` once over).
    resuming: bool = False
    held_at_switch: int = 0  # tokens the draft had to take in when speculation was measured
    # Per mode, the (tokens, ns) its last window skipped: no part of its rate, but part of
    # what measuring it cost when it loses.
    switch_costs: dict[Mode, tuple[int, int]] = field(default_factory=dict)

    @property
    def rates(self) -> dict[Mode, float]:
        """Committed tokens per second of each mode's last window."""
        return {mode: tokens / max(ns, 1) * 1e9 for mode, (tokens, ns) in self.windows.items()}


class SpecPolicy:
    """Chooses, step by step, whether a batch of ``batch_size`` requests speculates."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._buckets: dict[int, _Bucket] = {}
        self.switches = 0  # mode changes so far (tests, logs)
        self._last = Mode.SPECULATE  # the mode of the last step: a new bucket starts there
        self._held = 0  # tokens the draft would take in first if speculation resumed now
        # What a resume's catch-up lost per token the draft took in (the last one measured;
        # the config's prior before): a re-check of speculation after K=0 is expected to
        # cost this times ``_held``.
        self.catch_up_ns_per_token = self.config.catch_up_prior_ns_per_token

    def reset(self) -> None:
        """Forgets every measurement: steps before it (a service's warm-up, whose first
        speculative steps compile kernels) are not traffic to decide by."""
        self._buckets.clear()
        self._last = Mode.SPECULATE
        self._held = 0
        self.catch_up_ns_per_token = self.config.catch_up_prior_ns_per_token

    def speculate(self, batch_size: int) -> bool:
        """The mode of the next step of a batch this size."""
        self._last = self._bucket(batch_size).mode
        return self._last is Mode.SPECULATE

    def record(
        self,
        batch_size: int,
        committed_tokens: int,
        step_ns: int,
        *,
        settled: bool = True,
        held: int = 0,
    ) -> None:
        """One step of ``batch_size`` requests in the mode ``speculate`` returned for it.
        ``settled=False``: the draft is still catching up after K=0 (runs or admits waiting);
        a measuring window skips up to ``max_unsettled_steps`` such steps, so it measures
        speculation itself (the catch-up is a switch's cost, which ``margin`` covers).
        ``held``: tokens the draft would take in before speculating again (runs K=0 held,
        prompts waiting): a re-check of speculation is expected to cost their catch-up."""
        c, b = self.config, self._bucket(batch_size)
        self._held = held
        skipped = (b.catch_up[0] + committed_tokens, b.catch_up[1] + step_ns)
        if not settled and b.measuring and b.unsettled < c.max_unsettled_steps:
            b.unsettled += 1
            b.catch_up = skipped
            return
        b.steps += 1
        if not b.measuring:
            if b.resuming:
                self._resume(b, committed_tokens, step_ns, settled=settled)
            b.tokens += committed_tokens
            b.ns += step_ns
            interval = min(c.explore_steps, c.first_explore_steps << max(0, b.decisions - 1))
            if b.inherited:
                interval = c.explore_steps
            # A first decision its windows' median steps contradict is checked again at once:
            # a few cold steps (a first shape, a compile) slow a window's mean, not its median.
            paid = (b.decisions <= 1 and b.contested) or b.ns * c.explore_budget >= self._owed(b)
            if b.steps >= interval and paid:
                # The other mode is measured again against what this one ran at since its decision,
                # every step counted (catch-ups): a lucky window no longer holds a mode that runs
                # slower. It stands as a window of window_steps (a debt is a window's loss).
                if b.steps >= c.window_steps:
                    scale = c.window_steps / b.steps
                    b.windows[b.mode] = (round(b.tokens * scale), round(b.ns * scale))
                self._switch(b, _other(b.mode), measuring=True)  # measure the other mode again
            return
        if b.steps <= c.settle_steps:
            return
        b.tokens += committed_tokens
        b.ns += step_ns
        b.step_rates.append(committed_tokens / max(step_ns, 1) * 1e9)
        if b.steps < c.settle_steps + c.window_steps:
            return
        b.windows[b.mode] = (b.tokens, b.ns)
        b.switch_costs[b.mode] = b.catch_up
        if b.mode is Mode.SPECULATE and Mode.PLAIN in b.windows and b.held_at_switch >= 64:
            loss = _loss_ns(*b.catch_up, b.rates[Mode.PLAIN])
            self.catch_up_ns_per_token = loss / b.held_at_switch
        b.typical[b.mode] = statistics.median(b.step_rates)
        b.inherited = b.predicted = False
        other = _other(b.mode)
        if other not in b.windows:  # a new bucket: measure the other mode too
            self._switch(b, other, measuring=True)
            return
        rates = b.rates
        best = self._better(rates)
        # The slower mode's last window and the catch-up steps it skipped: their tokens in
        # the better mode would have taken tokens / rate; what they took beyond that is the
        # debt the next re-check waits on (a catch-up that costs a hundred plain steps makes
        # measuring speculation again that much rarer).
        loser = _other(best)
        tokens, ns = b.windows[loser]
        skipped_tokens, skipped_ns = b.switch_costs.get(loser, (0, 0))
        tokens, ns = tokens + skipped_tokens, ns + skipped_ns
        b.debt_ns = _loss_ns(tokens, ns, rates[best])
        b.contested = len(b.typical) == 2 and self._better(b.typical) is not best
        b.decisions += 1
        logger.info(
            "batch %d: %s (windows: speculation %.0f tok/s, K=0 %.0f tok/s; median steps "
            "%.0f / %.0f; %d catch-up steps skipped)",
            batch_size,
            "speculate" if best is Mode.SPECULATE else "K=0",
            rates[Mode.SPECULATE],
            rates[Mode.PLAIN],
            b.typical.get(Mode.SPECULATE, 0.0),
            b.typical.get(Mode.PLAIN, 0.0),
            b.unsettled,
        )
        measured_plain = b.mode is Mode.PLAIN
        self._switch(b, best, measuring=False)
        if best is Mode.SPECULATE and measured_plain:
            b.resuming, b.held_at_switch = True, self._held

    def _resume(self, b: _Bucket, committed_tokens: int, step_ns: int, *, settled: bool) -> None:
        """A step of speculation run again after a window of K=0: while the draft catches
        up on what K=0 held (up to ``max_unsettled_steps``), its steps are kept; at the first
        settled one, what they lost against speculation's window is added to the debt (the
        next re-check of K=0 pays for the catch-up it causes too: through the services at
        bs 32 two catch-up steps of 20 and 11 ms of draft time, against a window that lost a
        few ms), and what they lost against K=0's window per token held prices the catch-up
        of a re-check of speculation (``catch_up_ns_per_token``)."""
        if not settled and b.unsettled < self.config.max_unsettled_steps:
            b.unsettled += 1
            b.catch_up = (b.catch_up[0] + committed_tokens, b.catch_up[1] + step_ns)
            return
        rates = b.rates
        b.debt_ns += _loss_ns(*b.catch_up, rates[Mode.SPECULATE])
        if b.held_at_switch >= 64 and b.catch_up[1]:
            loss = _loss_ns(*b.catch_up, rates[Mode.PLAIN])
            self.catch_up_ns_per_token = loss / b.held_at_switch
        b.resuming, b.unsettled, b.catch_up = False, 0, (0, 0)

    def _better(self, rates: dict[Mode, float]) -> Mode:
        """Speculation when it beats plain decoding by the margin."""
        spec, plain = rates[Mode.SPECULATE], rates[Mode.PLAIN]
        return Mode.SPECULATE if spec > plain * self.config.margin else Mode.PLAIN

    def rates(self, batch_size: int) -> dict[str, float]:
        """The bucket's last measured tokens/s per mode ("speculate", "plain")."""
        return {mode.value: rate for mode, rate in self._bucket(batch_size).rates.items()}

    def _bucket(self, batch_size: int) -> _Bucket:
        key = next((b for b in _BUCKETS if b >= batch_size), _BUCKETS[-1])
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self._new_bucket(key)
        return bucket

    def _new_bucket(self, key: int) -> _Bucket:
        """Above the nearest decided bucket when it runs K=0 (K=0, with its debt: re-checked
        every ``explore_steps``) or when its speculation led by less than ``inherit_k0_below``
        (K=0, predicted: re-checked as a first decision, once the budget covers the catch-up;
        see the module docstring). Otherwise the mode of the last step, measured
        first: a batch that grows or shrinks into a new bucket keeps its mode while the bucket
        measures it (switching would cost a catch-up, or a drain, for nothing)."""
        decided = [k for k, b in self._buckets.items() if k < key and b.decisions]
        if not decided:
            return _Bucket(mode=self._last)
        below = self._buckets[max(decided)]
        rates = below.rates
        # Its decision, also while it measures the other mode again (through the services a
        # bs-64 batch arrived while bs 32's re-check of speculation ran, and measured both).
        runs = _other(below.mode) if below.measuring else below.mode
        if runs is Mode.PLAIN:
            debt, predicted = below.debt_ns, below.predicted
        elif len(rates) == 2 and (
            rates[Mode.SPECULATE] < rates[Mode.PLAIN] * self.config.inherit_k0_below
        ):
            debt, predicted = 0.0, True  # re-checking costs the catch-up, owed as it grows
        else:
            return _Bucket(mode=self._last)
        logger.info("batch bucket %d: K=0, from the one of %d", key, max(decided))
        return _Bucket(
            mode=Mode.PLAIN,
            measuring=False,
            decisions=1,
            debt_ns=debt,
            inherited=not predicted,
            predicted=predicted,
        )

    def _owed(self, b: _Bucket) -> float:
        """What measuring the other mode again is expected to cost: the last loss (``debt``)
        and, for speculation after K=0, the catch-up on what K=0 holds now (the debt alone
        lets a re-check whose first window had little to catch up on cost several times what
        it owed)."""
        if b.mode is Mode.PLAIN:
            return b.debt_ns + self.catch_up_ns_per_token * self._held
        return b.debt_ns

    def _switch(self, b: _Bucket, mode: Mode, *, measuring: bool) -> None:
        if mode is Mode.SPECULATE and measuring:
            b.held_at_switch = self._held
        if mode is not b.mode:
            self.switches += 1
        b.mode, b.measuring, b.resuming = mode, measuring, False
        b.steps = b.tokens = b.ns = b.unsettled = 0
        b.catch_up = (0, 0)
        b.step_rates = []


class NeverSpeculate(SpecPolicy):
    """Every step K=0 with the draft attached (``spec_policy="k0"``): measures that path."""

    def speculate(self, batch_size: int) -> bool:
        return False

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass


def _loss_ns(tokens: int, ns: int, rate: float) -> float:
    """What ``tokens`` in ``ns`` took beyond their time at ``rate`` tokens/s (0 if less)."""
    return max(0.0, ns - tokens / max(rate, 1e-9) * 1e9)


def _other(mode: Mode) -> Mode:
    return Mode.PLAIN if mode is Mode.SPECULATE else Mode.SPECULATE
