"""Builds a drafter of any kind from a checkpoint directory (what ``--draft-kind`` selects)."""

from __future__ import annotations

import logging

import torch

from tandem.config import DraftConfig, torch_dtype
from tandem.draft.drafter import ModelDrafter
from tandem.draft.ngram import NgramDrafter
from tandem.kv import KVCache, KVCacheSpec
from tandem.models.decoder import transpose_weights
from tandem.models.draft import DraftModule
from tandem.spec.base import Drafter

logger = logging.getLogger(__name__)


def build_drafter(config: DraftConfig, num_target_layers: int) -> Drafter:
    if config.kind == "ngram":
        return NgramDrafter()
    return build_model_drafter(config, num_target_layers)


def build_model_drafter(config: DraftConfig, num_target_layers: int) -> ModelDrafter:
    """The drafter of a kind that runs a model (every kind but ngram)."""
    from tandem.models import draft_loader

    if config.kind == "ngram" or config.path is None:
        raise ValueError(f"kind: {config.kind} runs no draft model")
    dtype = torch_dtype(config.dtype)
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
        # A served head is never trained: with parameters that need no grad, fused_ops picks
        # the Triton kernels outside inference mode too (a graph captured at load, say).
        module.eval().requires_grad_(False)
        if config.use_transposed_weights:
            transpose_weights(module)
    return ModelDrafter(
        modules,
        kvs,
        target_layer_ids=layer_ids,
        mode=config.mtp_mode,
        device=torch.device(config.device),
        fast_top1=config.fast_top1,
    )
