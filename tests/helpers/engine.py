"""Inputs for the engine tests: prompts of ragged lengths."""

from __future__ import annotations

import random


def ragged_prompts(vocab: int, lens: tuple[int, ...] = (1, 7, 20, 33)) -> list[list[int]]:
    rng = random.Random(3)
    # Ids >= 3 so no prompt contains EOS/BOS/pad by accident.
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]
