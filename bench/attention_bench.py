"""Paged tree attention on CUDA: the Triton backend against the torch reference and SDPA.

Per case (decode: 1 query per request; verify: a random tree of N nodes per request) and
batch size / context, one attention layer is timed as the runtime calls it: the backends'
``forward`` (storing the new tokens' K/V, then attending through the page table) for
``TritonAttention`` (split count chosen per batch, and forced to 1) and ``TorchAttention``;
and ``F.scaled_dot_product_attention`` over contiguous, unpaged K/V as a baseline (no store,
no page table; a boolean mask for trees). Every method is captured in a CUDA graph of
``--iters`` calls, so launch overhead is excluded, and successive calls read different pages
(rotating over enough copies that their KV exceeds L2). GB/s = KV bytes read / time.

    python bench/attention_bench.py [--dtype bfloat16] [--heads 32 --kv-heads 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import default_num_splits
from tandem.attention import AttentionBackend, AttentionMetadata, TorchAttention
from tandem.attention.triton_backend import TritonAttention
from tandem.config import torch_dtype
from tandem.spec.types import Tree

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
L2_BYTES = 256 << 20  # rotate over at least this much KV per graph: several times a GPU's L2


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "verify"
    batch_size: int
    context: int  # committed tokens before this step's queries
    num_nodes: int  # queries per request


@dataclass(frozen=True)
class Geometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype


def time_us(calls: list[Callable[[], object]], iters: int) -> float:
    """Median time of one call, from a CUDA graph of ``iters`` calls cycling over ``calls``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph: compiles, caches plans
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            calls[i % len(calls)]()
    graph.replay()
    samples = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(samples)


def random_trees(case: Case, rng: random.Random) -> list[Tree]:
    """One tree per request (a single node for decode), parents among the 3 previous nodes."""
    trees = []
    for _ in range(case.batch_size):
        parents = (-1, *(rng.randrange(max(0, i - 3), i) for i in range(1, case.num_nodes)))
        trees.append(Tree(tokens=(0,) * case.num_nodes, parents=parents))
    return trees


def timed(name: str, calls: list[Callable[[], object]], iters: int) -> float:
    """``time_us``, or NaN with a note on stderr when a method cannot run this case."""
    try:
        return time_us(calls, iters)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0]}", file=sys.stderr)
        torch.cuda.synchronize()
        return float("nan")


