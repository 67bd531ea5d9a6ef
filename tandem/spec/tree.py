"""EAGLE-2 tree building: a per-request pool of candidates scored by cumulative log-probability.

Step 0 adds the K best children of node 0. Each later step expands the K best nodes of the
previous step (the frontier) by their K best children each and keeps every one of those K*K
candidates in the pool; the next frontier is the K best of them. The tree is node 0 plus the
N-1 best pool entries. Scores never increase along a path (log-probabilities are <= 0) and ties
go to the lower pool index, which a parent always has, so the chosen set is ancestor-closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.spec.types import Tree


@dataclass
class CandidatePool:
    """Candidates of one request's tree, in the order they were drafted."""

    verified_token: int
    tokens: list[int] = field(default_factory=list)  # target-vocabulary ids
    parents: list[int] = field(default_factory=list)  # pool index of the parent, -1 = node 0
    scores: list[float] = field(default_factory=list)  # cumulative log-probability
    depths: list[int] = field(default_factory=list)  # edges from node 0 (>= 1)
    frontier: list[int] = field(default_factory=list)  # pool indices expanded next step
    stopped: bool = False  # drafting ended early (invalid logits, no room, no context)

    def add_children(self, parent: int, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Adds candidates under pool entry ``parent`` (-1 = node 0); returns their indices."""
        base = self.scores[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        first = len(self.tokens)
        for token, logprob in zip(tokens, logprobs, strict=True):
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(base + logprob)
            self.depths.append(depth)
        return list(range(first, len(self.tokens)))

    def select_frontier(self, candidates: list[int], k: int) -> None:
        """The next frontier: the ``k`` best of ``candidates`` (ties to the lower index)."""
        self.frontier = _best(candidates, self.scores, k)

    def path(self, index: int) -> list[int]:
        """Pool indices from depth 1 down to ``index``."""
        out = []
        while index >= 0:
            out.append(index)
            index = self.parents[index]
        return out[::-1]

    def to_tree(self, num_nodes: int) -> Tree:
        """Node 0 plus the ``num_nodes - 1`` best candidates, parents before children."""
        chosen = sorted(_best(range(len(self.tokens)), self.scores, num_nodes - 1))
        node_of = {pool_index: node for node, pool_index in enumerate(chosen, start=1)}
        tokens = [self.verified_token]
        parents = [-1]
        for pool_index in chosen:
            parent = self.parents[pool_index]
            if parent >= 0 and parent not in node_of:
                raise AssertionError("EAGLE-2 selection produced a tree that is not closed")
            tokens.append(self.tokens[pool_index])
            parents.append(node_of[parent] if parent >= 0 else 0)
        return Tree(tokens=tuple(tokens), parents=tuple(parents))


def _best(indices: range | list[int], scores: list[float], k: int) -> list[int]:
    """The ``k`` highest-scoring indices; a stable sort keeps the lower index first on ties."""
    return sorted(indices, key=lambda i: -scores[i])[:k]


def scratch_mask(
    scratch: dict[int, tuple[int, torch.Tensor]],  # node -> (KV index, output), drafted so far
    new_nodes: list[int | None],  # the nodes of the entries appended now, in order
    pool: CandidatePool,
) -> torch.Tensor:  # [len(new_nodes), len(scratch) + len(new_nodes)] bool
    """Exact tree attention for draft scratch entries: each new entry sees the entries of its
    ancestors and itself, in KV order (earlier scratch entries, then the new ones)."""
    order = sorted(scratch, key=lambda node: scratch[node][0]) + list(new_nodes)
    column = {node: c for c, node in enumerate(order)}
    mask = torch.zeros(len(new_nodes), len(order), dtype=torch.bool)
    for r, node in enumerate(new_nodes):
        assert node is not None
        for ancestor in pool.path(node):
            if ancestor in column:
                mask[r, column[ancestor]] = True
    return mask


def softmax_topk(
    logits: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [R, k], [R, k], [R]
    """The materialised-softmax path (softmax, then topk over probabilities): the oracle the
    fused top-1 path is checked against in the drafter."""
    x = logits.float()
    valid = ~(x.isnan() | x.isposinf()).any(dim=-1) & (x.amax(dim=-1) > float("-inf"))
    probs = torch.softmax(x.masked_fill(~valid[:, None], 0.0), dim=-1)
    top = torch.topk(probs, k, dim=-1)
    return top.indices, top.values.log(), valid
