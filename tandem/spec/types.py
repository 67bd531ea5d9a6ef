"""The speculative cycle's vocabulary as data: settings, trees, and what crosses between target
and draft (docs/design.md section 3; the in-process twin of ``draft.proto``)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

from tandem.errors import InvalidRequest
from tandem.settings import setting

if TYPE_CHECKING:  # the command lines read SpecConfig without loading torch
    import torch

# The draft kinds every service knows (docs/design.md, "The speculative cycle"), and the two ways
# an MTP draft feeds its heads.
DRAFT_KINDS = ("eagle3", "eagle", "mtp", "model", "ngram")
MTP_MODES = ("chain", "target")


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """S draft steps, top-K per step, N tree nodes (node 0 included). K=1 is a chain, N=S+1."""

    num_steps: int = setting(
        3, help="S: draft steps per cycle", env="SPEC_STEPS", flag="spec-steps"
    )
    topk: int = setting(
        1, help="K: candidates per draft step (1 = a chain)", env="SPEC_TOPK", flag="spec-topk"
    )
    num_draft_tokens: int | None = setting(
        None,
        help="N: tree nodes, the verified token included",
        env="SPEC_TOKENS",
        flag="spec-tokens",
        shown_default="S+1",
    )

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise InvalidRequest("num_steps", f"must be >= 1, got {self.num_steps}")
        if self.topk < 1:
            raise InvalidRequest("topk", f"must be >= 1, got {self.topk}")
        n = self.tree_size
        if self.topk == 1 and n != self.num_steps + 1:
            raise InvalidRequest("num_draft_tokens", f"K=1 is a chain: N must be S+1, got {n}")
        if not 2 <= n <= 1 + self.pool_size:
            raise InvalidRequest(
                "num_draft_tokens",
                f"must be in [2, {1 + self.pool_size}] for S={self.num_steps}, K={self.topk}; "
                f"got {n}",
            )

    @cached_property
    def tree_size(self) -> int:
        """N, node 0 included."""
        return self.num_draft_tokens or self.num_steps + 1

    @cached_property
    def pool_size(self) -> int:
        """Candidates EAGLE-2 selection chooses from: K at step 0, then K*K per later step."""
        return self.topk + (self.num_steps - 1) * self.topk**2


def valid_depth(valid: Sequence[bool | float]) -> int:
    """A drafted chain's usable depth: its drafts before the first invalid one (a step whose
    logits were NaN/inf ends the chain there)."""
    return next((k for k, ok in enumerate(valid) if not ok), len(valid))


@dataclass(frozen=True)
class Tree:
    """A draft tree: node 0 is the verified token; ``parents[i] < i`` for i > 0."""

    tokens: tuple[int, ...]  # [N] target-vocabulary ids
    parents: tuple[int, ...]  # [N], parents[0] == -1

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> Tree:
        """A chain (K=1): node i's parent is node i-1."""
        return cls(tokens=tuple(tokens), parents=(-1, *range(len(tokens) - 1)))

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.parents) - 1))

    def ancestor_mask(self) -> torch.Tensor:  # [N, N] bool
        """Row i marks node i and its ancestors: what node i attends to within the tree."""
        n = len(self.tokens)
        import torch

        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            if i:
                mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask

    def prefix(self, num_nodes: int) -> Tree:
        """The first ``num_nodes`` nodes: still a tree, since parents precede children."""
        if num_nodes >= len(self.tokens):
            return self
        return Tree(tokens=self.tokens[:num_nodes], parents=self.parents[:num_nodes])

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depth = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            depth[i] = depth[self.parents[i]] + 1
        return tuple(depth)

    def check(self, *, vocab_size: int, max_nodes: int, verified_token: int) -> str | None:
        """Why this tree must not be verified, or None. Run on every tree that crosses the
        draft/target boundary: an id out of range or a malformed tree is rejected there."""
        n = len(self.tokens)
        if not 1 <= n <= max_nodes or len(self.parents) != n:
            return f"size {n} (parents {len(self.parents)}) outside [1, {max_nodes}]"
        if self.tokens[0] != verified_token or self.parents[0] != -1:
            return "node 0 is not the verified token"
        siblings: set[tuple[int, int]] = set()
        for i in range(1, n):
            token, parent = self.tokens[i], self.parents[i]
            if not 0 <= token < vocab_size:
                return f"node {i}: token id {token} outside [0, {vocab_size})"
            if not 0 <= parent < i:
                return f"node {i}: parent {parent} outside [0, {i})"
            if (parent, token) in siblings:
                return f"node {i}: repeats a sibling's token {token}"
            siblings.add((parent, token))
        return None


