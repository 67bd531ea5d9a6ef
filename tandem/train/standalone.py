"""A standalone draft LM (kind ``model``) distilled from the target.

A small Llama sharing the target's tokenizer (copied beside it, as ``load_standalone``
requires), its embedding initialised from the target's when the widths agree. Loss: the heads'
label loss (:func:`tandem.train.labels.step_terms`: soft cross-entropy against the target's
distribution mixed with cross-entropy against its greedy token) at every position; saved with
``save_pretrained``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.train.features import FrozenTarget, TargetOutputs
from tandem.train.heads import Metrics
from tandem.train.labels import Labels, step_terms

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True, kw_only=True)
class StandaloneShape:
    """The draft LM's size; None takes the target's value."""

    num_layers: int = 2
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers: must be >= 1, got {self.num_layers}")


class StandaloneTrainer:
    """Same interface as :class:`tandem.train.heads.HeadTrainer` for the loop and the saver."""

    layers: tuple[int, ...] = ()

    def __init__(
        self,
        path: Path,
        target: FrozenTarget,
        *,
        shape: StandaloneShape,
        hard_weight: float,
        device: torch.device,
    ) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig

        if not 0.0 <= hard_weight <= 1.0:
            raise ValueError(f"hard_weight: must be in [0, 1], got {hard_weight}")
        tc = target.config
        hidden = shape.hidden_size or tc.hidden_size
        heads = shape.num_heads or tc.num_attention_heads
        kwargs: dict[str, Any] = {
            "vocab_size": tc.vocab_size,
            "hidden_size": hidden,
            "intermediate_size": shape.intermediate_size or tc.intermediate_size,
            "num_hidden_layers": shape.num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": shape.num_kv_heads or getattr(tc, "num_key_value_heads", heads),
            "max_position_embeddings": tc.max_position_embeddings,
            "rms_norm_eps": tc.rms_norm_eps,
            "tie_word_embeddings": True,
            "bos_token_id": tc.bos_token_id,
            "eos_token_id": tc.eos_token_id,
            "pad_token_id": getattr(tc, "pad_token_id", None),
        }
        rope = getattr(tc, "rope_parameters", None)
        if rope:  # RoPE as the target's (a draft is read at the target's positions)
            kwargs["rope_parameters"] = dict(rope)
        model: Any = AutoModelForCausalLM.from_config(
            LlamaConfig(**kwargs), attn_implementation="sdpa"
        )
        self.model = model
        target_embed = target.model.get_input_embeddings().weight
        if target_embed.shape == self.model.get_input_embeddings().weight.shape:
            with torch.no_grad():
                self.model.get_input_embeddings().weight.copy_(target_embed.float())
        self.model.to(device).train()
        self.path = path
        self.target_dir = target.path
        self.hard_weight = hard_weight

    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def modules(self) -> list[nn.Module]:
        return [self.model]

    def losses(self, ids: torch.Tensor, target: TargetOutputs) -> tuple[torch.Tensor, Metrics]:
        logits = self.model(input_ids=ids).logits  # [B, N, V]
        loss, soft, agree = step_terms(logits, Labels.of(target.logits), self.hard_weight)
        return loss.mean(), {"ce0": soft.mean(), "acc0": agree.float().mean()}

    def save(self, dtype: torch.dtype) -> None:
        model: Any = type(self.model)(self.model.config)
        model.load_state_dict(self.model.state_dict())
        model.to(device="cpu", dtype=dtype).save_pretrained(self.path)
        for name in TOKENIZER_FILES:
            if (self.target_dir / name).is_file():
                shutil.copy2(self.target_dir / name, self.path / name)
