"""Model runner: turns a scheduled batch into tensors and runs the target forward.

A request contributes either its next prompt chunk (causal) or its tree: node 0 is the verified
token at position L-1, node i at ``L-1+depth(i)``, stored at KV index ``L-1+i`` and seeing the
prefix plus its ancestors. Plain decoding is a tree of one node. Inputs are built on the host
from numbers the scheduler already has; nothing here reads the device.

With graphs enabled (``enable_graphs``), a step in which every request verifies a tree (no
prompt chunk) is planned into a bucket of ``tandem.target.graphs.TargetGraphRunner`` and replayed
there. With prefill graphs (``enable_prefill_graphs``), a step whose only work is one
request's prompt chunk replays ``tandem.target.prefill_graphs.PrefillGraphRunner``'s graph of its
width. Other steps, and steps no bucket holds, run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from tandem.attention import AttentionMetadata, backend_for
from tandem.kv import KVCache
from tandem.models import DecoderLM, ForwardContext
from tandem.spec.types import Tree
from tandem.target.graphs import GraphBatch, TargetGraphRunner
from tandem.target.prefill_graphs import PrefillBatch, PrefillGraphRunner
from tandem.target.scheduler import ScheduledBatch
from tandem.transfer import device_ints

if TYPE_CHECKING:  # triton is imported when graphs are enabled, never by importing this module
    from tandem.attention.triton_backend import TritonAttention


@dataclass(kw_only=True)
class ModelInputs:
    trees: list[Tree | None]  # per request: what is verified this step (None: a mid-prompt chunk)
    row_starts: list[int]  # per request: its first row in the logits (valid where trees[i] set)
    token_starts: list[int]  # per request: its first token in the flat batch
    # An eager step's device inputs; all None when a graph bucket runs the step (graph set).
    input_ids: torch.Tensor | None = None  # [num_tokens] int64
    positions: torch.Tensor | None = None  # [num_tokens] int64
    meta: AttentionMetadata | None = None
    logits_indices: torch.Tensor | None = None  # [num_rows] int64, flat rows with logits
    graph: GraphBatch | None = None
    prefill: PrefillBatch | None = None  # a prompt chunk alone, run by the prefill graphs
    ahead: bool = (
        False  # a step decoding ahead (tandem/target/ahead.py): nobody waits for its forward
    )


@dataclass
class ModelOutputs:
    logits: torch.Tensor  # [num_rows, vocab] float32
    features: torch.Tensor | None  # [num_tokens, F] captured target features, all tokens


class ModelRunner:
    def __init__(self, model: DecoderLM, kv: KVCache, *, batch_invariant: bool = False) -> None:
        self.model = model
        self.kv = kv
        self.device = kv.spec.device
        self.backend = backend_for(self.device, batch_invariant=batch_invariant)
        self.graphs: TargetGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None

    def enable_graphs(
        self,
        *,
        batch_sizes: Sequence[int],
        widths: Sequence[int],
        max_model_len: int,
        capture_layers: Sequence[int] = (),
        capture: bool = True,
    ) -> TargetGraphRunner:
        """Runs decode/verify steps that fit a bucket through CUDA graphs, captured now
        (``capture=False``: the same static buffers run eagerly, on any device)."""
        self.graphs = TargetGraphRunner(
            self.model,
            self.kv,
            batch_sizes=batch_sizes,
            widths=widths,
            max_model_len=max_model_len,
            attention=self._triton_attention(),
            capture=capture,
        )
        self.graphs.capture(capture_layers)
        return self.graphs

    def enable_prefill_graphs(
        self,
        *,
        widths: Sequence[int],
        max_model_len: int,
        capture_layers: Sequence[int] = (),
        capture: bool = True,
    ) -> PrefillGraphRunner:
        """Runs a prompt chunk alone in its step through the CUDA graph of the smallest of
        ``widths`` that holds it, captured now (``capture=False``: eager static buffers)."""
        self.prefill_graphs = PrefillGraphRunner(
            self.model,
            self.kv,
            widths=widths,
            max_model_len=max_model_len,
            attention=self._triton_attention(),
            capture=capture,
        )
        self.prefill_graphs.capture(capture_layers)
        return self.prefill_graphs

    def _triton_attention(self) -> TritonAttention | None:
        """The eager backend when it is Triton's: graphs take its split policy and batch
        invariance (None on CPU, where the runners build their own for the interpreter)."""
        from tandem.attention.triton_backend import TritonAttention  # imports triton

        return self.backend if isinstance(self.backend, TritonAttention) else None

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        trees: list[Tree | None] = []
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            tree: Tree | None = req.tree
            if tree is None and req.num_computed + n == req.num_tokens:
                tree = Tree(tokens=(req.tokens[-1],), parents=(-1,))
            trees.append(tree)
        # Every request verifies its whole chunk (no prompt chunk): a bucket may run the step.
        news = batch.num_new_tokens
        verified = [t for t, n in zip(trees, news, strict=True) if t is not None and len(t) == n]
        if self.graphs is not None and len(verified) == len(trees):
            graph = self.graphs.plan(
                [req.request_id for req in batch.requests],
                [req.num_computed for req in batch.requests],
                verified,
            )
            if graph is not None:
                starts = [0, *accumulate(news)][:-1]
                return ModelInputs(trees=trees, row_starts=starts, token_starts=starts, graph=graph)
        alone = batch.requests[0] if len(batch.requests) == 1 else None
        if self.prefill_graphs is not None and alone is not None and alone.tree is None:
            start, n = alone.num_computed, batch.num_new_tokens[0]
            chunk = alone.tokens[start : start + n]
            prefill = self.prefill_graphs.plan(
                alone.request_id, start, chunk, last=trees[0] is not None
            )
            if prefill is not None:
                return ModelInputs(trees=trees, row_starts=[0], token_starts=[0], prefill=prefill)
        return self._prepare_eager(batch, trees)

    def prepare_ahead(self, batch: ScheduledBatch, input_ids: torch.Tensor) -> ModelInputs:
        """A step of one-token decodes whose tokens are still on the device (``input_ids``,
        [requests] int64: the last step's choices; ``tandem.target.ahead``). Request ``i`` writes KV
        index and position ``num_computed``, reserved already; its token is never read here."""
        reqs = batch.requests
        n = len(reqs)
        trees: list[Tree | None] = [Tree(tokens=(0,), parents=(-1,)) for _ in reqs]  # ids: device
        starts = list(range(n))
        req_ids = [req.request_id for req in reqs]
        positions = [req.num_computed for req in reqs]
        if self.graphs is not None:
            graph = self.graphs.plan(req_ids, positions, trees)  # type: ignore[arg-type]
            if graph is not None:
                graph.device_ids = input_ids
                return ModelInputs(trees=trees, row_starts=starts, token_starts=starts, graph=graph)
        return self._eager_inputs(
            batch, input_ids, positions, positions, [None] * n, starts, trees, starts, starts
        )

    def _prepare_eager(self, batch: ScheduledBatch, trees: list[Tree | None]) -> ModelInputs:
        ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        masks: list[torch.Tensor | None] = []
        logits_indices: list[int] = []
        row_starts: list[int] = []
        token_starts: list[int] = []
        for req, n, tree in zip(batch.requests, batch.num_new_tokens, trees, strict=True):
            start = req.num_computed
            token_starts.append(len(ids))
            row_starts.append(len(logits_indices))
            if req.tree is not None:
                ids.extend(req.tree.tokens)
                positions.extend(start + d for d in req.tree.depths)
                # A chain's ancestor mask is the causal one: without any custom mask, a prompt
                # chunk in the same step keeps the causal kernel, rather than the masked one
                # over its causal block built and packed on the host (docs/performance.md,
                # "Long prompts").
                masks.append(None if req.tree.is_chain else req.tree.ancestor_mask())
            else:
                ids.extend(req.tokens[start : start + n])
                positions.extend(range(start, start + n))
                masks.append(None)
            starts.append(start)
            if tree is not None:
                first = len(ids) - len(tree)
                logits_indices.extend(range(first, len(ids)))
        return self._eager_inputs(
            batch,
            device_ints(ids, self.device),
            positions,
            starts,
            masks,
            logits_indices,
            trees,
            row_starts,
            token_starts,
        )

    def _eager_inputs(
        self,
        batch: ScheduledBatch,
        input_ids: torch.Tensor,  # [num_tokens] int64 on the device
        positions: list[int],  # [num_tokens]
        starts: list[int],  # per request: its first KV index this step
        masks: list[torch.Tensor | None],  # per request: tree mask, None for causal
        logits_indices: list[int],
        trees: list[Tree | None],
        row_starts: list[int],
        token_starts: list[int],
    ) -> ModelInputs:
        """An eager step's inputs: attention metadata over the requests' reserved KV."""
        req_ids = [req.request_id for req in batch.requests]
        ends = [s + n for s, n in zip(starts, batch.num_new_tokens, strict=True)]
        meta = AttentionMetadata.build(
            page_size=self.kv.allocator.page_size,
            query_lens=batch.num_new_tokens,
            seq_lens=ends,
            page_table=self.kv.allocator.page_table(req_ids, device=self.device),
            slot_mapping=self.kv.slot_mapping_tensor(req_ids, starts, ends),
            masks=masks,
        )
        return ModelInputs(
            input_ids=input_ids,
            positions=device_ints(positions, self.device),
            meta=meta,
            logits_indices=device_ints(logits_indices, self.device),
            trees=trees,
            row_starts=row_starts,
            token_starts=token_starts,
        )

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, capture_layers: Sequence[int] = ()) -> ModelOutputs:
        if inputs.graph is not None:
            assert self.graphs is not None, "a graph step planned without graphs"
            logits, features = self.graphs.run(inputs.graph, capture_layers)
            return ModelOutputs(logits=logits, features=features)
        if inputs.prefill is not None:
            assert self.prefill_graphs is not None, "a prefill graph planned without graphs"
            logits, features = self.prefill_graphs.run(inputs.prefill, capture_layers)
            return ModelOutputs(logits=logits, features=features)
        assert inputs.input_ids is not None and inputs.positions is not None
        assert inputs.meta is not None and inputs.logits_indices is not None
        ctx = ForwardContext(kv=self.kv, meta=inputs.meta, backend=self.backend)
        out = self.model(inputs.input_ids, inputs.positions, ctx, capture_layers)
        logits = self.model.compute_logits(out.hidden[inputs.logits_indices])
        features = torch.cat(out.captured, dim=-1) if out.captured else None
        return ModelOutputs(logits=logits, features=features)
