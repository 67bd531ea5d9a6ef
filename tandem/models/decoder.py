"""Our forward for Llama / Qwen2 / Qwen3 dense decoders over a flat batch of tokens.

Tokens of all requests are concatenated (``[num_tokens]``) with explicit positions; attention
goes through the paged KV cache described by :class:`AttentionMetadata`. The forward returns the
final (normed) hidden states and, on request, the residual stream at any list of layer indices
in transformers' ``output_hidden_states`` numbering: index 0 is the embedding output, index i
the input of layer i (the output of layer i-1), index ``num_layers`` the final normed state.
EAGLE-3 asks for three of them.

The elementwise work of a layer runs as fused ops (``kernels.fused``: RMSNorm, residual add +
RMSNorm, RoPE on q and k, SiLU * up) where :func:`fused_ops` allows, else as their torch
references, the eager formulas this module always ran (bit-identical on CPU). The residual add
that closes each sublayer is fused with the norm after it (vLLM's layout): a layer returns its
MLP output and the residual stream before it, and the next layer's input norm (or the final
norm) adds the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

import kernels
from tandem.attention import AttentionBackend, AttentionMetadata
from tandem.kv import KVCache
from tandem.models.config import ModelConfig


def fused_ops(*tensors: torch.Tensor) -> kernels.Ops:
    """The Triton kernels for an op on ``tensors`` where they may run, else the references:
    CUDA with triton installed, one dtype, and nothing for autograd or autocast to see (the
    kernels have no backward; under autocast the eager formulas mix dtypes as torch decides)."""
    x = tensors[0]
    if not kernels.uses_triton(x.device) or torch.is_autocast_enabled(x.device.type):
        return kernels.REFERENCE
    if any(t.dtype != x.dtype for t in tensors):
        return kernels.REFERENCE
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return kernels.REFERENCE
    return kernels.triton_ops()


class Linear(nn.Linear):
    """``nn.Linear`` whose forward goes through the kernels' ``linear`` (on CUDA, decode-size
    batches in bf16/fp16 run ``kernels.skinny``); same parameters and state dict.
    ``batch_invariant`` (``DecoderLM.use_batch_invariant``) sends every CUDA batch there."""

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x, self.weight)
        return ops.linear(x, self.weight, self.bias, batch_invariant=self.batch_invariant)


def transpose_weights(model: nn.Module) -> int:
    """Stores every projection's weight as the transpose of a contiguous [in, out] tensor
    (its shape stays [out, in], so loading, state dicts and ``F.linear`` see no change):
    ``F.linear(x, W)`` then multiplies by a row-major ``W^T``, which cuBLAS runs faster than
    the [out, in] layout at decode sizes (M = 1; ``bench/skinny_sweep.py --layouts`` compares
    them), and ``Linear`` runs ``kernels.skinny`` on it. A weight shared with an embedding (a
    tied lm_head) keeps the embedding's layout. Returns the weights moved."""
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    moved = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in shared:
            weight = module.weight.detach()
            module.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
            moved += 1
    return moved


class RMSNorm(nn.Module):
    """RMS norm computed in float32, cast back before the weight (as transformers does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        return fused_ops(x, self.weight).rms_norm(x, self.weight, self.eps)

    def add_norm(
        self,
        x: torch.Tensor,  # [num_tokens, size], a sublayer's output
        residual: torch.Tensor,  # [num_tokens, size], the residual stream before it
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(residual + x), residual + x
        ops = fused_ops(x, residual, self.weight)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


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
        self.qkv_proj = Linear(
            input_size or config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
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
        q, k = fused_ops(q, k, cos, sin).rope(q, k, cos, sin)
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
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        return self.down_proj(fused_ops(gate_up).silu_mul(gate_up))


class DecoderLayer(nn.Module):
    """A pre-norm layer whose residual adds are fused with the norms after them.

    ``forward`` takes its input already normed by ``input_layernorm`` together with the
    residual stream it came from, and returns the MLP output with the stream before that
    output is added; the caller adds them in the next norm (``RMSNorm.add_norm``), so the
    stream after this layer is ``add_norm``'s second output."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], input_layernorm(residual)
        residual: torch.Tensor,  # [num_tokens, hidden], the residual stream: this layer's input
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # MLP output, residual stream before it
        x, residual = self.post_attention_layernorm.add_norm(
            self.self_attn(x, cos_sin, ctx), residual
        )
        return self.mlp(x), residual


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
        self.batch_invariant = False  # use_batch_invariant

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
        residual = self.embed_tokens(input_ids)  # the residual stream, input of layer 0
        cos_sin = self.rotary.cos_sin(positions, residual.dtype)
        layers = cast(Sequence[DecoderLayer], self.layers)
        # Layer i's input norm closes layer i-1 (its residual add); the final norm the last.
        norms = [*(layer.input_layernorm for layer in layers), self.norm]
        x = norms[0](residual)
        for i, decoder_layer in enumerate(layers):
            if i in wanted:
                captured[i] = residual
            out, residual = decoder_layer(x, residual, cos_sin, ctx)
            x, residual = norms[i + 1].add_norm(out, residual)
        hidden = x
        captured[num_layers] = hidden
        return ForwardOutput(hidden=hidden, captured=[captured[i] for i in capture_layers])

    def use_transposed_weights(self) -> int:
        """``transpose_weights`` on this model (a tied lm_head keeps the embedding's layout).
        Call it before CUDA graphs are captured."""
        return transpose_weights(self)

    def use_batch_invariant(self) -> int:
        """Every projection and the lm_head through the kernels' batch-invariant GEMM
        (``kernels.skinny``: a row's sums in one order at any row count), so that on CUDA a
        token's logits do not depend on how many rows run beside it (with the attention
        backend's ``batch_invariant``: EngineConfig.batch_invariant). Returns the projections
        switched (the lm_head besides)."""
        self.batch_invariant = True
        switched = 0
        for module in self.modules():
            if isinstance(module, Linear):
                module.batch_invariant = True
                switched += 1
        return switched

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] float32 logits."""
        if self.batch_invariant:
            w = self.lm_head.weight
            ops = fused_ops(hidden, w)
            return ops.linear(hidden, w, self.lm_head.bias, batch_invariant=True).float()
        return self.lm_head(hidden).float()