def run_case(case: Case, geo: Geometry, iters: int) -> dict[str, float]:
    rng = random.Random(0)
    dev = torch.device("cuda")
    seq_len = case.context + case.num_nodes
    pages_per_req = -(-seq_len // geo.page_size)
    kv_bytes = case.batch_size * seq_len * geo.num_kv_heads * geo.head_dim * 2 * geo.dtype.itemsize
    rotations = max(1, min(8, -(-L2_BYTES // kv_bytes)))
    num_pages = rotations * case.batch_size * pages_per_req + 1
    shape = (num_pages * geo.page_size, geo.num_kv_heads, geo.head_dim)
    k_cache = torch.randn(shape, device=dev, dtype=geo.dtype)
    v_cache = torch.randn(shape, device=dev, dtype=geo.dtype)
    num_tokens = case.batch_size * case.num_nodes
    q = torch.randn(num_tokens, geo.num_heads, geo.head_dim, device=dev, dtype=geo.dtype)
    k = torch.randn(num_tokens, geo.num_kv_heads, geo.head_dim, device=dev, dtype=geo.dtype)
    v = torch.randn_like(k)
    trees = random_trees(case, rng)
    masks = [t.ancestor_mask() if case.kind == "verify" else None for t in trees]
    pages = torch.randperm(num_pages - 1) + 1
    metas = []
    for r in range(rotations):
        table = pages[r * case.batch_size * pages_per_req :][: case.batch_size * pages_per_req]
        table = table.view(case.batch_size, pages_per_req).to(torch.int32)
        pos = torch.arange(case.context, seq_len)
        slots = table[:, pos // geo.page_size].long() * geo.page_size + pos % geo.page_size
        metas.append(
            AttentionMetadata.build(
                page_size=geo.page_size,
                query_lens=[case.num_nodes] * case.batch_size,
                seq_lens=[seq_len] * case.batch_size,
                page_table=table.to(dev),
                slot_mapping=slots.reshape(-1).to(dev),
                masks=masks,
            )
        )
    scale = geo.head_dim**-0.5

    def backend_calls(make: Callable[[], AttentionBackend]) -> list[Callable[[], object]]:
        def call(backend: AttentionBackend, meta: AttentionMetadata) -> Callable[[], object]:
            return lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale)

        return [call(make(), meta) for meta in metas]

    # SDPA over contiguous K/V: [bs, kv_heads, seq, d] per rotation, queries [bs, heads, N, d].
    qs = q.view(case.batch_size, case.num_nodes, geo.num_heads, geo.head_dim).transpose(1, 2)
    dense_kv = [
        (
            torch.randn(
                case.batch_size,
                geo.num_kv_heads,
                seq_len,
                geo.head_dim,
                device=dev,
                dtype=geo.dtype,
            ),
            torch.randn(
                case.batch_size,
                geo.num_kv_heads,
                seq_len,
                geo.head_dim,
                device=dev,
                dtype=geo.dtype,
            ),
        )
        for _ in range(rotations)
    ]
    sdpa_mask = None
    if case.kind == "verify":
        sdpa_mask = torch.ones(case.batch_size, 1, case.num_nodes, seq_len, dtype=torch.bool)
        sdpa_mask[:, 0, :, case.context :] = torch.stack([m for m in masks if m is not None])
        sdpa_mask = sdpa_mask.to(dev)

    def sdpa(keys: torch.Tensor, values: torch.Tensor) -> Callable[[], object]:
        return lambda: F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=sdpa_mask, scale=scale, enable_gqa=True
        )

    sdpa_calls = [sdpa(keys, values) for keys, values in dense_kv]
    splits = default_num_splits(
        batch_size=case.batch_size,
        max_q_len=case.num_nodes,
        num_heads=geo.num_heads,
        num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_dim,
        max_kv_len=seq_len,
        num_sms=torch.cuda.get_device_properties(dev).multi_processor_count,
    )
    return {
        "splits": float(splits),  # what TritonAttention picks for this batch
        "triton": timed("triton", backend_calls(TritonAttention), iters),
        "triton_1split": timed(
            "triton 1 split", backend_calls(lambda: TritonAttention(num_splits=1)), iters
        ),
        "torch": timed("torch", backend_calls(TorchAttention), iters),
        "sdpa": timed("sdpa", sdpa_calls, iters),
        "kv_bytes": float(kv_bytes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--tree-size", type=int, default=16, help="N of the verify cases")
    parser.add_argument("--iters", type=int, default=20, help="calls per CUDA graph")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_bench: needs a CUDA device (the Triton kernels are GPU-only here)")
    geo = Geometry(
        args.heads, args.kv_heads, args.head_dim, args.page_size, torch_dtype(args.dtype)
    )
    cases = [
        Case(kind, bs, ctx, 1 if kind == "decode" else args.tree_size)
        for kind in ("decode", "verify")
        for ctx in (1024, 4096)
        for bs in (1, 8, 32, 64)
    ]
    print(
        f"{torch.cuda.get_device_name()} | {args.dtype} | {geo.num_heads}q/{geo.num_kv_heads}kv "
        f"heads, head_dim {geo.head_dim}, page {geo.page_size} | one layer, us per call"
    )
    header = (
        f"{'case':<8}{'bs':>4}{'ctx':>6}{'splits':>7}{'triton':>9}{'1-split':>9}{'torch':>9}"
        f"{'sdpa':>9}{'GB/s':>8}{'x torch':>8}{'x sdpa':>8}"
    )
    print(header)
    print("-" * len(header))
    for case in cases:
        r = run_case(case, geo, args.iters)
        print(
            f"{case.kind:<8}{case.batch_size:>4}{case.context:>6}{int(r['splits']):>7}"
            f"{r['triton']:>9.1f}{r['triton_1split']:>9.1f}{r['torch']:>9.1f}{r['sdpa']:>9.1f}"
            f"{r['kv_bytes'] / 1e3 / r['triton']:>8.0f}{r['torch'] / r['triton']:>8.1f}"
            f"{r['sdpa'] / r['triton']:>8.1f}"
        )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
