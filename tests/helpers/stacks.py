"""The stack the chaos tests run: tiny random checkpoints (a Llama target and its EAGLE-3 head)
and the three services as processes on loopback ports, on CPU in float32, as ``tandem serve``
starts them (``build_stack``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.apps.demo import free_port
from tandem.apps.launch import Stack, build_stack
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint


def random_family(root: Path, **target: Any) -> tuple[Path, Path]:
    """A 2-layer random target (``target`` overrides its config) and its EAGLE-3 head."""
    path = make_checkpoint(root / "target", "llama", seed=12, num_hidden_layers=2, **target)
    return path, make_eagle3_checkpoint(root / "eagle3", path, draft_vocab_size=1024, seed=2)


def cpu_stack(target: Path, draft: Path, **options: Any) -> Stack:
    """The services for ``target`` and its EAGLE-3 ``draft`` (chains of the default S) on free
    ports; ``options`` go to ``build_stack``. Not started."""
    return build_stack(
        target=target,
        draft=draft,
        draft_kind="eagle3",
        mtp_mode="chain",
        spec_args=[],
        page_size=16,
        device="cpu",
        dtype="float32",
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        **options,
    )
