"""The logits processors that read the tokens so far (``tandem.sampling.process_logits`` applies
them): transformers' repetition penalty over the prompt and the generated tokens, and OpenAI's
(and vLLM's) presence and frequency penalties over the generated tokens only. Rows are padded
with -1; ids past the vocabulary land in an extra column that is dropped, as in transformers."""

from __future__ import annotations

import torch


def apply_repetition_penalty(
    logits: torch.Tensor,  # [bs, V] float32
    token_ids: torch.Tensor,  # [bs, T] int64, prompt + generated, padded with -1
    penalty: torch.Tensor,  # [bs] float32
) -> torch.Tensor:  # [bs, V] float32
    """HF's repetition penalty: a seen token's logit is times p if negative, else divided by p."""
    bs, vocab = logits.shape
    # Padding and ids past the vocabulary land in an extra column that is dropped, as in HF.
    ids = token_ids.masked_fill(token_ids < 0, vocab).clamp(max=vocab)  # [bs, T]
    seen = torch.zeros(bs, vocab + 1, dtype=torch.bool, device=logits.device)  # [bs, V + 1]
    seen = seen.scatter_(1, ids, True)[:, :vocab]  # [bs, V]
    p = penalty.to(logits.dtype)[:, None]  # [bs, 1]
    penalised = torch.where(logits < 0, logits * p, logits / p)  # [bs, V]
    return torch.where(seen, penalised, logits)


def apply_counts_penalty(
    logits: torch.Tensor,  # [bs, V] float32
    token_ids: torch.Tensor,  # [bs, T] int64, prompt + generated, padded with -1
    prompt_lens: torch.Tensor,  # [bs] int64: the first generated position of each row
    presence: torch.Tensor,  # [bs] float32
    frequency: torch.Tensor,  # [bs] float32
) -> torch.Tensor:  # [bs, V] float32
    """vLLM's and OpenAI's presence and frequency penalties, over the generated tokens only:
    logit - frequency * count - presence * (count > 0)."""
    bs, vocab = logits.shape
    position = torch.arange(token_ids.shape[1], device=token_ids.device)[None, :]  # [1, T]
    generated = (position >= prompt_lens[:, None]) & (token_ids >= 0)  # [bs, T]
    ids = token_ids.masked_fill(~generated, vocab).clamp(max=vocab)  # [bs, T]
    counts = torch.zeros(bs, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))[:, :vocab]
    penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0)  # [bs, V]
    return logits - penalty
