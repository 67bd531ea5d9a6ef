"""Model runner: turns a scheduled batch into tensors and runs the target forward.

A request contributes either its next prompt chunk (causal) or its tree: node 0 is the verified
token at position L-1, node i at ``L-1+depth(i)``, stored at KV index ``L-1+i`` and seeing the
prefix plus its ancestors. Plain decoding is a tree of one node. Inputs are built on the host
from numbers the scheduler already has; nothing here reads the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.attention import AttentionMetadata, backend_for
from tandem.kv import KVCache
from tandem.models import DecoderLM, ForwardContext
from tandem.scheduler import ScheduledBatch
from tandem.spec.types import Tree


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_rows] int64, flat rows whose logits are needed
    trees: list[Tree | None]  # per request: what is verified this step (None: a mid-prompt chunk)
    row_starts: list[int]  # per request: its first row in the logits (valid where trees[i] set)
    token_starts: list[int]  # per request: its first token in the flat batch


@dataclass
class ModelOutputs:
    logits: torch.Tensor  # [num_rows, vocab] float32
    features: torch.Tensor | None  # [num_tokens, F] captured target features, all tokens


class ModelRunner:
    def __init__(self, model: DecoderLM, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = kv.spec.device
        self.backend = backend_for(self.device)

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        alloc = self.kv.allocator
        ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        masks: list[torch.Tensor | None] = []
        logits_indices: list[int] = []
        trees: list[Tree | None] = []
        row_starts: list[int] = []
        token_starts: list[int] = []
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start = req.num_computed
            token_starts.append(len(ids))
            row_starts.append(len(logits_indices))
            tree: Tree | None = req.tree
            if tree is not None:
                ids.extend(tree.tokens)
                positions.extend(start + d for d in tree.depths)
                masks.append(tree.ancestor_mask())
            else:
                ids.extend(req.tokens[start : start + n])
                positions.extend(range(start, start + n))
                masks.append(None)
                last = start + n == req.num_tokens
                tree = Tree(tokens=(req.tokens[-1],), parents=(-1,)) if last else None
            trees.append(tree)
            starts.append(start)
            ends.append(start + n)
            if tree is not None:
                first = len(ids) - len(tree)
                logits_indices.extend(range(first, len(ids)))
        req_ids = [req.request_id for req in batch.requests]
        meta = AttentionMetadata.build(
            page_size=alloc.page_size,
            query_lens=batch.num_new_tokens,
            seq_lens=ends,
            page_table=alloc.page_table(req_ids, device=self.device),
            slot_mapping=self.kv.slot_mapping_tensor(req_ids, starts, ends),
            masks=masks,
        )
        return ModelInputs(
            input_ids=_tensor(ids, self.device),
            positions=_tensor(positions, self.device),
            meta=meta,
            logits_indices=_tensor(logits_indices, self.device),
            trees=trees,
            row_starts=row_starts,
            token_starts=token_starts,
        )

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, capture_layers: Sequence[int] = ()) -> ModelOutputs:
        ctx = ForwardContext(kv=self.kv, meta=inputs.meta, backend=self.backend)
        out = self.model(inputs.input_ids, inputs.positions, ctx, capture_layers)
        logits = self.model.compute_logits(out.hidden[inputs.logits_indices])
        features = torch.cat(out.captured, dim=-1) if out.captured else None
        return ModelOutputs(logits=logits, features=features)


def _tensor(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
