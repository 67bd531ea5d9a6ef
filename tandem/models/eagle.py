"""EAGLE-3 and EAGLE-1 draft heads (SafeAILab / SpecForge checkpoint formats).

Both consume (hidden, token) pairs with shift 1 (see :mod:`tandem.models.draft`) through one
Llama-style layer whose KV lives in the draft's own paged cache (one KV layer).

- EAGLE-3 (docs/draft-formats.md section 1): the target contributes three
  auxiliary residual-stream states, concatenated (``[3 * H_t]``) and projected by ``fc``
  (:meth:`Eagle3Module.project_target`). The layer attends over ``[norm(embedding);
  norm(hidden)]`` (``2H`` wide) and returns the *pre-norm* output as the recurrent state;
  logits cover a pruned draft vocabulary mapped back through ``d2t``.
- EAGLE-1/2 (section 2): the target contributes its final post-norm hidden; ``fc`` fuses
  ``[embedding; hidden]``, the layer has no input norm and there is no final norm; logits come
  from the target's own ``lm_head``.

Aux-layer ids are kept in one convention, transformers' ``output_hidden_states`` index (index
``i`` is the input of layer ``i``), the numbering :meth:`DecoderLM.forward` captures in;
:func:`resolve_aux_layer_ids` converts a checkpoint's ids and records which convention it used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tandem.errors import CheckpointError
from tandem.models.config import ModelConfig
from tandem.models.decoder import MLP, Attention, ForwardContext, RMSNorm, Rotary
from tandem.models.draft import DraftModule

AUX_ID_KEY = "eagle_aux_hidden_state_layer_ids"
AUX_ID_CONVENTIONS = ("default", "specforge", "vllm")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """SafeAILab's hard-coded choice (inputs of layers 2, L//2, L-3), in our convention."""
    n = num_target_layers
    return (2, n // 2, n - 3)


def resolve_aux_layer_ids(
    raw_config: Mapping[str, Any], num_target_layers: int
) -> tuple[tuple[int, ...], str]:
    """The aux-layer ids of an EAGLE-3 config in our convention, and the convention it used.

    - ``"vllm"``: top-level ``eagle_aux_hidden_state_layer_ids``; ids name layer *inputs*
      (= our index), used raw.
    - ``"specforge"``: ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge / SGLang);
      id ``x`` names the *output* of layer ``x``, i.e. our ``x + 1``. Applied to every list, not
      only those starting at 1 (SGLang PR #25454's heuristic): a list written in the nested key
      is taken to mean what SpecForge writes there.
    - ``"default"``: neither key; :func:`default_aux_layer_ids`.

    Both keys present must name the same states. The result keeps the checkpoint's order, which
    is the order the states are concatenated in before ``fc``. Every id must lie in
    ``[0, num_target_layers]`` and there must be exactly three.
    """
    nested = raw_config.get("eagle_config") or {}
    found: dict[str, tuple[int, ...]] = {}
    if nested.get(AUX_ID_KEY) is not None:
        found["specforge"] = tuple(int(x) + 1 for x in nested[AUX_ID_KEY])
    if raw_config.get(AUX_ID_KEY) is not None:
        found["vllm"] = tuple(int(x) for x in raw_config[AUX_ID_KEY])
    if len(set(found.values())) > 1:
        raise CheckpointError(
            f"{AUX_ID_KEY}: eagle_config's {list(nested[AUX_ID_KEY])} (output convention) and "
            f"the top-level {list(raw_config[AUX_ID_KEY])} (input convention) name different "
            "target layers"
        )
    if "specforge" in found:
        convention = "specforge"
    elif "vllm" in found:
        convention = "vllm"
    else:
        convention = "default"
    ids = found.get(convention) or default_aux_layer_ids(num_target_layers)
    if len(ids) != 3:
        raise CheckpointError(f"{AUX_ID_KEY}: need 3 ids, got {list(ids)} ({convention})")
    for i in ids:
        if not 0 <= i <= num_target_layers:
            raise CheckpointError(
                f"{AUX_ID_KEY}: {list(ids)} (our convention, from {convention}) has {i} outside "
                f"[0, {num_target_layers}] for a {num_target_layers}-layer target"
            )
    return ids, convention


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: q/k/v read ``[input_layernorm(e); hidden_norm(g)]`` (2H)."""

    def __init__(
        self, config: ModelConfig, layer_id: int, *, norm_before_residual: bool = False
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)  # normalises the embedding
        self.hidden_norm = RMSNorm(size, eps)  # normalises the hidden state
        self.self_attn = Attention(config, layer_id, input_size=2 * size)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.mlp = MLP(config)
        # vLLM / speculators variant (docs/draft-formats.md 1.3): the residual is the normed
        # hidden, not the raw one.
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        e: torch.Tensor,  # [num_tokens, H] token embeddings
        g: torch.Tensor,  # [num_tokens, H] hidden inputs (pre-norm)
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, H] pre-norm output
        g_normed = self.hidden_norm(g)
        residual = g_normed if self.norm_before_residual else g
        x = torch.cat((self.input_layernorm(e), g_normed), dim=-1)  # [num_tokens, 2H], e first
        x, h = self.post_attention_layernorm.add_norm(self.self_attn(x, cos_sin, ctx), residual)
        return h + self.mlp(x)


class Eagle3Module(DraftModule):
    """An EAGLE-3 head. ``config`` describes its layer (``vocab_size`` = the target's V)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        target_hidden_size: int,
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, ...],
        aux_id_convention: str,
        fc_bias: bool = False,
        norm_before_residual: bool = False,
    ) -> None:
        super().__init__()
        if aux_id_convention not in AUX_ID_CONVENTIONS:
            raise ValueError(
                f"aux_id_convention: {aux_id_convention!r} is not one of {AUX_ID_CONVENTIONS}"
            )
        if len(aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids: need 3 ids, got {aux_layer_ids}")
        self.config = config
        size = config.hidden_size
        self.shift = 1
        self.hidden_size = size
        self.vocab_size = draft_vocab_size
        self.num_layers = 1
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.uses_hidden = True
        self.target_hidden_size = target_hidden_size
        self.aux_layer_ids = aux_layer_ids  # our convention: HF hidden_states index
        self.aux_id_convention = aux_id_convention  # what the checkpoint's config used
        self.fc = nn.Linear(3 * target_hidden_size, size, bias=fc_bias)
        self.embed_tokens = nn.Embedding(config.vocab_size, size)
        self.rotary = Rotary(config)
        self.midlayer = Eagle3Layer(config, 0, norm_before_residual=norm_before_residual)
        self.norm = RMSNorm(size, config.rms_norm_eps)
        self.lm_head = nn.Linear(size, draft_vocab_size, bias=False)
        self.d2t: torch.Tensor  # [V_d] int64, target id of draft id j minus j
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.t2d: torch.Tensor  # [V] bool, target id is in the draft vocabulary (training only)
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def project_target(self, features: torch.Tensor) -> torch.Tensor:
        """``[T, 3 * H_t]`` aux states (in ``aux_layer_ids`` order) -> ``[T, H]`` via ``fc``."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"features: width {features.shape[-1]} != 3 * target hidden ({self.fc.in_features})"
            )
        return self.fc(features)

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        hidden_in: torch.Tensor | None,  # [T, H]: project_target's output or our own output
        positions: torch.Tensor,  # [T] int64
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, H] pre-norm h2, the recurrent state
        g = require_hidden(hidden_in, self.hidden_size)
        e = self.embed_tokens(token_ids)  # [T, H]
        cos_sin = self.rotary.cos_sin(positions, g.dtype)
        return self.midlayer(e, g, cos_sin, ctx)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, V_d] float32
        return self.lm_head(self.norm(out)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


class Eagle1Layer(nn.Module):
    """A Llama decoder layer whose input norm is the identity (EAGLE-1 has no input_layernorm)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, H]
        normed, h = self.post_attention_layernorm.add_norm(self.self_attn(x, cos_sin, ctx), x)
        return h + self.mlp(normed)


