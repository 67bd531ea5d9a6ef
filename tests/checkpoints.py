"""Checkpoints for the tests: random ones written on the fly, and transformers' reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandem.random_model import ARCHS, make_checkpoint

__all__ = ["ARCHS", "load_hf", "make_checkpoint"]


def load_hf(path: Path) -> Any:
    """The same checkpoint in transformers (eager attention, float32): the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()
