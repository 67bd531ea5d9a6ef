"""DeepSeek NextN-style multi-token-prediction heads, adapted to our Llama-family layers.

docs/draft-formats.md section 3 describes DeepSeek-V3's head; ours keeps its fusion
and output and swaps MLA/MoE for the target's own decoder layer (``input_layernorm``,
``self_attn``, ``post_attention_layernorm``, ``mlp``; q/k norms and biases as the target's
architecture has them)::

    x   = eh_proj(cat(enorm(embed(t_{i+1+k})), hnorm(h_i)))   # embedding first
    y   = decoder_layer(x)                                    # at RoPE position i
    out = shared_head.norm(y)
    logits = head(out)

Head ``k`` (0-based) pairs position ``i`` with token ``t_{i+1+k}``, so its ``shift`` is
``1 + k``. ``h_i`` from the target is its final post-norm hidden (``project_target`` is the
identity).

The recurrent state returned by :meth:`MTPHead.forward` is the **post-norm** ``out`` (DeepSeek /
SGLang convention): in ``chain`` mode the next head consumes it as its ``h``, as it consumes
the target's post-norm hidden. vLLM instead carries the pre-norm sum; a checkpoint trained that
way would want a flag here.

``embed_tokens`` and ``shared_head.head`` are the head's own tensors when the checkpoint stores
them, else copies of the target's embedding and ``lm_head`` (the loader decides). vLLM's zeroing
of the embedding at position 0 is not applied.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.config import ModelConfig
from tandem.models.decoder import DecoderLayer, ForwardContext, RMSNorm, Rotary
from tandem.models.draft import DraftModule
from tandem.models.eagle import require_hidden


class SharedHead(nn.Module):
    """DeepSeek's ``shared_head``: the final norm and the vocabulary projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPHead(DraftModule):
    """One NextN head (``model.layers.{L + head_index}`` in the checkpoint) with one KV layer."""

    def __init__(self, config: ModelConfig, *, head_index: int) -> None:
        super().__init__()
        if head_index < 0:
            raise ValueError(f"head_index: must be >= 0, got {head_index}")
        self.config = config
        size = config.hidden_size
        self.head_index = head_index
        self.shift = 1 + head_index
        self.hidden_size = size
        self.vocab_size = config.vocab_size
        self.num_layers = 1
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.uses_hidden = True
        self.embed_tokens = nn.Embedding(config.vocab_size, size)
        self.enorm = RMSNorm(size, config.rms_norm_eps)
        self.hnorm = RMSNorm(size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        self.rotary = Rotary(config)
        self.decoder = DecoderLayer(config, 0)  # KV layer 0 of this head's own cache
        self.shared_head = SharedHead(config)

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        hidden_in: torch.Tensor | None,  # [T, H] post-norm: the target's or a head's output
        positions: torch.Tensor,  # [T] int64
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, H] post-norm out, the recurrent state
        h = require_hidden(hidden_in, self.hidden_size)
        e = self.enorm(self.embed_tokens(token_ids))  # [T, H]
        x = self.eh_proj(torch.cat((e, self.hnorm(h)), dim=-1))  # [T, H], embedding first
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        out, residual = self.decoder(self.decoder.input_layernorm(x), x, cos_sin, ctx)
        return self.shared_head.norm.add_norm(out, residual)[0]  # norm(decoder layer output)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, V] float32
        return self.shared_head.head(out).float()
