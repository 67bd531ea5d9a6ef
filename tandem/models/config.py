"""Architecture description of the dense decoders Tandem runs, read from a Hugging Face config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.errors import CheckpointError

# model_type -> defaults that the HF config does not spell out.
_ARCHS: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias_from_config": True, "qk_norm": False},
    "qwen2": {"qkv_bias_from_config": False, "qk_norm": False},
    "qwen3": {"qkv_bias_from_config": True, "qk_norm": True},
}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What the runtime needs to build a Llama / Qwen2 / Qwen3 decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    inv_freq: tuple[float, ...]  # [head_dim // 2] RoPE inverse frequencies, rope scaling applied
    rope_attention_scaling: float  # cos/sin multiplier (yarn's mscale; 1 otherwise)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def __post_init__(self) -> None:
        if self.model_type not in _ARCHS:
            raise ValueError(f"model_type: {self.model_type!r} is not one of {sorted(_ARCHS)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if len(self.inv_freq) * 2 != self.head_dim:
            raise ValueError("inv_freq: must have head_dim // 2 entries")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Reads ``config.json`` (through transformers, so every rope format is understood)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint dir)")
        with open(path / "config.json") as f:
            raw = json.load(f)
        model_type = raw.get("model_type")
        if model_type not in _ARCHS:
            raise CheckpointError(
                f"{path}: model_type {model_type!r} is not supported (use one of {sorted(_ARCHS)})"
            )
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path)
        return cls.from_hf(hf)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Builds from a transformers ``PretrainedConfig`` of a supported model type."""
        model_type = hf.model_type
        if model_type not in _ARCHS:
            raise CheckpointError(f"model_type {model_type!r} is not supported")
        arch = _ARCHS[model_type]
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {hf.hidden_act!r}: only silu is supported")
        layer_types = getattr(hf, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            # Sliding-window layers need a windowed mask in every backend; lifted when a
            # checkpoint that uses them is targeted.
            raise CheckpointError("sliding-window attention layers are not supported yet")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        inv_freq, attention_scaling = _rope_inv_freq(hf, head_dim)
        if arch["qkv_bias_from_config"]:
            qkv_bias = bool(getattr(hf, "attention_bias", False))
            o_bias = qkv_bias
        else:  # Qwen2: q/k/v always biased, o never.
            qkv_bias, o_bias = True, False
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch["qk_norm"],
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
            inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(attention_scaling),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
        )


def _rope_inv_freq(hf: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies exactly as transformers computes them for this config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("rope partial_rotary_factor != 1 is not supported")
    if rope_type in ("dynamic", "longrope"):
        # Their frequencies change with the sequence length; needs per-step frequency selection.
        raise CheckpointError(f"rope_type {rope_type!r} is not supported yet")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError(f"rope_type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(scaling)
