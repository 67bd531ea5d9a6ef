"""What an engine is built from: the target model in the layout its config asks for, the KV
pool sized from the config and the device, and the CUDA graphs of the target and its draft."""

from __future__ import annotations

import logging

import torch

from tandem.config import EngineConfig
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import DecoderLM, load_model
from tandem.spec.base import Drafter
from tandem.spec.types import SpecConfig
from tandem.target.graphs import graph_widths
from tandem.target.runner import ModelRunner

logger = logging.getLogger(__name__)

# Without a size, a CPU pool gets this budget (capped by what max_num_seqs full contexts need).
_CPU_KV_BYTES = 1 << 30


def prepared_model(model: DecoderLM | None, config: EngineConfig) -> DecoderLM:
    """The target model, loaded when not given, in the layout the config asks for."""
    if model is None:
        model = load_model(config.model, dtype=config.torch_dtype, device=config.device)
    if config.use_transposed_weights:
        model.use_transposed_weights()
    if config.batch_invariant:
        model.use_batch_invariant()
    return model


def kv_pool(
    config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, max_model_len: int
) -> KVCache:
    """The target's KV pool: ``num_pages`` when given, else a memory budget (the configured
    one, a share of the GPU's free memory, or a fixed CPU budget), at most what
    ``max_num_seqs`` full contexts need."""
    spec = KVCacheSpec(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=config.page_size,
        dtype=config.torch_dtype,
        device=config.device,
    )
    full = config.max_num_seqs * -(-max_model_len // config.page_size)
    if config.num_pages is not None:
        num_pages = config.num_pages
    elif config.kv_cache_bytes is not None:
        num_pages = spec.pages_for_budget(config.kv_cache_bytes)
    else:
        if config.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(config.device))
            budget = int(free * config.gpu_memory_utilization)
        else:
            budget = _CPU_KV_BYTES
        num_pages = max(1, min(full, spec.pages_for_budget(budget)))
    kv = KVCache(spec, num_pages)
    logger.info(
        "KV pool: %d pages of %d tokens (%.1f MiB)",
        kv.allocator.num_pages,
        config.page_size,
        spec.bytes_per_page * (kv.allocator.num_pages + 1) / 2**20,
    )
    return kv


def enable_graphs(
    runner: ModelRunner,
    config: EngineConfig,
    drafter: Drafter | None,
    spec: SpecConfig | None,
    max_model_len: int,
) -> None:
    """The target's CUDA graphs (decode/verify, and prefill where configured), and the
    draft's for the same batch sizes (the draft follows the target)."""
    layers = drafter.target_layer_ids if drafter is not None else ()
    runner.enable_graphs(
        batch_sizes=config.graph_batch_sizes,
        widths=graph_widths(spec.tree_size if spec is not None else None),
        max_model_len=max_model_len,
        capture_layers=layers,
    )
    if config.prefill_graph_widths:
        runner.enable_prefill_graphs(
            widths=config.prefill_graph_widths,
            max_model_len=max_model_len,
            capture_layers=layers,
        )
    if drafter is not None and spec is not None:
        drafter.use_graphs(
            batch_sizes=config.graph_batch_sizes,
            max_model_len=max_model_len,
            num_steps=(spec.num_steps,),
            trees=(spec,),
        )
