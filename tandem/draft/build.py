"""Builds a drafter of any kind from a checkpoint directory (what ``--draft-kind`` selects)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import (
    CUDA_GRAPHS,
    DEVICE,
    DRAFT_KIND,
    DTYPE,
    DTYPES,
    NUM_PAGES,
    PAGE_SIZE,
    TARGET,
    TRANSPOSED_WEIGHTS,
    on_for_cuda,
)
from tandem.draft.drafter import ModelDrafter
from tandem.draft.ngram import NgramDrafter
from tandem.kv import KVCache, KVCacheSpec
from tandem.models.decoder import transpose_weights
from tandem.models.draft import DraftModule
from tandem.settings import setting
from tandem.spec.base import Drafter
from tandem.spec.types import DRAFT_KINDS, MTP_MODES

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Where the draft comes from and how its KV pool is sized."""

    kind: str = setting(like=DRAFT_KIND)
    path: Path | None = setting(  # None only for ngram
        None, help="draft checkpoint directory (every kind but ngram)", env="PATH", flag="draft"
    )
    target: Path = setting(like=TARGET)  # EAGLE/MTP read its embedding and lm_head
    mtp_mode: str = setting(
        "chain",
        help="MTP heads fed the previous head's hidden (chain) or the target's (target)",
        env="MTP_MODE",
        choices=MTP_MODES,
    )
    dtype: str = setting("float32", like=DTYPE)
    device: str = setting("cpu", like=DEVICE)
    page_size: int = setting(16, like=PAGE_SIZE)
    num_pages: int = setting(2048, like=NUM_PAGES)  # per draft module
    fast_top1: bool = True  # K=1: fused argmax + logsumexp instead of softmax + topk
    # Chains and extends through CUDA graphs (tandem/draft/graphs.py); None = on for CUDA.
    cuda_graphs: bool | None = setting(None, like=CUDA_GRAPHS)
    # The target's default buckets (EngineConfig): a device-chain run needs its bucket on both.
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    cuda_graph_steps: tuple[int, ...] = (3,)  # S captured at load; any other S on first use
    # Without CUDA graphs (CPU): the graphs' buckets run eagerly on their static buffers, the
    # stand-in with which the CPU tests run device-chain runs (draft_service/chain.py).
    static_buckets: bool = False
    # Projection weights stored transposed (tandem.models.decoder.transpose_weights), as the
    # target's: cuBLAS's faster layout and the skinny kernel at decode sizes; None = on for CUDA.
    transposed_weights: bool | None = setting(None, like=TRANSPOSED_WEIGHTS)

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
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs: needs a CUDA device, not {self.device!r}")
        sizes = self.cuda_graph_batch_sizes
        if not sizes or sizes[0] < 1 or list(sizes) != sorted(set(sizes)):
            raise ValueError("cuda_graph_batch_sizes: need increasing sizes >= 1")
        if any(s < 1 for s in self.cuda_graph_steps):
            raise ValueError("cuda_graph_steps: every S must be >= 1")

    @property
    def use_transposed_weights(self) -> bool:
        return on_for_cuda(self.transposed_weights, self.device)

    @property
    def use_cuda_graphs(self) -> bool:
        if self.cuda_graphs is None:
            return self.device.startswith("cuda") and self.kind != "ngram"
        return self.cuda_graphs


def build_drafter(config: DraftConfig, num_target_layers: int) -> Drafter:
    if config.kind == "ngram":
        return NgramDrafter()
    return build_model_drafter(config, num_target_layers)


def build_model_drafter(config: DraftConfig, num_target_layers: int) -> ModelDrafter:
    """The drafter of a kind that runs a model (every kind but ngram)."""
    from tandem.models import draft_loader

    if config.kind == "ngram" or config.path is None:
        raise ValueError(f"kind: {config.kind} runs no draft model")
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
