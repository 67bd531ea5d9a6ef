"""The 8B shape's decode matmuls on CUDA, us per call (a CUDA graph of 20 calls on distinct
weights, so no weight stays in L2; best of 5):

- ``--layouts``: cuBLAS (``F.linear``) with the weight stored ``[out, in]`` (as checkpoints)
  and as the transpose of a row-major ``[in, out]`` (``DecoderLM.use_transposed_weights``);
- otherwise: ``kernels.skinny.skinny_linear``'s tile and pipeline settings swept against
  cuBLAS, weights stored transposed as the engine keeps them (``kernels.skinny._config``
  holds the fastest per shape).

    python bench/skinny_sweep.py [--rows 1] [--top 4] [--layouts]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from kernels.skinny import skinny_linear

SHAPES = {  # name: (in, out), Llama-3.1-8B
    "qkv": (4096, 6144),
    "o_proj": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}
LM_HEAD = (4096, 128256)
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
    p.add_argument("--layouts", action="store_true", help="cuBLAS in both weight layouts")
    args = p.parse_args()
    if args.layouts:
        layouts([int(r) for r in args.rows.split(",")])
        return
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


def layouts(rows: list[int]) -> None:
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, us per call")
    print(f"{'shape':>8} {'rows':>5} {'[out,in]':>10} {'W^T':>10} {'GB/s best':>10}")
    for name, (k, n) in [*SHAPES.items(), ("lm_head", LM_HEAD)]:
        plain = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(COPIES if name != "lm_head" else 4)
        ]
        transposed = [w.t().contiguous().t() for w in plain]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, b = time_us(F.linear, plain, x), time_us(F.linear, transposed, x)
            print(f"{name:>8} {m:>5} {a:>10.1f} {b:>10.1f} {n * k * 2 / min(a, b) / 1e3:>10.0f}")
        del plain, transposed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
