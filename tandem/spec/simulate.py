"""Simulated acceptance, for performance measurement only (SGLang's SIMULATE_ACC_LEN).

With a mean accept length A, every verification accepts a drawn number of drafts instead of
checking them: k ~ clamp(round(N(mu, 1)), 0, S) per request and step, with mu solved so that
E[k] + 1 = A exactly despite the rounding and the clamp. The accepted path goes k deep from
node 0 (a chain's first k drafts), at each node into the child with the deepest subtree, the
first such child on a tie (the draft's best): a tree's first children alone may run out
before depth k where its deeper branches do not, and the drawn depth is what A promises. It
is shorter only where the whole tree is shallower. The bonus is the target's argmax after the
path. The verification itself still
runs, so its cost is measured, but its verdict is overridden.

The committed tokens are then the draft's, not the target's: the output is NOT the target's
output and must never reach a user. That is why only ``tandem bench --simulate-accept-length``
and the target service's environment variable ``TANDEM_SIMULATE_ACCEPT_LENGTH`` (documented as
perf-only; the service logs a warning) turn it on; nothing else in the serving path can.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from tandem.spec.types import Tree

ENV_VAR = "TANDEM_SIMULATE_ACCEPT_LENGTH"


class AcceptSimulator:
    """Draws accepted paths whose mean accept length (bonus included) is ``accept_length`` for
    trees at least ``num_steps`` deep. Deterministic for a given ``seed``."""

    def __init__(self, accept_length: float, num_steps: int, *, seed: int = 0) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
        if not 1.0 <= accept_length <= num_steps + 1:
            raise ValueError(
                f"simulate_accept_length: must be in [1, S+1] = [1, {num_steps + 1}], "
                f"got {accept_length}"
            )
        self.accept_length = accept_length
        self.num_steps = num_steps
        self.mu = _solve_mean(accept_length - 1.0, num_steps)
        self._rng = random.Random(seed)

    def draw(self) -> int:
        """Accepted drafts for one request and step, in [0, S]."""
        if self.mu == -math.inf or self.mu == math.inf:
            return 0 if self.mu < 0 else self.num_steps
        k = math.floor(self._rng.gauss(self.mu, 1.0) + 0.5)
        return min(max(k, 0), self.num_steps)

    def path(self, tree: Tree) -> list[int]:
        """The forced accepted path: node 0, then at each node the child with the deepest
        subtree (the first on a tie), ``draw()`` deep at most."""
        height = [0] * len(tree)  # of each node's subtree; children follow their parents
        best: dict[int, int] = {}
        for node in range(len(tree) - 1, 0, -1):  # descending: a node's children come first
            parent = tree.parents[node]
            if height[node] + 1 >= height[parent]:  # >=: the smaller index wins a tie
                height[parent] = height[node] + 1
                best[parent] = node
        nodes = [0]
        for _ in range(self.draw()):
            child = best.get(nodes[-1])
            if child is None:
                break
            nodes.append(child)
        return nodes

    def paths(self, trees: Sequence[Tree]) -> list[list[int]]:
        return [self.path(tree) for tree in trees]


def parse_accept_length(raw: str, num_steps: int | None) -> float:
    """The value of ``TANDEM_SIMULATE_ACCEPT_LENGTH`` for a target drafting ``num_steps`` deep
    (None: no draft); ValueError names the variable."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_VAR}: {raw!r} is not a number") from None
    if num_steps is None:
        raise ValueError(f"{ENV_VAR}: simulated acceptance needs a draft (--draft-addr)")
    if not 1.0 <= value <= num_steps + 1:
        raise ValueError(f"{ENV_VAR}: must be in [1, S+1] = [1, {num_steps + 1}], got {value}")
    return value


def expected_accepted(mu: float, num_steps: int) -> float:
    """E[clamp(round(X), 0, S)] for X ~ N(mu, 1)."""

    def cdf(x: float) -> float:
        return 0.5 * (1.0 + math.erf((x - mu) / math.sqrt(2.0)))

    # E[k] = sum_{j=1..S} P(k >= j), and P(k >= j) = P(X >= j - 0.5) for 1 <= j <= S.
    return sum(1.0 - cdf(j - 0.5) for j in range(1, num_steps + 1))


def _solve_mean(target: float, num_steps: int) -> float:
    """The mu whose clamped, rounded normal has mean ``target`` (monotone in mu: bisection)."""
    if target <= 0.0:
        return -math.inf
    if target >= num_steps:
        return math.inf
    lo, hi = -num_steps - 10.0, 2.0 * num_steps + 10.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if expected_accepted(mid, num_steps) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
