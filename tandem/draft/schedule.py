"""The chain schedule of the draft loop's graphs (``graphs.py``): which pairs each step runs.

Step 0 reads module 0's last committed output; step ``s >= 1`` runs module ``m = min(s, M-1)``
over the chain nodes it has not drafted yet (depths ``1..s`` on its first step, else ``s``),
each pair fed its hidden by the host path's rule (``trees.py``): the parent's output of the
same module, or for a chained MTP head at depth ``d <= m`` head ``m-1``'s output at depth
``d-1``; depth 0 stands for a module's last committed output.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.graphs.base import WORD_BITS
from tandem.spec.types import SpecConfig


@dataclass(frozen=True)
class ChainStep:
    module: int
    depths: tuple[int, ...]  # depths of its pairs, consecutive
    prev: int  # scratch entries the module holds before this step
    sources: tuple[tuple[int, int], ...]  # per pair: (module, depth) of its hidden input


@dataclass(frozen=True)
class ChainSchedule:
    steps: tuple[ChainStep, ...]  # steps 1..S-1
    totals: tuple[int, ...]  # scratch entries per module over the whole loop
    roots: tuple[int, ...]  # modules whose last committed output the loop reads

    @property
    def num_words(self) -> int:
        widest = max((s.prev + len(s.depths) for s in self.steps), default=1)
        return -(-widest // WORD_BITS)


def chain_schedule(num_steps: int, num_modules: int, mode: str) -> ChainSchedule:
    counts = [0] * num_modules
    steps = []
    roots = {0}
    for s in range(1, num_steps):
        m = min(s, num_modules - 1)
        depths = tuple(range(1, s + 1)) if counts[m] == 0 else (s,)
        sources = []
        for d in depths:
            k = m - 1 if mode == "chain" and m >= 1 and d <= m else m
            sources.append((k, d - 1))
            if d == 1:
                roots.add(k)
        steps.append(ChainStep(m, depths, counts[m], tuple(sources)))
        counts[m] += len(depths)
    return ChainSchedule(tuple(steps), tuple(counts), tuple(sorted(roots)))


@dataclass(frozen=True, order=True)
class TreeShape:
    """What a tree loop's graph is captured for: K candidates a step, S steps, N nodes."""

    topk: int
    num_steps: int
    tree_size: int

    @classmethod
    def of(cls, spec: SpecConfig) -> TreeShape:
        return cls(spec.topk, spec.num_steps, spec.tree_size)

    @property
    def num_words(self) -> int:
        return max(1, -(-(self.num_steps - 1) * self.topk // WORD_BITS))

    def schedule(self) -> ChainSchedule:
        """The scratch entries and positions of the loop, as ``plan_loop`` checks them: step
        ``s`` runs K nodes of depth ``s`` after ``(s-1)K`` earlier entries."""
        k = self.topk
        steps = tuple(
            ChainStep(0, (s,), (s - 1) * k, ((0, s - 1),)) for s in range(1, self.num_steps)
        )
        return ChainSchedule(steps, ((self.num_steps - 1) * k,), (0,))
