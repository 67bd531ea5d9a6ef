"""transformers' greedy output for trained checkpoints, the reference Tandem must equal.

``ignore_eos`` means "EOS is a token like any other, keep going": in ``generate`` that is
``eos_token_id=None``. (``min_new_tokens``, which ``tests.checkpoints.hf_greedy`` uses, instead
forbids EOS until the length is reached; a trained model that predicts EOS then diverges.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.checkpoints import load_hf


def hf_greedy_ignore_eos(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
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
