"""The target as drafts see it: hidden states, logits and greedy continuations (transformers).

Hidden states use transformers' ``output_hidden_states`` numbering, the one Tandem's runtime
captures in (``DecoderLM.forward``): index 0 is the embedding output, index i the input of
layer i, index ``num_layers`` the final post-norm state. The target runs frozen, in bf16 on
CUDA and float32 on CPU, exactly as it is stored (drafts train on the checkpoint they serve
with).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.train.loop import Log, autocast, log_stdout


@dataclass(frozen=True)
class TargetOutputs:
    hidden: list[torch.Tensor]  # per requested index [B, T, H_t]
    logits: torch.Tensor  # [B, T, V] float32; position p predicts token p + 1


class FrozenTarget:
    """A target checkpoint loaded with transformers for feature extraction."""

    def __init__(self, path: Path, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.path = path
        self.device = device
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa"
        )
        self.model = model.to(device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.config = self.model.config
        self.num_layers = int(self.config.num_hidden_layers)

    @torch.no_grad()
    def run(self, ids: torch.Tensor, layers: Sequence[int]) -> TargetOutputs:
        """``ids`` [B, T] -> the hidden states at ``layers`` and the logits."""
        with autocast(self.device):
            out = self.model(input_ids=ids, output_hidden_states=bool(layers))
        hidden = [out.hidden_states[i] for i in layers] if layers else []
        return TargetOutputs(hidden=hidden, logits=out.logits.float())

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """[B, P] prompts -> [B, P + new_tokens]: greedy continuations, EOS ignored."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        ids = prompts.to(self.device)
        out = [ids]
        step_ids = ids
        for _ in range(new_tokens):
            with autocast(self.device):
                logits = self.model(
                    input_ids=step_ids, past_key_values=cache, use_cache=True
                ).logits
            step_ids = logits[:, -1].float().argmax(-1, keepdim=True)  # [B, 1]
            out.append(step_ids)
        return torch.cat(out, dim=1).cpu()


def generate_sequences(
    target: FrozenTarget,
    blocks: torch.Tensor,  # [N, seq_len] training blocks the prompts are cut from
    num_sequences: int,
    prompt_len: int,
    *,
    batch_size: int,
    seed: int,
    log: Log = log_stdout,
) -> torch.Tensor:  # [num_sequences, seq_len] int64
    """Target-written training sequences: the first ``prompt_len`` tokens of random training
    blocks, continued greedily by the target to the block length (the text a greedy target
    produces at serving time is what its drafts must predict)."""
    seq_len = blocks.shape[1]
    if not 1 <= prompt_len < seq_len:
        raise ValueError(f"prompt_len: must be in [1, {seq_len - 1}], got {prompt_len}")
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(blocks.shape[0], (num_sequences,), generator=gen)
    out = []
    for start in range(0, num_sequences, batch_size):
        prompts = blocks[rows[start : start + batch_size], :prompt_len]
        out.append(target.greedy(prompts, seq_len - prompt_len))
        log(
            f"[generate] {min(start + batch_size, num_sequences)}/{num_sequences} sequences "
            f"of {seq_len} tokens"
        )
    return torch.cat(out) if out else torch.zeros(0, seq_len, dtype=torch.int64)
