"""Benchmark model presets: a target shape, its EAGLE-3 head and an assistant LM (no torch
import here, so the CLI can list them cheaply; ``tandem.bench.models`` writes them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Llama 3.1's rope (config.json of meta-llama/Llama-3.1-8B): llama3 scaling, theta 5e5.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Specials of tandem.testing.random_model's word-level tokenizer, so tokenizer and config agree.
SPECIALS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True, kw_only=True)
class Preset:
    name: str
    target: dict[str, Any]  # transformers LlamaConfig keyword arguments
    draft_vocab_size: int  # the EAGLE-3 head's vocabulary
    aux_layer_ids: tuple[int, ...]  # EAGLE-3 aux layers, SpecForge numbering (output of layer)
    assistant: dict[str, Any] = field(default_factory=dict)  # LlamaConfig overrides of target
    dtype: str = "bfloat16"


def specforge_aux_layers(num_layers: int) -> tuple[int, ...]:
    """SpecForge's default EAGLE-3 capture layers (outputs of layers 1, L/2 - 1, L - 4)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


PRESETS = {
    "llama-3.1-8b": Preset(
        name="llama-3.1-8b",
        target={
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": _LLAMA3_ROPE,
            "tie_word_embeddings": False,
        },
        draft_vocab_size=32000,
        aux_layer_ids=specforge_aux_layers(32),
        # Llama-3.2-1B's shape: the usual assistant of Llama-3.1-8B.
        assistant={
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "tie_word_embeddings": True,
            "rope_scaling": dict(_LLAMA3_ROPE, factor=32.0),
        },
    ),
    "tiny": Preset(
        name="tiny",
        target={
            "vocab_size": 1000,
            "hidden_size": 64,
            "intermediate_size": 112,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": dict(_LLAMA3_ROPE, original_max_position_embeddings=256),
            "tie_word_embeddings": False,
        },
        draft_vocab_size=256,
        aux_layer_ids=(0, 1, 2),
        assistant={"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64},
        dtype="float32",
    ),
}
