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

A draw is a function of the request's prompt and the step's position (the KV index of node 0),
not of a random stream: ``k = #{j : u < P(k >= j)}`` with ``u`` a 64-bit hash of the two
(splitmix64's finaliser, ``unit``; ``unit_tensor`` computes the same bits on a device). A
request therefore accepts the same drafts at the same positions whichever path verified it
(the ordinary step on the host, a device-chain step on the device), in process or through the
services, at any batch size and beside any other requests, so two modes of one benchmark
compare their costs on the same acceptance rather than on two samples of it.

The committed tokens are then the draft's, not the target's: the output is NOT the target's
output and must never reach a user. That is why only ``tandem bench --simulate-accept-length``
and the target service's environment variable ``TANDEM_SIMULATE_ACCEPT_LENGTH`` (documented as
perf-only; the service logs a warning) turn it on; nothing else in the serving path can.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tandem.spec.types import Tree

if TYPE_CHECKING:
    from tandem.request import Request

ENV_VAR = "TANDEM_SIMULATE_ACCEPT_LENGTH"


class AcceptSimulator:
    """Draws accepted paths whose mean accept length (bonus included) is ``accept_length`` for
    trees at least ``num_steps`` deep. A draw depends on ``seed``, the request's prompt and the
    position only."""

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
        self.seed = seed
        self.mu = _solve_mean(accept_length - 1.0, num_steps)
        # P(k >= j) for j = 1..S, decreasing: k = #{j : u < thresholds[j - 1]}.
        self.thresholds = [_at_least(j, self.mu) for j in range(1, num_steps + 1)]
        self._keys: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def key(self, req: Request) -> int:
        """The request's key: its prompt's (and the seed's) hash, as a signed int64."""
        key = self._keys.get(req)
        if key is None:
            key = self._keys[req] = prompt_key(req.prompt_ids, self.seed)
        return key

    def draw(self, key: int, position: int) -> int:
        """Accepted drafts, in [0, S], for the request of ``key`` verifying at ``position``."""
        u = unit(key, position)
        return sum(1 for t in self.thresholds if u < t)

    def path(self, tree: Tree, key: int, position: int) -> list[int]:
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
        for _ in range(self.draw(key, position)):
            child = best.get(nodes[-1])
            if child is None:
                break
            nodes.append(child)
        return nodes

    def paths(self, trees: Sequence[Tree], reqs: Sequence[Request]) -> list[list[int]]:
        """Each request's path through its tree, drawn at its node 0's KV index."""
        return [
            self.path(tree, self.key(req), req.num_computed)
            for tree, req in zip(trees, reqs, strict=True)
        ]


_MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def prompt_key(prompt_ids: Sequence[int], seed: int = 0) -> int:
    """A prompt's 64-bit hash (with ``seed``), as a signed int64."""
    digest = hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=8, salt=b"%d" % seed)
    return int.from_bytes(digest.digest(), "little", signed=True)


def unit(key: int, position: int) -> float:
    """A uniform draw in [0, 1) from ``key`` and ``position``: splitmix64's finaliser of
    ``key + position * golden`` (mod 2^64), its top 53 bits."""
    x = (key + position * _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK
    x ^= x >> 31
    return (x >> 11) * 2.0**-53


def unit_tensor(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``unit`` of every ``keys[i]``, ``positions[i]`` (int64, any device), float64: the same
    bits, in int64 arithmetic that wraps as the unsigned one does (shifts made logical)."""
    x = keys + positions * _signed(_GOLDEN)
    x = (x ^ _shift(x, 30)) * _signed(_MIX1)
    x = (x ^ _shift(x, 27)) * _signed(_MIX2)
    x = x ^ _shift(x, 31)
    return _shift(x, 11).double() * 2.0**-53


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 ``x``."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def _at_least(j: int, mu: float) -> float:
    """P(clamp(round(X), 0, S) >= j) = P(X >= j - 0.5) for X ~ N(mu, 1), 1 <= j <= S."""
    if mu == -math.inf or mu == math.inf:
        return 0.0 if mu < 0 else 1.0
    return 0.5 * math.erfc((j - 0.5 - mu) / math.sqrt(2.0))


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
    """E[clamp(round(X), 0, S)] for X ~ N(mu, 1): the sum over j = 1..S of P(k >= j)."""
    return sum(_at_least(j, mu) for j in range(1, num_steps + 1))


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
