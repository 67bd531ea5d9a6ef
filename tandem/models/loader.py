"""Loads Hugging Face safetensors checkpoints (sharded or not) into :class:`DecoderLM`."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.errors import CheckpointError
from tandem.models.config import ModelConfig
from tandem.models.decoder import DecoderLM

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# Checkpoint sub-names fused into one of our parameters: ours -> the parts, in order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_PART_OF = {part: fused for fused, parts in _FUSED.items() for part in parts}
# Buffers some exporters save that we recompute.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (pickle checkpoints are refused)")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{path}: index names missing shard {file.name}")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        logger.info("loading %s", file.name)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> DecoderLM:
    """Builds a :class:`DecoderLM` from ``path`` (config.json + safetensors).

    Every parameter must be found exactly once; unknown tensors are an error, so a checkpoint of
    another architecture is refused rather than half loaded. ``progress(done, total)`` is called
    after each shard.
    """
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DecoderLM(config)
    model.to_empty(device=device)
    model.to(dtype)
    model.rotary.inv_freq = torch.tensor(config.inv_freq, dtype=torch.float32, device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight

    params = dict(model.named_parameters(remove_duplicate=False))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    files = checkpoint_files(path)
    done = 0
    for file in files:
        for name, tensor in iter_tensors([file]):
            target = _our_name(name)
            if target is None:
                if not _IGNORED.search(name):
                    unexpected.append(name)
                continue
            if target == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            ours, part = _split_fused(target)
            if part is None:
                _copy(params, ours, tensor, name)
                loaded.add(ours)
                continue
            group = pending.setdefault(ours, {})
            group[part] = tensor
            fused_module = ours.rsplit(".", 1)[0].split(".", 2)[-1]  # e.g. self_attn.qkv_proj
            parts = _FUSED[fused_module]
            if all(p in group for p in parts):
                _copy(params, ours, torch.cat([group[p] for p in parts], dim=0), name)
                loaded.add(ours)
                del pending[ours]
        done += 1
        if progress is not None:
            progress(done, len(files))
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensors {unexpected[:5]} ({len(unexpected)})")
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(params) - loaded - tied)
    if missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:5]} ({len(missing)} in all)")
    model.eval()
    return model


def _our_name(name: str) -> str | None:
    """Maps a transformers tensor name to ours (fused parts keep their part name)."""
    if name == "lm_head.weight":
        return name
    if name.startswith("model."):
        name = name[len("model.") :]
    if name in ("embed_tokens.weight", "norm.weight"):
        return name
    if _LAYER.match(name):
        return name
    return None


def _split_fused(name: str) -> tuple[str, str | None]:
    """``layers.3.self_attn.k_proj.weight`` -> (``layers.3.self_attn.qkv_proj.weight``, part)."""
    match = _LAYER.match(name)
    if match is None:
        return name, None
    layer, rest = match.groups()
    module, suffix = rest.rsplit(".", 1)
    fused = _PART_OF.get(module)
    if fused is None:
        return name, None
    return f"layers.{layer}.{fused}.{suffix}", module


def _copy(
    params: dict[str, torch.nn.Parameter], ours: str, tensor: torch.Tensor, source: str
) -> None:
    param = params.get(ours)
    if param is None:
        raise CheckpointError(f"unexpected tensor {source}")
    if tuple(param.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"{source}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)
