"""Cases for the tree-attention tests (tests/kernels/test_attention*.py): request shapes
(ragged causal, verify trees, draft scratch masks), a KV cache and metadata built the runtime's
way, the two backends compared on one batch, and the functional kernel's arguments. Test
modules import tests.kernels._interpret before this (it fixes Triton's mode)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from tandem.attention import AttentionMetadata, TorchAttention
from tandem.attention.triton_backend import TritonAttention, mask_inputs
from tandem.kv import KVCache, KVCacheSpec
from tandem.spec.types import Tree
from tests.kernels._interpret import DEVICE

TOL = {  # (atol, rtol): fp32 kernels and oracle agree to rounding; 16-bit P in the P @ V dot
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.6e-2, 2e-2),
}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@dataclass(frozen=True)
class Shape:
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"p{self.page_size}-{self.num_heads}q{self.num_kv_heads}kv-d{self.head_dim}-{dtype}"


@dataclass
class Req:
    """One request of a batch: ``q_len`` new tokens after ``seq_len - q_len`` entries."""

    q_len: int
    seq_len: int
    mask: torch.Tensor | None = None  # [q_len, seq_len - prefix] bool
    prefix: int | None = None  # None: seq_len - q_len


def random_parents(rng: random.Random, n: int) -> tuple[int, ...]:
    return (-1, *(rng.randrange(i) for i in range(1, n)))


def tree_req(rng: random.Random, n: int, context: int) -> Req:
    tree = Tree(tokens=(0,) * n, parents=random_parents(rng, n))
    return Req(q_len=n, seq_len=context + n, mask=tree.ancestor_mask())


def scratch_req(rng: random.Random, q_len: int, scratch: int, context: int) -> Req:
    """Draft scratch entries: each new one sees itself and random earlier scratch entries."""
    width = scratch + q_len
    mask = torch.rand(q_len, width, generator=torch.Generator().manual_seed(rng.randrange(9999)))
    mask = (mask < 0.3).tril_(scratch)
    mask[torch.arange(q_len), scratch + torch.arange(q_len)] = True
    return Req(q_len=q_len, seq_len=context + width, mask=mask, prefix=context)


def make_kv(shape: Shape, num_pages: int, device: torch.device = DEVICE) -> KVCache:
    spec = KVCacheSpec(
        num_layers=1,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        page_size=shape.page_size,
        dtype=shape.dtype,
        device=device,
    )
    kv = KVCache(spec, num_pages)
    g = torch.Generator(device=device).manual_seed(1)
    for cache in (kv.k_caches[0], kv.v_caches[0]):
        cache.copy_(torch.randn(cache.shape, generator=g, device=device))
    return kv


def make_meta(kv: KVCache, reqs: list[Req]) -> AttentionMetadata:
    """Pages handed out round-robin, so every request's pages interleave with the others'."""
    alloc = kv.allocator
    ids = [f"r{i}-{alloc.num_free_pages}" for i in range(len(reqs))]
    for req_id in ids:
        alloc.allocate(req_id, 0)
    page = kv.spec.page_size
    while any(alloc.num_tokens(i) < r.seq_len for i, r in zip(ids, reqs, strict=True)):
        for req_id, r in zip(ids, reqs, strict=True):
            alloc.extend(req_id, min(page, r.seq_len - alloc.num_tokens(req_id)))
    meta = AttentionMetadata.build(
        page_size=page,
        query_lens=[r.q_len for r in reqs],
        seq_lens=[r.seq_len for r in reqs],
        page_table=alloc.page_table(ids, device=kv.spec.device),
        slot_mapping=kv.slot_mapping_tensor(
            ids, [r.seq_len - r.q_len for r in reqs], [r.seq_len for r in reqs]
        ),
        masks=[r.mask for r in reqs],
        prefix_lens=[r.seq_len - r.q_len if r.prefix is None else r.prefix for r in reqs],
    )
    for req_id in ids:
        alloc.free(req_id)
    return meta


def compare_backends(shape: Shape, reqs: list[Req], triton: TritonAttention, seed: int = 0) -> None:
    """Both backends over one batch: outputs within the dtype's tolerance, same cache writes."""
    num_pages = sum(-(-r.seq_len // shape.page_size) for r in reqs) + 1
    kv = make_kv(shape, num_pages, DEVICE)
    meta = make_meta(kv, reqs)
    t = meta.num_tokens
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=DEVICE).to(shape.dtype)

    q = rand(t, shape.num_heads, shape.head_dim)
    k, v = rand(t, shape.num_kv_heads, shape.head_dim), rand(t, shape.num_kv_heads, shape.head_dim)
    caches = (kv.k_caches[0].clone(), kv.v_caches[0].clone())
    scale = shape.head_dim**-0.5
    want = TorchAttention().forward(q, k, v, kv.k_caches[0], kv.v_caches[0], meta, scale)
    got = triton.forward(q, k, v, *caches, meta, scale)
    assert torch.equal(caches[0], kv.k_caches[0]) and torch.equal(caches[1], kv.v_caches[0])
    assert got.isfinite().all()
    assert_close(got, want, shape.dtype)


@dataclass
class Inputs:
    """Arguments of ``tree_attention`` / ``tree_attention_ref``."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    page_table: torch.Tensor  # [bs, max_pages] int32
    query_start_loc: torch.Tensor  # [bs + 1] int64
    seq_lens: torch.Tensor  # [bs] int64
    prefix_lens: torch.Tensor | None  # [bs] int64
    tree_mask: torch.Tensor | None  # [num_tokens, num_words] int64
    scale: float
    page_size: int
    max_q_len: int

    def tensors(self) -> list[torch.Tensor | None]:
        return [getattr(self, f.name) for f in fields(self)][:8]

    def run(self, fn: Callable[..., torch.Tensor], **extra: Any) -> torch.Tensor:
        return fn(
            *self.tensors(),
            scale=self.scale,
            page_size=self.page_size,
            max_q_len=self.max_q_len,
            **extra,
        )


def functional_inputs(shape: Shape, reqs: list[Req], device: torch.device, seed: int = 0) -> Inputs:
    """``reqs`` as the kernel sees them (masked when any request has a mask; the others get
    theirs from the metadata's causal default)."""
    kv = make_kv(shape, sum(-(-r.seq_len // shape.page_size) for r in reqs) + 1, device)
    meta = make_meta(kv, reqs)
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(meta.num_tokens, shape.num_heads, shape.head_dim, generator=g, device=device)
    prefix_lens, tree_mask = mask_inputs(meta, device)
    return Inputs(
        q=q.to(shape.dtype),
        k_cache=kv.k_caches[0],
        v_cache=kv.v_caches[0],
        page_table=meta.page_table,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        prefix_lens=prefix_lens,
        tree_mask=tree_mask,
        scale=shape.head_dim**-0.5,
        page_size=shape.page_size,
        max_q_len=max(r.q_len for r in reqs),
    )