class EagleModule(DraftModule):
    """An EAGLE-1/2 head: ``fc`` over ``[embed(t); g]``, one layer, the target's ``lm_head``.

    ``g`` is the target's final post-norm hidden, already ``H`` wide, so ``project_target`` is
    the identity. ``embed_tokens`` and ``lm_head`` hold copies of the target's tensors.
    """

    def __init__(self, config: ModelConfig, *, fc_bias: bool = True) -> None:
        super().__init__()
        self.config = config
        size = config.hidden_size
        self.shift = 1
        self.hidden_size = size
        self.vocab_size = config.vocab_size
        self.num_layers = 1
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.uses_hidden = True
        self.fc = nn.Linear(2 * size, size, bias=fc_bias)
        self.embed_tokens = nn.Embedding(config.vocab_size, size)
        self.rotary = Rotary(config)
        self.layers = nn.ModuleList([Eagle1Layer(config, 0)])
        self.lm_head = nn.Linear(size, config.vocab_size, bias=False)

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        hidden_in: torch.Tensor | None,  # [T, H] target post-norm hidden or our own output
        positions: torch.Tensor,  # [T] int64
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, H] hidden + residual, no final norm
        g = require_hidden(hidden_in, self.hidden_size)
        x = self.fc(torch.cat((self.embed_tokens(token_ids), g), dim=-1))  # [T, H], e first
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, ctx)
        return x

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, V] float32
        return self.lm_head(out).float()


def require_hidden(hidden_in: torch.Tensor | None, width: int) -> torch.Tensor:
    """``hidden_in`` checked to be present and ``width`` wide (every hidden-consuming draft)."""
    if hidden_in is None:
        raise ValueError("hidden_in: this draft consumes (hidden, token) pairs; got None")
    if hidden_in.shape[-1] != width:
        raise ValueError(
            f"hidden_in: width {hidden_in.shape[-1]} != {width} (project target features first)"
        )
    return hidden_in
