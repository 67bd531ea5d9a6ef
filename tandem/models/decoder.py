"""Our forward for Llama / Qwen2 / Qwen3 dense decoders over a flat batch of tokens.

Tokens of all requests are concatenated (``[num_tokens]``) with explicit positions; attention
goes through the paged KV cache described by :class:`AttentionMetadata`. The forward returns the
final (normed) hidden states and, on request, the residual stream at any list of layer indices
in transformers' ``output_hidden_states`` numbering: index 0 is the embedding output, index i
the input of layer i (the output of layer i-1), index ``num_layers`` the final normed state.
EAGLE-3 asks for three of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tandem.attention import AttentionBackend, AttentionMetadata
from tandem.kv import KVCache
from tandem.models.config import ModelConfig


class RMSNorm(nn.Module):
    """RMS norm computed in float32, cast back before the weight (as transformers does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """Rotate-half RoPE with cos/sin computed from positions on the fly (graph-friendly)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = torch.tensor(config.inv_freq, dtype=torch.float32)
        self.inv_freq: torch.Tensor  # [head_dim // 2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = config.rope_attention_scaling

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, head_dim]
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [num_tokens, heads, head_dim]; cos/sin [num_tokens, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Self-attention over the paged KV. ``input_size`` (default ``hidden_size``) is the width
    q/k/v read; EAGLE-3's draft layer attends over ``[embedding; hidden]``, twice as wide."""

    def __init__(
        self, config: ModelConfig, layer_id: int, *, input_size: int | None = None
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # q, k and v fused into one matmul; the loader concatenates the checkpoint's weights.
        self.qkv_proj = nn.Linear(
            input_size or config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = ctx.backend.forward(
            q,
            k,
            v,
            ctx.kv.k_caches[self.layer_id],
            ctx.kv.v_caches[self.layer_id],
            ctx.meta,
            self.scale,
        )
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        # gate and up fused; the loader concatenates them.
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        h: torch.Tensor,  # [num_tokens, hidden], the residual stream
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos_sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class ForwardContext:
    """What every layer of one forward needs besides activations; passed, never global."""

    kv: KVCache
    meta: AttentionMetadata
    backend: AttentionBackend  # TorchAttention or TritonAttention


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [num_tokens, hidden], after the final norm
    # In the order requested; each [num_tokens, hidden] (transformers' hidden_states numbering).
    captured: list[torch.Tensor] = field(default_factory=list)


class DecoderLM(nn.Module):
    """A dense decoder-only LM (Llama, Qwen2, Qwen3) with paged-KV attention."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        ctx: ForwardContext,
        capture_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        num_layers = self.config.num_layers
        for index in capture_layers:
            if not 0 <= index <= num_layers:
                raise ValueError(f"capture_layers: {index} is outside [0, {num_layers}]")
        wanted = set(capture_layers)
        captured: dict[int, torch.Tensor] = {}
        h = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, h.dtype)
        for i, decoder_layer in enumerate(self.layers):
            if i in wanted:
                captured[i] = h
            h = decoder_layer(h, cos_sin, ctx)
        hidden = self.norm(h)
        captured[num_layers] = hidden
        return ForwardOutput(hidden=hidden, captured=[captured[i] for i in capture_layers])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] float32 logits."""
        return self.lm_head(hidden).float()
