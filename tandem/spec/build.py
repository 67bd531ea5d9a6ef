"""Builds a drafter of any kind from a checkpoint directory (what ``--draft-kind`` selects)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import DTYPES
from tandem.kv import KVCache, KVCacheSpec
from tandem.models.draft import DraftModule
from tandem.spec.base import Drafter
from tandem.spec.drafter import ModelDrafter
from tandem.spec.ngram import NgramDrafter

DRAFT_KINDS = ("eagle3", "eagle", "mtp", "model", "ngram")
MTP_MODES = ("chain", "target")


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Where the draft comes from and how its KV pool is sized."""

    kind: str  # one of DRAFT_KINDS
    path: Path | None = None  # draft checkpoint directory; None only for ngram
    target: Path  # the target checkpoint (EAGLE/MTP read its embedding and lm_head)
    mtp_mode: str = "chain"  # chain | target (mtp only)
    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 16
    num_pages: int = 2048  # per draft module
    fast_top1: bool = True  # K=1: fused argmax + logsumexp instead of softmax + topk

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {DRAFT_KINDS}")
        if self.kind != "ngram" and self.path is None:
            raise ValueError(f"path: draft kind {self.kind} needs a checkpoint directory")
        if self.mtp_mode not in MTP_MODES:
            raise ValueError(f"mtp_mode: {self.mtp_mode!r} is not one of {MTP_MODES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.page_size < 1 or self.num_pages < 1:
            raise ValueError("page_size/num_pages: must be >= 1")


def build_drafter(config: DraftConfig, num_target_layers: int) -> Drafter:
    from tandem.models import draft_loader

    if config.kind == "ngram":
        return NgramDrafter()
    assert config.path is not None
    dtype = DTYPES[config.dtype]
    kwargs = {"dtype": dtype, "device": config.device}
    modules: list[DraftModule]
    layer_ids: tuple[int, ...]
    if config.kind == "eagle3":
        head = draft_loader.load_eagle3(config.path, config.target, **kwargs)  # type: ignore[arg-type]
        modules, layer_ids = [head], tuple(head.aux_layer_ids)
    elif config.kind == "eagle":
        modules = [draft_loader.load_eagle(config.path, config.target, **kwargs)]  # type: ignore[arg-type]
        layer_ids = (num_target_layers,)
    elif config.kind == "mtp":
        modules = list(draft_loader.load_mtp(config.path, config.target, **kwargs))  # type: ignore[arg-type]
        layer_ids = (num_target_layers,)
    else:
        modules = [draft_loader.load_standalone(config.path, config.target, **kwargs)]  # type: ignore[arg-type]
        layer_ids = ()
    kvs = [
        KVCache(
            KVCacheSpec(
                num_layers=m.num_layers,
                num_kv_heads=m.num_kv_heads,
                head_dim=m.head_dim,
                page_size=config.page_size,
                dtype=dtype,
                device=config.device,
            ),
            config.num_pages,
        )
        for m in modules
    ]
    for module in modules:
        module.eval()
    return ModelDrafter(
        modules,
        kvs,
        target_layer_ids=layer_ids,
        mode=config.mtp_mode,
        device=torch.device(config.device),
        fast_top1=config.fast_top1,
    )
