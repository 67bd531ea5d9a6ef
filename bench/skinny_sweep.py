"""Sweeps ``kernels.skinny.skinny_linear``'s tile and pipeline settings against cuBLAS
(``F.linear``) on the 8B shape's decode matmuls, weights stored transposed as the engine
keeps them; times as ``bench/linear_layouts.py`` (a CUDA graph of 20 calls on distinct
weights, best of 5), us per call.

    python bench/skinny_sweep.py [--rows 1] [--top 5]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from kernels.skinny import skinny_linear

SHAPES = {
    "qkv": (4096, 6144),
    "o_proj": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}
COPIES = 20


def time_us(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x, w) for w in weights]
    del outs
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / len(weights))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1")
    p.add_argument("--top", type=int, default=4)
    args = p.parse_args()
    configs = list(itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8), (3, 4, 6)))
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, us per call")
    for name, (k, n) in SHAPES.items():
        plain = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        weights = [w.t().contiguous().t() for w in plain]
        del plain
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0])
            base = time_us(F.linear, weights, x)
            results = []
            for bn, bk, warps, stages in configs:

                def fn(x, w, bn=bn, bk=bk, warps=warps, stages=stages):  # type: ignore[no-untyped-def]
                    return skinny_linear(
                        x, w, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages
                    )

                try:
                    err = (fn(x, weights[0]).float() - ref.float()).abs().max().item()
                    results.append((time_us(fn, weights, x), bn, bk, warps, stages, err))
                except Exception as e:
                    results.append((float("inf"), bn, bk, warps, stages, repr(e)[:40]))
            results.sort(key=lambda r: r[0])
            size = n * k * 2  # bytes of one weight

            def gbs(us: float, size: int = size) -> float:
                return size / us / 1e3

            print(f"{name} rows={m}: cuBLAS {base:.1f} us ({gbs(base):.0f} GB/s)")
            for us, bn, bk, warps, stages, err in results[: args.top]:
                tiles = f"BLOCK_N={bn} BLOCK_K={bk} warps={warps} stages={stages}"
                print(f"   {us:6.1f} us ({gbs(us):.0f} GB/s) {tiles} max |err| {err}")
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
