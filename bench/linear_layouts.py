"""Decode-size matmuls of the 8B shape in both weight layouts, on CUDA: ``F.linear(x, W)``
with W stored [out, in] (row-major, as checkpoints) and with W stored as the transpose of a
row-major [in, out] tensor (``DecoderLM.use_transposed_weights``). Each figure is one call's
time from a CUDA graph of 20 calls on distinct weights (no weight stays in L2), in us, and
the bandwidth it reaches over the weight's bytes.

    python bench/linear_layouts.py [--rows 1,8,32,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (in, out), Llama-3.1-8B
    "qkv": (4096, 6144),
    "o_proj": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
COPIES = 20


def time_us(weights: list[torch.Tensor], x: torch.Tensor) -> float:
    out = [F.linear(x, w) for w in weights]  # warm-up, and cuBLAS picks its kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = [F.linear(x, w) for w in weights]
    del out
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
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    results = []
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, us per call")
    print(f"{'shape':>8} {'rows':>5} {'[out,in]':>10} {'W^T':>10} {'GB/s best':>10}")
    for name, (k, n) in SHAPES.items():
        copies = COPIES if name != "lm_head" else 4
        plain = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        transposed = [w.t().contiguous().t() for w in plain]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, b = time_us(plain, x), time_us(transposed, x)
            gbs = n * k * 2 / min(a, b) / 1e3
            print(f"{name:>8} {m:>5} {a:>10.1f} {b:>10.1f} {gbs:>10.0f}")
            results.append({"shape": name, "rows": m, "plain_us": a, "transposed_us": b})
        del plain, transposed
        torch.cuda.empty_cache()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
