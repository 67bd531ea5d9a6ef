"""Triton attention backend (GPU): `kernels.attention.tree_attention` behind the interface of
:class:`~tandem.attention.torch_ref.TorchAttention`, so ``ForwardContext`` takes either.

Per forward, the metadata is turned once into the kernel's inputs (prefix lengths, the custom
mask packed into int64 words per token, the split count) and shared by every layer. That plan
is built from the host-side lengths the metadata already carries, never from device reads, but
it uploads small tensors, so it cannot be captured. A CUDA-graph bucket runs
:class:`GraphAttention` instead: its ``GraphMetadata`` tensors are already the kernel's inputs
(static buffers the graph runner refills before each replay) and its shapes and split count are
fixed, so a forward launches ``store_kv`` and ``tree_attention`` on them and nothing else
(graph-safe: no host read, no allocation besides the kernels' outputs).

The attention kernel has compile-time variants (query tile size from the longest query, custom
mask or causal, split KV or not) and a forward's batch picks one; the first step of a kind never
seen (a prompt arriving while others verify trees: a long masked query) would compile it while
every request waits (on the order of a second). So the first eager forward of each head
shape compiles them all on tiny inputs first (``compile_variants``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kernels.attention import default_num_splits, pack_tree_mask, tree_attention
from kernels.kv import store_kv
from tandem.attention.metadata import AttentionMetadata, GraphMetadata
from tandem.transfer import to_device

logger = logging.getLogger(__name__)

_WORD_BITS = 64
# The query tile stops growing at this many rows (_blocks' cap), so longer queries add no variant.
_LONGEST_TILE_QUERY = 128
_compiled: set[tuple[object, ...]] = set()  # head shapes whose variants are compiled


@dataclass
class _Plan:
    """The kernel's view of one forward's metadata."""

    page_table: torch.Tensor  # [bs, max_pages] int32 on the device
    prefix_lens: torch.Tensor | None  # [bs] int64 (with tree_mask)
    tree_mask: torch.Tensor | None  # [num_tokens, num_words] int64 (None: causal)
    max_q_len: int
    max_kv_len: int


class TritonAttention:
    """Stores new K/V through ``slot_mapping``, then runs the paged tree-attention kernel.

    ``num_splits`` fixes the split-KV count; None picks it per forward from the batch shape
    and the GPU's SM count (``default_num_splits``). ``batch_invariant`` runs one split and
    the kernel's batch-invariant tiles (``tree_attention``): a token's output then does not
    depend on the batch it runs in (EngineConfig.batch_invariant)."""

    def __init__(self, num_splits: int | None = None, *, batch_invariant: bool = False) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
        if batch_invariant and num_splits not in (None, 1):
            raise ValueError(f"batch_invariant: needs one split, not {num_splits}")
        self.num_splits = 1 if batch_invariant else num_splits
        self.batch_invariant = batch_invariant
        self._cache: tuple[AttentionMetadata, _Plan] | None = None
        self._num_sms: dict[torch.device, int] = {}

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        plan = self._plan(meta, q, k_cache)
        num_splits = self.num_splits
        if num_splits is None:
            num_splits = self._auto_splits(plan, meta.batch_size, q, k_cache.shape[1])
        return tree_attention(
            q,
            k_cache,
            v_cache,
            plan.page_table,
            meta.query_start_loc,
            meta.seq_lens,
            plan.prefix_lens,
            plan.tree_mask,
            scale=scale,
            page_size=meta.page_size,
            max_q_len=plan.max_q_len,
            num_splits=num_splits,
            batch_invariant=self.batch_invariant,
        )

    def _auto_splits(self, plan: _Plan, bs: int, q: torch.Tensor, num_kv_heads: int) -> int:
        return default_num_splits(
            batch_size=bs,
            max_q_len=plan.max_q_len,
            num_heads=q.shape[1],
            num_kv_heads=num_kv_heads,
            head_dim=q.shape[2],
            max_kv_len=plan.max_kv_len,
            num_sms=self._sms(q.device),
        )

    def graph_splits(
        self,
        *,
        batch_size: int,
        width: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_kv_len: int,
        device: torch.device,
    ) -> int:
        """The split count of a graph bucket: fixed (``num_splits``) or chosen for the longest
        context the bucket may see; splits past a shorter context exit at once."""
        if self.num_splits is not None:
            return self.num_splits
        return default_num_splits(
            batch_size=batch_size,
            max_q_len=width,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_kv_len=max_kv_len,
            num_sms=self._sms(device),
        )

    def _sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            count = 8  # the interpreter (CPU tensors): a small machine
            if device.type == "cuda":
                count = torch.cuda.get_device_properties(device).multi_processor_count
            self._num_sms[device] = count
        return self._num_sms[device]

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> _Plan:
        """The forward's plan, made at its first layer and reused by the others (which also
        share the head shapes whose kernel variants ``compile_variants`` checks)."""
        if self._cache is not None and self._cache[0] is meta:
            return self._cache[1]
        compile_variants(q, k_cache, meta.page_size)
        device = q.device
        prefix_lens, tree_mask = mask_inputs(meta, device)
        plan = _Plan(
            page_table=meta.page_table.to(device),
            prefix_lens=prefix_lens,
            tree_mask=tree_mask,
            max_q_len=max(meta.query_lens_cpu),
            max_kv_len=max(meta.seq_lens_cpu),
        )
        self._cache = (meta, plan)
        return plan


class GraphAttention:
    """The backend of one CUDA-graph bucket: attends through the bucket's static buffers
    (``graph_meta``), ignoring the ``meta`` a forward passes (the graph runner's context holds
    an empty placeholder there, as no host-side metadata may be read inside a capture).
    ``batch_invariant`` as `TritonAttention`'s (with ``graph_meta.num_splits`` 1)."""

    def __init__(self, graph_meta: GraphMetadata, *, batch_invariant: bool = False) -> None:
        self.graph_meta = graph_meta
        self.batch_invariant = batch_invariant

    def forward(
        self,
        q: torch.Tensor,  # [bs * width, num_heads, head_dim]
        k: torch.Tensor,  # [bs * width, num_kv_heads, head_dim]
        v: torch.Tensor,  # [bs * width, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [bs * width, num_heads, head_dim]
        g = self.graph_meta
        store_kv(k, v, k_cache, v_cache, g.slot_mapping)
        return tree_attention(
            q,
            k_cache,
            v_cache,
            g.page_table,
            g.query_start_loc,
            g.seq_lens,
            g.prefix_lens,
            g.tree_mask,
            scale=scale,
            page_size=g.page_size,
            max_q_len=g.width,
            num_splits=g.num_splits,
            batch_invariant=self.batch_invariant,
        )


def compile_variants(q: torch.Tensor, k_cache: torch.Tensor, page_size: int) -> bool:
    """Compiles every variant of the attention kernels that a forward with ``q``'s and
    ``k_cache``'s head shapes, dtype and ``page_size`` can launch (``launch_variants``), once
    per shape and process; a no-op on CPU (interpreted Triton compiles nothing) and inside a
    CUDA-graph capture. True when it ran."""
    device = q.device
    key = (device, q.dtype, q.shape[1], k_cache.shape[1], q.shape[2], page_size)
    if device.type != "cuda" or key in _compiled or torch.cuda.is_current_stream_capturing():
        return False
    _compiled.add(key)
    started = time.perf_counter()
    launch_variants(q, k_cache, page_size)
    torch.cuda.synchronize(device)
    logger.info(
        "attention kernels compiled for %d heads / %d KV heads x %d (%s, page size %d) in %.1f s",
        q.shape[1],
        k_cache.shape[1],
        q.shape[2],
        str(q.dtype).removeprefix("torch."),
        page_size,
        time.perf_counter() - started,
    )
    return True


def launch_variants(
    q: torch.Tensor, k_cache: torch.Tensor, page_size: int, longest: int = _LONGEST_TILE_QUERY
) -> None:
    """Runs the attention kernels on tiny inputs of ``q``'s and ``k_cache``'s head shapes for
    queries of 1, 2, 4 .. ``longest`` tokens (each query tile size), masked and causal, on one
    and two KV splits, packing masks of one and of several words."""
    device = q.device
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_cache.shape[1]
    q_len = 1
    while q_len <= longest:
        seq_len = q_len + page_size + 1  # a one-token prefix, then a partial page
        pages = -(-seq_len // page_size)
        caches = torch.zeros(
            2, pages * page_size, num_kv_heads, head_dim, dtype=q.dtype, device=device
        )
        query = torch.zeros(q_len, num_heads, head_dim, dtype=q.dtype, device=device)
        page_table = torch.arange(pages, dtype=torch.int32, device=device)[None]
        cu_q = torch.tensor([0, q_len], dtype=torch.int64, device=device)
        seq_lens = torch.tensor([seq_len], dtype=torch.int64, device=device)
        width = seq_len - 1  # columns past the prefix: more than 64 from q_len 64
        mask = pack_tree_mask(
            torch.ones(q_len * width, dtype=torch.bool, device=device),
            torch.arange(q_len, dtype=torch.int64, device=device) * width,
            torch.full((q_len,), width, dtype=torch.int64, device=device),
            -(-width // _WORD_BITS),
        )
        prefix_lens = torch.ones(1, dtype=torch.int64, device=device)
        for masked in (False, True):
            for num_splits in (1, 2):
                tree_attention(
                    query,
                    caches[0],
                    caches[1],
                    page_table,
                    cu_q,
                    seq_lens,
                    prefix_lens if masked else None,
                    mask if masked else None,
                    scale=1.0,
                    page_size=page_size,
                    max_q_len=q_len,
                    num_splits=num_splits,
                )
        q_len *= 2


def mask_inputs(
    meta: AttentionMetadata, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # [bs] int64, [num_tokens, words] int64
    """The kernel's ``prefix_lens`` and ``tree_mask`` for ``meta`` (both None without a custom
    mask: causal). Each token's row of ``meta.custom_mask`` is packed into int64 words."""
    if meta.custom_mask is None:
        return None, None
    prefixes = [meta.prefix_len(i) for i in range(meta.batch_size)]
    widths = [s - p for s, p in zip(meta.seq_lens_cpu, prefixes, strict=True)]
    offsets: list[int] = []
    row_widths: list[int] = []
    start = 0
    for q_len, width in zip(meta.query_lens_cpu, widths, strict=True):
        offsets += [start + r * width for r in range(q_len)]
        row_widths += [width] * q_len
        start += q_len * width
    num_words = max(1, -(-max(widths, default=0) // _WORD_BITS))
    tree_mask = pack_tree_mask(
        meta.custom_mask.to(device),
        _upload(offsets, device),
        _upload(row_widths, device),
        num_words,
    )
    return _upload(prefixes, device), tree_mask


def _upload(values: list[int], device: torch.device) -> torch.Tensor:  # [len(values)] int64
    return to_device(torch.tensor(values, dtype=torch.int64), device)
