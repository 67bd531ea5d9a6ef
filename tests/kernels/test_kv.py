"""The Triton KV writes (`store_kv`, `compact_accepted`) against their references: odd token
counts and head sizes, K/V sliced out of a fused projection, dtype conversion into the pool,
padding slots (-1), page sizes 1 and 16, overlapping moves, caches of mixed dtypes and row
sizes in one call, and the references' validation errors. The `gpu` tests add bf16 pools,
slot offsets past 2**31 elements and a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.kv import _store_kv_kernel, compact_accepted, store_kv
from kernels.reference import accepted_slots_ref, compact_accepted_ref, store_kv_ref

check_mode(_store_kv_kernel)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def kv_pair(num_tokens: int, heads: int, dim: int, seed: int, device: torch.device) -> tuple:
    """K as a slice of a fused QKV projection (token stride 3 * heads * dim), V contiguous."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 3, heads, dim, generator=g).to(device)
    return qkv[:, 1], torch.randn(num_tokens, heads, dim, generator=g).to(device)


@pytest.mark.parametrize(
    ("num_tokens", "heads", "dim", "src_dtype", "cache_dtype"),
    [
        (7, 2, 5, torch.float32, torch.float32),
        (1, 1, 1, torch.float32, torch.float16),
        (13, 3, 24, torch.float16, torch.float16),
        (5, 8, 130, torch.float32, torch.float16),  # rows wider than one tile
    ],
)
def test_store_kv_matches_reference(
    num_tokens: int, heads: int, dim: int, src_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    k, v = kv_pair(num_tokens, heads, dim, seed=num_tokens, device=DEVICE)
    k, v = k.to(src_dtype), v.to(src_dtype)
    num_slots = 3 * num_tokens + 5
    g = torch.Generator().manual_seed(dim)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens].to(DEVICE)
    caches = [torch.randn(num_slots, heads, dim, generator=g).to(cache_dtype) for _ in range(2)]
    ours = [c.to(DEVICE) for c in caches]
    ref = [c.clone().to(DEVICE) for c in caches]
    store_kv(k, v, ours[0], ours[1], slots)
    store_kv_ref(k, v, ref[0], ref[1], slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_store_kv_skips_padding_slots() -> None:
    k, v = kv_pair(6, 2, 4, seed=1, device=DEVICE)
    slots = torch.tensor([3, -1, 0, 9, -1, 99], device=DEVICE)  # 99 is past the pool
    caches = [torch.zeros(10, 2, 4, device=DEVICE) for _ in range(2)]
    ref = [c.clone() for c in caches]
    store_kv(k, v, caches[0], caches[1], slots)
    keep = torch.tensor([0, 2, 3], device=DEVICE)
    store_kv_ref(k[keep], v[keep], ref[0], ref[1], slots[keep])
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


def test_store_kv_rejects_what_the_reference_rejects() -> None:
    k, v = kv_pair(3, 2, 4, seed=2, device=DEVICE)
    cache = torch.zeros(8, 2, 4, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    cases = [
        (k, v, cache, cache, slots.int(), "dtype"),
        (k, v[:2], cache, cache, slots, "shape"),
        (k, v, cache[:, :1], cache, slots, "shape"),
        (k, v, cache, cache.half(), slots, "dtype"),
    ]
    for *args, match in cases:
        for fn in (store_kv, store_kv_ref):
            with pytest.raises(ValueError, match=match):
                fn(*args)


def paths_and_slots(page_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Accepted paths as the verifier produces them, with overlapping sources and targets."""
    g = torch.Generator().manual_seed(page_size)
    paths = [[0, 2, 3], [0, 1, 2, 3], [0, 3, 5, 6], [0], [0, 4], [0, 7, 8, 9, 10]]
    base_lens = torch.tensor([5, 30, 14, 0, 15, 40])  # 14 and 15 straddle a page at 16
    bs, width = len(paths), 6
    max_pages = -(-64 // page_size)
    num_pages = bs * max_pages + 3
    page_table = torch.randperm(num_pages, generator=g)[: bs * max_pages].view(bs, max_pages)
    accept_index = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
    accept_len = torch.tensor([len(p) for p in paths])
    src, dst = accepted_slots_ref(page_table.int(), base_lens, accept_index, accept_len, page_size)
    return src.to(device), dst.to(device), num_pages * page_size


@pytest.mark.parametrize("page_size", [1, 16])
def test_compact_accepted_matches_reference(page_size: int) -> None:
    src, dst, num_slots = paths_and_slots(page_size, DEVICE)
    g = torch.Generator().manual_seed(3)
    caches = [
        torch.randn(num_slots, 2, 3, generator=g),
        torch.randn(num_slots, 2, 3, generator=g).half(),
        torch.randn(num_slots, 2, 3, generator=g),
        torch.randn(num_slots, 5, generator=g),  # another row size: its own launch
        torch.randn(num_slots, 2, 3, generator=g).half(),
    ]
    ours = [c.to(DEVICE) for c in caches]
    ref = [c.clone().to(DEVICE) for c in caches]
    before = ours[0].clone()
    compact_accepted(ours, src, dst)
    compact_accepted_ref(ref, src, dst)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], before)  # something moved


def test_compact_accepted_chains_of_overlapping_moves() -> None:
    """Random pairs with distinct targets whose sources are other pairs' targets."""
    g = torch.Generator().manual_seed(4)
    num_slots, pairs = 200, 150
    dst = torch.randperm(num_slots, generator=g)[:pairs]
    src = torch.where(torch.rand(pairs, generator=g) < 0.7, dst[torch.randperm(pairs)], dst)
    cache = torch.randn(num_slots, 4, generator=g).to(DEVICE)
    ref = cache.clone()
    compact_accepted([cache], src.to(DEVICE), dst.to(DEVICE))
    compact_accepted_ref([ref], src.to(DEVICE), dst.to(DEVICE))
    assert torch.equal(cache, ref)


def test_compact_accepted_rejects_what_the_reference_rejects() -> None:
    cache = torch.zeros(4, 2, device=DEVICE)

    def t(*values: int) -> torch.Tensor:
        return torch.tensor(values, device=DEVICE)

    cases = [
        ([cache], t(0, 1), t(2, 2), "distinct"),
        ([cache], t(4), t(1), "outside"),
        ([cache], t(1).int(), t(0), "dtype"),
        ([cache, "x"], t(1), t(0), "caches\\[1\\]"),
    ]
    for caches, src, dst, match in cases:
        for fn in (compact_accepted, compact_accepted_ref):
            with pytest.raises(ValueError, match=match):
                fn(caches, src, dst)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        compact_accepted([cache, cache], t(1), t(0))


# ----------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@gpu
def test_kv_kernels_past_int32_offsets_on_cuda() -> None:
    """A bf16 pool of 2**20 + 64 slots x 2048 elements: slot * row overflows int32."""
    heads, dim = 16, 128
    num_slots = 2**20 + 64
    k_cache = torch.zeros(num_slots, heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k, v = kv_pair(4, heads, dim, seed=5, device=torch.device("cuda"))
    slots = torch.tensor([num_slots - 1, 2**20 + 3, 17, -1], device="cuda")
    store_kv(k, v, k_cache, v_cache, slots)
    for i, s in enumerate(slots[:3].tolist()):
        assert torch.equal(k_cache[s], k[i].bfloat16()) and torch.equal(v_cache[s], v[i].bfloat16())
    src = torch.tensor([num_slots - 1, 17], device="cuda")
    dst = torch.tensor([5, num_slots - 2], device="cuda")
    want = [c.clone() for c in (k_cache, v_cache)]
    compact_accepted_ref(want, src, dst)
    compact_accepted([k_cache, v_cache], src, dst)
    assert torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_kernels_bf16_and_graph_on_cuda(page_size: int) -> None:
    src, dst, num_slots = paths_and_slots(page_size, torch.device("cuda"))
    caches = [torch.randn(num_slots, 8, 128, device="cuda").bfloat16() for _ in range(8)]
    ref = [c.clone() for c in caches]
    compact_accepted(caches, src, dst)
    compact_accepted_ref(ref, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref, strict=True))
    k, v = kv_pair(9, 8, 128, seed=6, device=torch.device("cuda"))
    slots = torch.randperm(num_slots, device="cuda")[:9]
    store_kv(k, v, caches[0], caches[1], slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k, v, caches[0], caches[1], slots)
    k.copy_(torch.randn_like(k))
    graph.replay()
    store_kv_ref(k, v, ref[0], ref[1], slots)
    assert torch.equal(caches[0][slots], ref[0][slots])
