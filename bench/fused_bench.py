"""The fused decoder-layer kernels (`kernels/fused.py`) against the eager torch sequences they
replace (`kernels/reference_fused.py`, what `tandem/models/decoder.py` ran before them).

On CUDA: Llama-3.1-8B shapes in bf16 (hidden 4096, 32 q / 8 kv heads of 128, intermediate
14,336) at 1 and 64 tokens, for each op and for one layer's whole elementwise share (two
residual add + RMSNorm, RoPE on q and k, SiLU * up). Timed as in `kernels_bench.py`: CUDA
events, median over `--reps` measurements of `--iters` calls, in a CUDA graph ("graph", the way
the target's decode replays them) and issued from Python ("eager"). Outputs are checked against
the eager torch result first (RoPE and SiLU * up bit for bit). Without CUDA the script runs tiny
shapes in Triton's interpreter to check itself; those timings mean nothing.

    python bench/fused_bench.py [--json] [--iters 20] [--reps 25]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
from kernels_bench import CUDA, DEV, MODE, Row, time_eager, time_graph  # sets Triton's mode

import kernels
from kernels import reference_fused as ref

EPS = 1e-5
# hidden, q heads, kv heads, head_dim, intermediate
SHAPE = (4096, 32, 8, 128, 14336) if CUDA else (64, 4, 2, 16, 96)


def _layer(ops: kernels.Ops, t: dict[str, Any]) -> Any:
    """One layer's elementwise ops in decode order, GEMMs left out."""
    normed, residual = ops.add_rms_norm(t["x"], t["residual"], t["w"], EPS)
    q, k = ops.rope(t["q"], t["k"], t["cos"], t["sin"])
    normed, residual = ops.add_rms_norm(t["x"], residual, t["w"], EPS)
    return normed, q, k, ops.silu_mul(t["gate_up"])


def _check(op: str, got: Any, want: Any, exact: bool) -> None:
    pairs = list(zip(got, want, strict=True)) if isinstance(got, tuple) else [(got, want)]
    for a, b in pairs:
        if exact:
            assert torch.equal(a, b), f"{op}: differs from eager torch"
        else:
            torch.testing.assert_close(a, b, rtol=2**-6, atol=1e-2, msg=f"{op}: too far")


def bench(args: argparse.Namespace) -> list[Row]:
    ops = kernels.triton_ops()
    dtype = torch.bfloat16 if CUDA else torch.float32
    hidden, heads, kv_heads, dim, inter = SHAPE
    g = torch.Generator(device=DEV).manual_seed(0)
    out: list[Row] = []
    for tokens in (1, 64) if CUDA else (1, 3):

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=DEV, generator=g).to(dtype)

        qkv = randn(tokens, (heads + 2 * kv_heads) * dim)
        q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        angles = torch.rand(tokens, dim, device=DEV, generator=g) * 100
        t = {
            "x": randn(tokens, hidden),
            "residual": randn(tokens, hidden),
            "w": randn(hidden),
            "q": q.reshape(tokens, heads, dim),  # strided views, as Attention passes them
            "k": k.reshape(tokens, kv_heads, dim),
            "cos": angles.cos().to(dtype),
            "sin": angles.sin().to(dtype),
            "gate_up": randn(tokens, 2 * inter) * 4,
        }
        cases: list[tuple[str, str, Callable[..., Any], Callable[..., Any], bool]] = [
            ("rms_norm", f"H={hidden}", partial(ref.rms_norm_ref, t["x"], t["w"], EPS),
             partial(ops.rms_norm, t["x"], t["w"], EPS), False),
            ("add_rms_norm", f"H={hidden}",
             partial(ref.add_rms_norm_ref, t["x"], t["residual"], t["w"], EPS),
             partial(ops.add_rms_norm, t["x"], t["residual"], t["w"], EPS), False),
            ("rope", f"q {heads}x{dim} k {kv_heads}x{dim}",
             partial(ref.rope_ref, t["q"], t["k"], t["cos"], t["sin"]),
             partial(ops.rope, t["q"], t["k"], t["cos"], t["sin"]), True),
            ("silu_mul", f"I={inter}", partial(ref.silu_mul_ref, t["gate_up"]),
             partial(ops.silu_mul, t["gate_up"]), True),
            ("layer", "2 add+norm, rope, silu", partial(_layer, kernels.REFERENCE, t),
             partial(_layer, ops, t), False),
        ]  # fmt: skip
        for op, shape, base_fn, fn, exact in cases:
            _check(op, fn(), base_fn(), exact and CUDA)
            shape = f"T={tokens} {shape} {str(dtype).removeprefix('torch.')}"
            base = time_graph(base_fn, args.iters, args.reps)
            graph = time_graph(fn, args.iters, args.reps)
            eager = time_eager(fn, args.iters, args.reps)
            out.append(Row(op, shape, "eager torch", MODE, base, graph, eager))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=20, help="calls per measurement")
    parser.add_argument("--reps", type=int, default=25, help="measurements (median)")
    args = parser.parse_args()
    if not CUDA:
        args.iters, args.reps = 1, 2
        print("no CUDA device: running tiny shapes in Triton's interpreter to check the bench; "
              "the timings mean nothing", file=sys.stderr)  # fmt: skip
    import triton

    device = torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter)"
    rows = bench(args)
    if args.json:
        result = {
            "device": device,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "rows": [asdict(r) | {"speedup": r.speedup} for r in rows],
        }
        print(json.dumps(result, indent=1))
        return 0
    clock = "CUDA events" if CUDA else "perf_counter"
    print(f"{device} | torch {torch.__version__} | triton {triton.__version__} | "
          f"median of {args.reps} x {args.iters} calls, {clock}")  # fmt: skip
    print(f"{'op':<14} {'shape':<40} {'mode':<6} {'torch us':>9} {'kern graph':>10} "
          f"{'kern eager':>10} {'speedup':>8}")  # fmt: skip
    for r in rows:
        print(f"{r.op:<14} {r.shape:<40} {r.baseline_mode:<6} {r.baseline_us:9.1f} "
              f"{r.kernel_graph_us or 0.0:10.1f} {r.kernel_eager_us:10.1f} "
              f"{r.speedup:7.1f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
