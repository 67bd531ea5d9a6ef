"""What a model drafter works on: its draft modules, their paged KV caches and the sequence it
keeps per request, as one object (``ModelDraftState``) that the drafter owns and hands to the
code that drafts with it: the host path (``extend.py``, ``trees.py``), the graph runner and its
plans and buffers (``graphs.py``, ``plan.py``, ``buffers.py``) and the draft's half of a
device-chain run (``chain_draft.py``). None of them sees the drafter itself.

Bookkeeping lives here too: admitting and releasing a request (a KV entry per module), the
committed tokens and target features an update appends, and which features are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.attention import AttentionBackend
from tandem.kv import KVCache
from tandem.models.draft import DraftModule
from tandem.spec.types import MTP_MODES, SpecConfig

Update = tuple[str, list[int], torch.Tensor | None]  # request id, new tokens, [n, F] features


@dataclass
class DraftSeq:
    """What the drafter keeps per request."""

    spec: SpecConfig
    tokens: list[int]  # committed tokens; the last is the verified token
    features: torch.Tensor | None  # [w, F] target features of positions feature_start...
    feature_start: int
    last_out: list[torch.Tensor | None]  # per module: output of its last committed pair [H_d]
    # Per module, while a tree is drafted: tree node -> (KV index, output [H_d]).
    scratch: list[dict[int, tuple[int, torch.Tensor]]] = field(default_factory=list)


@dataclass(kw_only=True, eq=False)
class ModelDraftState:
    """A model drafter's modules, KV caches and per-request sequences (module docstring).

    Module ``m`` keeps its committed pairs in ``kvs[m]``. ``mode`` says where MTP head ``m``
    takes the hidden of the pairs it shares with the target's positions: head ``m-1``'s
    output there (``chain``) or the target feature of that position (``target``).
    """

    modules: list[DraftModule]
    kvs: list[KVCache]  # one per module
    target_layer_ids: tuple[int, ...]  # the target features module 0 projects
    mode: str  # one of MTP_MODES
    device: torch.device
    backend: AttentionBackend
    # K=1 takes argmax and its exact probability from one pass over the logits (top1);
    # False takes the softmax + topk path instead (kept to show both give the same trees).
    fast_top1: bool = True
    seqs: dict[str, DraftSeq] = field(default_factory=dict)
    model_ns: int = 0  # host clock spent in draft model compute (forwards, logits, top-k)

    def __post_init__(self) -> None:
        if not self.modules or len(self.modules) != len(self.kvs):
            raise ValueError("modules: one KV cache per module expected")
        if self.mode not in MTP_MODES:
            raise ValueError(f"mode: {self.mode!r} is not chain or target")

    def admit(self, request_id: str, spec: SpecConfig) -> None:
        """Starts ``request_id`` over with no tokens (a re-admission drops what it had)."""
        self.release(request_id)
        self.seqs[request_id] = DraftSeq(
            spec=spec,
            tokens=[],
            features=None,
            feature_start=0,
            last_out=[None] * len(self.modules),
        )
        for kv in self.kvs:
            kv.allocator.allocate(request_id, 0)

    def release(self, request_id: str) -> None:
        """Forgets ``request_id`` and frees its KV (unknown ids are ignored)."""
        if self.seqs.pop(request_id, None) is not None:
            for kv in self.kvs:
                kv.allocator.free(request_id)

    def append(self, updates: Sequence[Update]) -> dict[str, int]:
        """Appends each update's committed tokens and features; returns where each request's
        new tokens start (its token count before them)."""
        starts: dict[str, int] = {}
        for request_id, new_tokens, features in updates:
            seq = self.seqs[request_id]
            starts[request_id] = len(seq.tokens)
            seq.tokens.extend(new_tokens)
            if features is not None:
                self._add_features(seq, features)
        return starts

    def _add_features(self, seq: DraftSeq, features: torch.Tensor) -> None:
        features = features.to(self.device)
        if seq.features is None:
            # Features start at the position of the first token of this update minus one.
            seq.feature_start = len(seq.tokens) - 1 - features.shape[0]
            seq.features = features
        else:
            seq.features = torch.cat([seq.features, features])

    def trim_features(self, seq: DraftSeq) -> None:
        """Keeps the last M features: all that target-mode heads can still ask for."""
        if seq.features is None:
            return
        keep = len(self.modules)
        drop = max(0, seq.features.shape[0] - keep)
        seq.features = seq.features[drop:]
        seq.feature_start += drop

    def feature(self, seq: DraftSeq, m: int, position: int) -> torch.Tensor:
        """Module ``m``'s hidden input ([H_d]) from the target feature of ``position``."""
        assert seq.features is not None, "a hidden-consuming draft got no target features"
        row = position - seq.feature_start
        assert 0 <= row < seq.features.shape[0], f"feature {position} is not kept"
        return self.modules[m].project_target(seq.features[row : row + 1])[0]

    def kv_pages(self) -> tuple[int, int]:
        """Pages in use and in total, over every module's pool."""
        total = sum(kv.allocator.num_pages for kv in self.kvs)
        free = sum(kv.allocator.num_free_pages for kv in self.kvs)
        return total - free, total

    def feature_size(self) -> int:
        """Width F of the target features module 0 projects (EAGLE-3: one target hidden per
        layer; EAGLE-1 and MTP: the draft's own hidden size)."""
        module = self.modules[0]
        target_hidden = getattr(module, "target_hidden_size", module.hidden_size)
        return len(self.target_layer_ids) * int(target_hidden)
