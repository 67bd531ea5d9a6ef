"""Compiles every Triton kernel launch of the wrappers for sm_90 (Hopper) without a GPU.

Run as a script in its own process (Triton must not be in interpreter mode):
``python -m tests.kernels._sm90``. Each wrapper runs on CPU tensors with `JITFunction.run`
replaced by a compile-only stub, so the launches it would make (signature from the argument
dtypes, constexprs, launch options) go through Triton's full pipeline down to a cubin. Catches
what the interpreter cannot: type errors in loop-carried values, unsupported ops, bad layouts.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "u1",
}


def _compile_instead_of_launch() -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    compiled: list[str] = []
    seen: set[str] = set()

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        bound = dict(zip(self.arg_names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        for param in self.params:
            value = bound[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + _DTYPES[value.dtype]
            elif isinstance(value, bool):
                signature[param.name] = "u1"
            elif isinstance(value, int):
                signature[param.name] = param.annotation_type or "i32"
            elif isinstance(value, float):
                signature[param.name] = "fp32"
            else:
                raise TypeError(f"{self.fn.__name__}.{param.name}: {type(value).__name__}")
        key = f"{self.fn.__name__} {sorted(signature.items())} {constexprs} {options}"
        if key in seen:
            return
        seen.add(key)
        source = ASTSource(fn=self, signature=signature, constexprs=constexprs)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        compiled.append(f"{self.fn.__name__} {constexprs} {options}")

    JITFunction.run = run
    return compiled


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")
    compiled = _compile_instead_of_launch()
    from kernels import triton_ops
    from kernels.reference import build_tree_ref
    from kernels.top1 import launch_top1

    ops = triton_ops()
    bf16 = torch.randn(64, 128256).bfloat16()
    launch_top1(bf16[:1])  # many splits
    launch_top1(bf16)
    launch_top1(torch.randn(4096, 1000))  # one split
    ops.topk(bf16[:4], 8)
    ops.sample(bf16[:2], torch.tensor([0.0, 1.0]), torch.rand(2, 128256))
    ops.sample(torch.randn(4096, 100), torch.ones(4096), torch.rand(4096, 100))
    parents, num = torch.tensor([[-1, 0, 0, 1]]), torch.tensor([4])
    ops.build_tree(parents, num)
    _, _, fc, ns = build_tree_ref(parents, num)
    ids = torch.zeros(1, 4, dtype=torch.int64)
    ops.verify_greedy(ids, ids, fc, ns, num, 3)
    probs = torch.full((1, 4, 50), 0.02)
    ops.verify_sampling(ids, probs, torch.rand(1, 4), torch.ones(1, 50), fc, ns, num, 3)
    ops.verify_sampling(
        ids, probs, torch.rand(1, 4).double(), torch.ones(1, 50).double(), fc, ns, num, 3
    )
    page_table = torch.zeros(2, 4, dtype=torch.int32)
    index, lens = torch.tensor([[0, 1], [0, -1]]), torch.tensor([2, 1])
    ops.accepted_slots(page_table, torch.tensor([1, 2]), index, lens, 16)
    kv = torch.randn(3, 8, 128).bfloat16()
    pools = [torch.zeros(100, 8, 128, dtype=torch.bfloat16) for _ in range(4)]
    ops.store_kv(kv, kv, pools[0], pools[1], torch.tensor([1, 5, -1]))
    ops.store_kv(kv.float(), kv.float(), pools[0], pools[1], torch.tensor([1, 5, -1]))
    ops.compact_accepted(pools, torch.tensor([2, 3]), torch.tensor([1, 2]))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, w = torch.randn(3, 4096).to(dtype), torch.randn(4096).to(dtype)
        ops.rms_norm(x, w, 1e-6)
        ops.add_rms_norm(x, x, w, 1e-6)
        ops.rms_norm(x.view(3, 32, 128), w[:128], 1e-6)  # q/k norm: many rows per program
        qkv = torch.randn(3, 48 * 128).to(dtype)
        q, k = qkv[:, : 32 * 128].view(3, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(3, 8, 128)
        ops.rope(q, k, x[:, :128], x[:, :128])
        ops.silu_mul(torch.randn(3, 2 * 14336).to(dtype))
    for line in compiled:
        print("compiled for sm_90:", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
