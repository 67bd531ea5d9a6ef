"""Model runner: turns a scheduled batch into tensors, runs the forward, samples.

The step functions here are the ones the target service's engine calls; they build their inputs
on the host from numbers the scheduler already has and read back only the sampled ids, which
must leave the process anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.attention import AttentionMetadata, TorchAttention
from tandem.kv import KVCache
from tandem.models import DecoderLM, ForwardContext
from tandem.request import Request
from tandem.sampling import SamplingBatch, sample
from tandem.scheduler import ScheduledBatch


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64, rows whose next token is sampled
    sampled_rows: list[int]  # batch index of each sampled row


class ModelRunner:
    def __init__(self, model: DecoderLM, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = kv.spec.device
        self.backend = TorchAttention()

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        alloc = self.kv.allocator
        ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        logits_indices: list[int] = []
        sampled_rows: list[int] = []
        for row, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
            start, end = req.num_computed, req.num_computed + n
            ids.extend(req.tokens[start:end])
            positions.extend(range(start, end))
            starts.append(start)
            ends.append(end)
            if end == req.num_tokens:
                logits_indices.append(len(ids) - 1)
                sampled_rows.append(row)
        req_ids = [req.request_id for req in batch.requests]
        meta = AttentionMetadata.build(
            page_size=alloc.page_size,
            query_lens=batch.num_new_tokens,
            seq_lens=ends,
            page_table=alloc.page_table(req_ids, device=self.device),
            slot_mapping=self.kv.slot_mapping_tensor(req_ids, starts, ends),
        )
        return ModelInputs(
            input_ids=_tensor(ids, self.device),
            positions=_tensor(positions, self.device),
            meta=meta,
            logits_indices=_tensor(logits_indices, self.device),
            sampled_rows=sampled_rows,
        )

    @torch.inference_mode()
    def forward_logits(self, inputs: ModelInputs) -> torch.Tensor:  # [num_sampled, vocab]
        ctx = ForwardContext(kv=self.kv, meta=inputs.meta, backend=self.backend)
        out = self.model(inputs.input_ids, inputs.positions, ctx)
        return self.model.compute_logits(out.hidden[inputs.logits_indices])

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """One forward + sampling; the sampled id per request, None for mid-prompt chunks."""
        inputs = self.prepare(batch)
        logits = self.forward_logits(inputs)
        reqs = [batch.requests[row] for row in inputs.sampled_rows]
        sampling = SamplingBatch.build(
            [req.params for req in reqs], [req.generator for req in reqs], self.device
        )
        history = _token_history(reqs, self.device) if sampling.any_penalty else None
        next_ids = sample(logits, sampling, history).tolist()
        result: list[int | None] = [None] * len(batch)
        for row, token in zip(inputs.sampled_rows, next_ids, strict=True):
            result[row] = int(token)
        return result


def _tensor(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _token_history(reqs: Sequence[Request], device: torch.device | str) -> torch.Tensor:
    """[bs, max_tokens] int64 of prompt + generated ids, padded with -1 (repetition penalty)."""
    rows = [req.tokens for req in reqs]
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out.to(device, non_blocking=True)
