"""Evaluation prompts cut from held-out documents, with where each came from.

A prompt is a run of whole lines of one held-out file: it starts at a line boundary chosen by a
seeded generator and grows line by line until it holds at least ``min_chars`` characters
(drawn per prompt from ``chars``), and is kept if it encodes to ``[min_tokens, max_tokens]``
tokens. Files are visited in a seeded order, round-robin, at most ``per_file`` prompts each,
never overlapping. Each record keeps the file's source, its sha256, and the character offsets
``[start, end)`` of the prompt in it, so every prompt can be checked against its file.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.train.corpus import Document


def cut_prompts(
    docs: Sequence[Document],
    tokenizer: Any,
    num_prompts: int,
    *,
    seed: int,
    chars: tuple[int, int] = (200, 700),
    min_tokens: int = 16,
    max_tokens: int = 256,
    per_file: int = 4,
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    order = sorted((d for d in docs if d.token_ids is None), key=lambda d: d.source)
    rng.shuffle(order)
    taken: dict[str, list[tuple[int, int]]] = {d.source: [] for d in order}
    prompts: list[dict[str, Any]] = []
    for _ in range(per_file):
        for doc in order:
            if len(prompts) == num_prompts:
                return prompts
            span = _cut(doc.text, rng, rng.randint(*chars), taken[doc.source])
            if span is None:
                continue
            start, end = span
            text = doc.text[start:end]
            n = len(tokenizer(text)["input_ids"])
            if not min_tokens <= n <= max_tokens:
                continue
            taken[doc.source].append(span)
            prompts.append(
                {
                    "id": len(prompts),
                    "source": doc.source,
                    "file_sha256": doc.sha256,
                    "start": start,
                    "end": end,
                    "num_tokens": n,
                    "text": text,
                }
            )
    return prompts


def _cut(
    text: str, rng: random.Random, min_chars: int, taken: list[tuple[int, int]]
) -> tuple[int, int] | None:
    """A span of whole lines starting at a random line, at least ``min_chars`` long and not
    overlapping ``taken``; None when the file has no room."""
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 < len(text)]
    for _ in range(8):
        start = rng.choice(starts)
        end = start
        while end < len(text) and end - start < min_chars:
            newline = text.find("\n", end)
            end = len(text) if newline < 0 else newline + 1
        if end - start < min_chars // 2 or not text[start:end].strip():
            continue
        if all(end <= a or start >= b for a, b in taken):
            return start, end
    return None


def write_prompts(prompts: Sequence[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for record in prompts:
            f.write(json.dumps(record) + "\n")


def read_prompts(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
