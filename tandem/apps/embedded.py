"""The embedded default model family (docs/reference-model.md): ``checkpoints/tandem-code-ref``
beside the package (a checkout or an editable install), or wherever ``TANDEM_EMBEDDED`` points.
``tandem generate``, ``serve`` and ``demo`` use it when no ``--target`` is given, with its
EAGLE-3 head as the draft."""

from __future__ import annotations

import os
from pathlib import Path

from tandem.errors import CheckpointError

ENV = "TANDEM_EMBEDDED"
DEFAULT_KIND = "eagle3"


def family_dir() -> Path:
    override = os.environ.get(ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "checkpoints" / "tandem-code-ref"


def defaults(
    target: Path | None, draft: Path | None, draft_kind: str | None
) -> tuple[Path, Path | None, str | None, bool]:
    """(target, draft, draft kind, embedded?): the given ones, or the embedded family's target
    and EAGLE-3 head when no target is given (a given draft or kind is kept)."""
    if target is not None:
        return target, draft, draft_kind, False
    family = family_dir()
    if not (family / "target" / "config.json").is_file():
        raise CheckpointError(
            f"no --target given and the embedded model is missing at {family} "
            f"(set {ENV} or train it: python bench/train_reference.py)"
        )
    if draft is None and draft_kind is None:
        draft, draft_kind = family / DEFAULT_KIND, DEFAULT_KIND
    elif draft is None and draft_kind in ("eagle3", "mtp", "model"):
        draft = family / draft_kind
    return family / "target", draft, draft_kind, True
