"""Checkpoints for the tests: random ones written on the fly, edits to their config and tensors,
and transformers' reference."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tandem.testing.random_model import ARCHS, make_checkpoint

__all__ = ["ARCHS", "edit_config", "edit_tensors", "hf_greedy", "load_hf", "make_checkpoint"]


def load_hf(path: Path) -> Any:
    """The same checkpoint in transformers (eager attention, float32): the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate of exactly ``new_tokens`` per prompt: the reference for
    Tandem's ``ignore_eos``, where EOS is a token like any other and generation goes on. In
    ``generate`` that is ``eos_token_id=None`` (``min_new_tokens`` would instead forbid EOS,
    which a trained model that predicts it then diverges from)."""
    hf = load_hf(path)
    out = []
    for p in prompts:
        with torch.inference_mode():
            ids = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
        out.append(ids[0, len(p) :].tolist())
    return out


def edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | changes))


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], Any]) -> None:
    w = load_file(path / "model.safetensors")
    edit(w)
    save_file(w, path / "model.safetensors")
