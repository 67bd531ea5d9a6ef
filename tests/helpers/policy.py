"""The adaptive policy's rules (tandem/target/policy.py) as the policy tests state them: what a
window of the slower mode lost, when the other mode is measured again, and the schedule a
bucket follows when its steps cost the same throughout. The tests compare the policy's choices
with these, so each expectation reads as the rule it checks, not as a step index."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from tandem.target.policy import PolicyConfig, SpecPolicy, _Bucket

Cost = tuple[int, int]  # (committed tokens, ns) of one step


def runs(modes: list[bool]) -> list[tuple[bool, int]]:
    """The policy's choices as runs of one mode: (speculated, steps)."""
    return [(mode, len(list(group))) for mode, group in itertools.groupby(modes)]


def starts(modes: list[bool]) -> list[int]:
    """The steps at which speculation is taken up again after K=0."""
    return [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]


def window(config: PolicyConfig) -> int:
    """Steps a mode is measured for: the settle steps after a switch, then its window."""
    return config.settle_steps + config.window_steps


def rate(cost: Cost) -> float:
    """Committed tokens per second."""
    return cost[0] / cost[1] * 1e9


def loss_ns(tokens: int, ns: int, rate: float) -> float:
    """What ``tokens`` in ``ns`` took beyond their time at ``rate`` tokens/s: what measuring a
    slower mode lost against the better one (0 if it was not slower)."""
    return max(0.0, ns - tokens / rate * 1e9)


def window_loss(config: PolicyConfig, slower: Cost, better: Cost) -> float:
    """What a window of steps costing ``slower`` lost against a window of ``better``'s rate."""
    n = config.window_steps
    return loss_ns(n * slower[0], n * slower[1], rate((n * better[0], n * better[1])))


def recheck_after(
    config: PolicyConfig, owed_ns: float, step_ns: int, decisions: int, *, every: int | None = None
) -> int:
    """Steps the better mode runs before the other is measured again: the first step at which
    both the schedule allows it (``first_explore_steps``, doubled with each decision up to
    ``explore_steps``; ``every`` where the rule fixes it) and the budget covers what measuring
    it is expected to cost (``explore_budget`` of the time run since >= ``owed_ns``)."""
    interval = every or min(config.explore_steps, config.first_explore_steps << (decisions - 1))
    paid = 0
    while paid * step_ns * config.explore_budget < owed_ns:
        paid += 1
    return max(interval, paid)


def steady_runs(
    config: PolicyConfig, spec: Cost, plain: Cost, steps: int
) -> list[tuple[bool, int]]:
    """The runs of a new bucket whose every step costs ``spec`` speculating and ``plain`` at
    K=0: speculation is measured first, then K=0 (a window each); the faster mode (speculation
    only by ``margin``) then runs, and the other is measured again for one window at the
    re-check ``recheck_after`` gives for what the slower mode's window lost; the first
    ``steps`` steps."""
    best = rate(spec) > rate(plain) * config.margin
    lost = window_loss(config, plain, spec) if best else window_loss(config, spec, plain)
    step_ns = (spec if best else plain)[1]
    out = [(True, window(config)), (False, window(config))]
    decisions = 1
    while sum(n for _, n in out) < steps:
        ran = recheck_after(config, lost, step_ns, decisions)
        if out[-1][0] is best:
            out[-1] = (best, out[-1][1] + ran)
        else:
            out.append((best, ran))
        out.append((not best, window(config)))
        decisions += 1
    cut, total = [], 0
    for mode, n in out:  # the first ``steps`` steps
        cut.append((mode, min(n, steps - total)))
        total += cut[-1][1]
        if total == steps:
            return cut
    return cut


def drive(
    policy: SpecPolicy, batch_size: int, steps: int, cost: Callable[[int, bool], Cost]
) -> list[bool]:
    """``steps`` steps of one bucket, ``cost(step, speculated)`` each: the modes it chose."""
    modes = []
    for step in range(steps):
        on = policy.speculate(batch_size)
        modes.append(on)
        policy.record(batch_size, *cost(step, on))
    return modes


def decide(policy: SpecPolicy, batch_size: int, spec: Cost, plain: Cost) -> _Bucket:
    """Steps a bucket (``spec`` or ``plain`` tokens and ns a step) until its first decision."""
    while not (policy._buckets.get(batch_size) and policy._buckets[batch_size].decisions):
        on = policy.speculate(batch_size)
        policy.record(batch_size, *(spec if on else plain))
    return policy._buckets[batch_size]
