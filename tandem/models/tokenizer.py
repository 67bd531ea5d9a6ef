"""Loading a checkpoint's tokenizer (through transformers), with one error for every service
and command that needs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.errors import CheckpointError


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved with the checkpoint at ``path``; ``CheckpointError`` says why not."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot load a tokenizer ({exc})") from exc
