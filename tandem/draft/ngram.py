"""Prompt-lookup drafting (kind ``ngram``): no model, proposals copied from the context.

The longest suffix of the committed tokens (``max_ngram`` down to ``min_ngram`` tokens) that
occurred earlier is looked up; the tokens that followed each earlier occurrence, most recent
first, become branches. With K=1 that is one chain of S tokens; with K>1 up to K continuations
are merged into a trie (distinct siblings) and cut to N nodes breadth-first.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.spec.base import Drafter
from tandem.spec.types import DraftAdmit, SpecConfig, Tree, VerifyOutcome


class NgramDrafter(Drafter):
    def __init__(self, *, min_ngram: int = 1, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"min_ngram: need 1 <= min_ngram <= max_ngram, got {min_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.seqs: dict[str, tuple[SpecConfig, list[int]]] = {}

    def num_tracked(self) -> int:
        return len(self.seqs)

    def step(
        self,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> dict[str, Tree]:
        for request_id in released:
            self.seqs.pop(request_id, None)
        updated = []
        for admit in admits:
            self.seqs[admit.request_id] = (admit.spec, list(admit.token_ids))
            updated.append(admit.request_id)
        for outcome in outcomes:
            if outcome.request_id in self.seqs:
                tokens = self.seqs[outcome.request_id][1]
                tokens += [*outcome.accepted_token_ids, outcome.bonus_token_id]
                updated.append(outcome.request_id)
        return {r: self._tree(*self.seqs[r]) for r in updated}

    def _tree(self, spec: SpecConfig, tokens: list[int]) -> Tree:
        branches = self._continuations(tokens, spec.num_steps, spec.topk)
        node_tokens, parents = [tokens[-1]], [-1]
        children: dict[tuple[int, int], int] = {}
        frontier = [(0, branch) for branch in branches]
        # Breadth-first over the trie, so cutting at N keeps every kept node's parent.
        for depth in range(spec.num_steps):
            next_frontier = []
            for parent, branch in frontier:
                if depth >= len(branch) or len(node_tokens) >= spec.tree_size:
                    continue
                key = (parent, branch[depth])
                if key not in children:
                    children[key] = len(node_tokens)
                    node_tokens.append(branch[depth])
                    parents.append(parent)
                next_frontier.append((children[key], branch))
            frontier = next_frontier
        return Tree(tokens=tuple(node_tokens), parents=tuple(parents))

    def _continuations(self, tokens: list[int], length: int, count: int) -> list[list[int]]:
        """Up to ``count`` distinct continuations of the longest earlier-seen suffix."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            found: list[list[int]] = []
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + length]
                    if follow and follow not in found:
                        found.append(follow)
                        if len(found) == count:
                            break
            if found:
                return found
        return []
