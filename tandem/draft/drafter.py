"""Draft side of the cycle: the model-based drafter (the interface is ``tandem/spec/base.py``).

One call per step mirrors the wire (``draft.proto``): the target hands over new requests,
the outcomes of its last verification and released ids; the drafter extends its own paged KV
with the committed tokens and answers with the next tree of every request it tracks.

``ModelDrafter`` runs one or more :class:`DraftModule` s. EAGLE-3, EAGLE-1 and a standalone LM
are one module; MTP is one module per head. Module ``m`` expands the nodes at depth
``min(d, M-1)``; head ``m`` consumes token ``t_j`` at position ``j - 1 - m`` with, as hidden,
the target feature of that position (``target`` mode) or head ``m-1``'s output there
(``chain`` mode); past the last head, and always for EAGLE, a module feeds on its own output at
the parent. Every module keeps the committed pairs in its KV.

What it works on is a ``ModelDraftState`` (``state.py``) that it hands to the code that
drafts: the host path (``extend.py``, ``trees.py``) and, with graphs enabled
(``enable_graphs``), the graph runner (``graphs.py``), through which chains (K=1) draft all S
steps in one CUDA graph per batch bucket, trees of a one-module draft likewise with EAGLE-2
selection on the device (``tree_graphs.py``), and committed pairs extend through one graph per
bucket; what no bucket takes runs on the host path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tandem.attention import backend_for
from tandem.draft.chain_draft import DraftChain
from tandem.draft.extend import extend_eagerly
from tandem.draft.graphs import DraftGraphRunner
from tandem.draft.schedule import TreeShape
from tandem.draft.state import DraftSeq, ModelDraftState, Update
from tandem.draft.trees import draft_eagerly
from tandem.errors import KVExhausted
from tandem.kv import KVCache
from tandem.models.draft import DraftModule
from tandem.spec.base import Drafter
from tandem.spec.types import DraftAdmit, SpecConfig, Tree, VerifyOutcome

logger = logging.getLogger(__name__)


class ModelDrafter(Drafter):
    def __init__(
        self,
        modules: Sequence[DraftModule],
        kvs: Sequence[KVCache],
        *,
        target_layer_ids: tuple[int, ...],
        mode: str = "chain",
        device: torch.device | str = "cpu",
        fast_top1: bool = True,
    ) -> None:
        self.state = ModelDraftState(
            modules=list(modules),
            kvs=list(kvs),
            target_layer_ids=target_layer_ids,
            mode=mode,
            device=torch.device(device),
            backend=backend_for(device),
            fast_top1=fast_top1,
        )
        self.target_layer_ids = target_layer_ids
        self._dropped: list[str] = []
        self.graphs: DraftGraphRunner | None = None

    @property
    def modules(self) -> list[DraftModule]:
        return self.state.modules

    @property
    def kvs(self) -> list[KVCache]:
        return self.state.kvs

    @property
    def seqs(self) -> dict[str, DraftSeq]:
        return self.state.seqs

    @property
    def model_ns(self) -> int:
        return self.state.model_ns

    @model_ns.setter
    def model_ns(self, value: int) -> None:
        self.state.model_ns = value

    def vocab_size(self) -> int:
        """The draft's own vocabulary (module 0's logits)."""
        return self.state.modules[0].vocab_size

    def kv_pages(self) -> tuple[int, int]:
        """KV pages in use and in total, over every module's pool."""
        return self.state.kv_pages()

    def enable_graphs(
        self,
        *,
        batch_sizes: Sequence[int],
        max_model_len: int,
        num_steps: Sequence[int] = (),
        tree_shapes: Sequence[TreeShape] = (),
        capture: bool = True,
    ) -> DraftGraphRunner:
        """Runs chains, trees (one-module drafts) and extends that fit a bucket through CUDA
        graphs, captured now for each S in ``num_steps`` and each tree shape in
        ``tree_shapes``, on first use for any other (``capture=False``: the same static
        buffers run eagerly, on any device; Triton interpreted on CPU)."""
        from tandem.attention.triton_backend import TritonAttention  # imports triton

        backend = self.state.backend
        attention = backend if isinstance(backend, TritonAttention) else None
        self.graphs = DraftGraphRunner(
            self.state,
            batch_sizes=batch_sizes,
            max_model_len=max_model_len,
            num_steps=num_steps,
            tree_shapes=tree_shapes if len(self.state.modules) == 1 else (),
            capture=capture,
            attention=attention,
        )
        return self.graphs

    def use_graphs(
        self,
        *,
        batch_sizes: Sequence[int],
        max_model_len: int,
        num_steps: Sequence[int] = (),
        trees: Sequence[SpecConfig] = (),
        capture: bool = True,
    ) -> bool:
        if not DraftGraphRunner.supports(self.state):
            logger.info("draft graphs: not available for target-mode MTP; drafting eagerly")
            return False
        self.enable_graphs(
            batch_sizes=batch_sizes,
            max_model_len=max_model_len,
            num_steps=num_steps,
            tree_shapes=[TreeShape.of(spec) for spec in trees if spec.topk > 1],
            capture=capture,
        )
        return True

    def chain_problem(self) -> str:
        if self.graphs is None:
            return super().chain_problem()
        if len(self.state.modules) != 1:
            return "needs a one-module draft (EAGLE-3, EAGLE, a standalone LM)"
        return ""

    def chain_half(self, num_steps: int, device: torch.device) -> DraftChain:
        problem = self.chain_problem()
        if problem:
            raise ValueError(f"device chain: {problem}")
        assert self.graphs is not None
        return DraftChain(self.state, self.graphs, num_steps)

    def num_tracked(self) -> int:
        return len(self.state.seqs)

    def take_dropped(self) -> list[str]:
        dropped, self._dropped = self._dropped, []
        return dropped

    @torch.inference_mode()
    def step(
        self,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> dict[str, Tree]:
        state = self.state
        for request_id in released:
            state.release(request_id)
        updates: list[Update] = []
        for admit in admits:
            state.admit(admit.request_id, admit.spec)
            updates.append((admit.request_id, admit.token_ids, admit.features))
        for outcome in outcomes:
            if outcome.request_id in state.seqs:
                new = [*outcome.accepted_token_ids, outcome.bonus_token_id]
                updates.append((outcome.request_id, new, outcome.features))
        ids = [request_id for request_id, _, _ in updates]
        try:
            self._extend(updates)
        except KVExhausted:
            logger.warning("draft KV pool is full: dropping %d requests", len(ids))
            for request_id in ids:
                state.release(request_id)
            self._dropped += ids
            return {}
        return self._draft(ids)

    def release(self, request_id: str) -> None:
        """Forgets ``request_id`` and frees its KV (unknown ids are ignored)."""
        self.state.release(request_id)

    def _extend(self, updates: list[Update]) -> None:
        """Appends committed tokens (and their features) and runs every module over the pairs
        that became complete: through the graph buckets, the rest on the host."""
        state = self.state
        starts = state.append(updates)
        rest = updates if self.graphs is None else self.graphs.extend(updates, starts)
        if rest:
            extend_eagerly(state, rest, starts)
        for request_id, _, _ in updates:
            state.trim_features(state.seqs[request_id])

    def _draft(self, request_ids: list[str]) -> dict[str, Tree]:
        """Next trees: a chain batch that fits a graph bucket drafts there, anything else on
        the host (``trees.py``)."""
        if self.graphs is not None:
            trees = self.graphs.draft(request_ids)
            if trees is not None:
                return trees
        return draft_eagerly(self.state, request_ids)