@dataclass(kw_only=True)
class DraftAdmit:
    """A request the draft starts tracking: every committed token so far (the last one is the
    verified token) and the target features of all positions but the last."""

    request_id: str
    token_ids: list[int]  # [L] committed tokens, t_{L-1} = the verified token
    features: torch.Tensor | None  # [L-1, F] target features; None for drafts that need none
    spec: SpecConfig
    temperature: float = 0.0
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C carrier of its span

    def then(self, outcome: VerifyOutcome) -> DraftAdmit:
        """The admit of the tokens after ``outcome`` too (features [len(token_ids) - 1, F]):
        what the draft holds once it applied both."""
        features = self.features
        if features is not None and outcome.features is not None:
            import torch

            features = torch.cat([features, outcome.features.to(features.device, features.dtype)])
        tokens = [*self.token_ids, *outcome.accepted_token_ids, outcome.bonus_token_id]
        return replace(self, token_ids=tokens, features=features)


@dataclass(kw_only=True)
class VerifyOutcome:
    """What one verification committed for one request."""

    request_id: str
    accepted_token_ids: list[int]  # accepted drafts, path order (node 0 and bonus excluded)
    bonus_token_id: int  # the new verified token
    features: torch.Tensor | None  # [len(accepted) + 1, F]: node 0 and the accepted nodes


class NoTree(enum.StrEnum):
    """Why a decode step verified no draft token (the values name the counters)."""

    POLICY = "policy"  # the adaptive policy chose plain decoding (K=0) for the step
    LATE = "late"  # the draft's answer missed its deadline, or a late one was still due
    # The answer was drafted for an older state: the request moved lanes, the draft was catching
    # up after K=0, or the tree was rejected.
    STALE = "stale"
    NOT_IN_DRAFT = "not_in_draft"  # the draft did not track it (lost, not taken in again yet)
    OPTED_OUT = "opted_out"  # the request does not speculate
    # No room for drafts: the step's token budget, the KV pool, or the request's length limit.
    CAPACITY = "capacity"


@dataclass
class SpecStats:
    """Acceptance statistics of one request (vLLM-style counters)."""

    verify_steps: int = 0  # target forwards that committed tokens for this request
    drafts: int = 0  # of which verified a tree with at least one draft node
    draft_tokens: int = 0  # draft nodes proposed (N - 1 per drafted step)
    accepted_tokens: int = 0  # draft nodes accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [depth - 1] -> count
    accept_lengths: list[int] = field(default_factory=list)  # per verify step, bonus included
    without_tree: dict[NoTree, int] = field(default_factory=dict)  # decode steps, by cause

    def record(
        self, num_draft_nodes: int, num_accepted: int, missed: NoTree = NoTree.STALE
    ) -> None:
        """One verify step; ``missed``: why it verified no draft token, if it did not."""
        self.verify_steps += 1
        self.accept_lengths.append(num_accepted + 1)
        if num_draft_nodes:
            self.drafts += 1
        else:
            self.without_tree[missed] = self.without_tree.get(missed, 0) + 1
        self.draft_tokens += num_draft_nodes
        self.accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position.append(0)
        for depth in range(num_accepted):
            self.accepted_per_position[depth] += 1

    @property
    def accept_length(self) -> float:
        """Mean tokens committed per verify step (accepted drafts + the bonus)."""
        if not self.verify_steps:
            return 0.0
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps


@dataclass
class StepCounts:
    """Decode steps of all requests since a start (a server's lifetime): those that verified a
    draft token, and the others by cause."""

    verify_steps: int = 0
    drafted_steps: int = 0
    without_tree: dict[NoTree, int] = field(default_factory=dict)

    def add(self, stats: SpecStats) -> None:
        self.verify_steps += stats.verify_steps
        self.drafted_steps += stats.drafts
        for cause, n in stats.without_tree.items():
            self.without_tree[cause] = self.without_tree.get(cause, 0) + n
