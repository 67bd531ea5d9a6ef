"""Triton kernels against their torch baselines: times per call and speedups.

On CUDA: `top1` against torch's argmax + logsumexp at V = 128,256 in bf16 (rows 1, 8, 64,
256; the bar is >= 10x at 1 row and >= 5x at 64), then every other kernel against its
reference in `kernels/reference.py`. Each op is timed with CUDA events as the median over
`--reps` measurements of `--iters` back-to-back calls, after a warmup:

- graph: the calls captured in one CUDA graph and replayed, so launch overhead is gone (how a
  graph runner sees the kernel); for ops whose reference syncs with the host (trees, KV
  compaction) only the kernel can be captured;
- eager: the calls issued from Python, launch overhead and the wrappers' checks included.

Inputs stay in L2 between calls where they fit (the logits of 64 rows do on a GPU with a large
L2).
Ids are checked against the baseline before timing. Without CUDA the script runs the kernels in
Triton's interpreter on tiny shapes, to check itself; those timings mean nothing.

    python bench/kernels_bench.py [--json] [--sweep] [--iters 20] [--reps 25]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before any kernel module defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import kernels  # noqa: E402
from kernels import reference as ref  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
V = 128256 if CUDA else 1000
MODE = "graph" if CUDA else "interp"


@dataclass
class Row:
    op: str
    shape: str
    baseline: str
    baseline_mode: str  # graph or eager (CPU: interp, the interpreter; meaningless)
    baseline_us: float
    kernel_graph_us: float | None  # None: the wrapper syncs, so it cannot be captured
    kernel_eager_us: float

    @property
    def speedup(self) -> float:
        """Baseline over kernel, both timed the baseline's way."""
        if self.baseline_mode != "eager" and self.kernel_graph_us is not None:
            return self.baseline_us / self.kernel_graph_us
        return self.baseline_us / self.kernel_eager_us


def _median_us(run: Callable[[], None], iters: int, reps: int) -> float:
    """Median over `reps` of the mean time of one call when `run` makes `iters` calls."""
    times = []
    if not CUDA:
        for _ in range(reps):
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e6 / iters)
        return statistics.median(times)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def time_eager(fn: Callable[[], Any], iters: int, reps: int) -> float:
    fn()  # compile, allocate
    if CUDA:
        torch.cuda.synchronize()

    def run() -> None:
        for _ in range(iters):
            fn()

    return _median_us(run, iters, reps)


def time_graph(fn: Callable[[], Any], iters: int, reps: int) -> float:
    if not CUDA:
        return time_eager(fn, iters, reps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm up on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return _median_us(graph.replay, iters, reps)


def bench_top1(args: argparse.Namespace, rows_list: tuple[int, ...]) -> list[Row]:
    out = []
    ops = kernels.triton_ops()
    dtype = torch.bfloat16 if CUDA else torch.float32
    for rows in rows_list:
        x = torch.randn(rows, V, device=DEV, dtype=dtype) * 4
        ids, _, valid = ops.top1(x)
        assert valid.all() and torch.equal(ids, x.argmax(dim=-1)), "top1 ids differ from argmax"

        def torch_top1(x: torch.Tensor = x) -> Any:
            return x.argmax(dim=-1), torch.logsumexp(x, dim=-1)

        shape = f"rows={rows} V={V} {_name(dtype)}"
        base = time_graph(torch_top1, args.iters, args.reps)
        ours = time_graph(partial(ops.top1, x), args.iters, args.reps)
        eager = time_eager(partial(ops.top1, x), args.iters, args.reps)
        out.append(Row("top1", shape, "argmax+logsumexp", MODE, base, ours, eager))
        ref_us = time_graph(partial(ref.top1_ref, x), args.iters, args.reps)
        out.append(Row("top1", shape, "top1_ref", MODE, ref_us, ours, eager))
    return out


def bench_others(args: argparse.Namespace) -> list[Row]:
    ops = kernels.triton_ops()
    g = torch.Generator(device=DEV).manual_seed(0)
    out: list[Row] = []
    it, reps = args.iters, args.reps

    def add(op: str, shape: str, base_fn: Callable[[], Any], fn: Callable[[], Any],
            ref_graph: bool, kernel_graph: bool = True) -> None:  # fmt: skip
        """`ref_graph`: the reference can be captured (no host sync), else it runs eager (and
        fewer times: the tree references take milliseconds)."""
        if ref_graph:
            base = time_graph(base_fn, it, reps)
        else:
            base = time_eager(base_fn, max(1, it // 4), max(1, reps // 2))
        graph = time_graph(fn, it, reps) if kernel_graph else None
        mode = MODE if ref_graph or not CUDA else "eager"
        out.append(Row(op, shape, f"{op}_ref", mode, base, graph, time_eager(fn, it, reps)))

    dtype = torch.bfloat16 if CUDA else torch.float32
    for rows in (1, 64) if CUDA else (1, 3):
        x = torch.randn(rows, V, device=DEV, dtype=dtype, generator=g)
        add("topk", f"rows={rows} k=4 V={V}", partial(ref.topk_ref, x, 4),
            partial(ops.topk, x, 4), ref_graph=True)  # fmt: skip
        logits = torch.randn(rows, V, device=DEV, generator=g)
        temperature = torch.ones(rows, device=DEV)
        noise = torch.empty(rows, V, device=DEV).exponential_(generator=g)
        race = (logits, temperature, noise)
        add("sample", f"rows={rows} V={V} fp32", partial(ref.sample_ref, *race),
            partial(ops.sample, *race), ref_graph=True)  # fmt: skip

    bs, n = (64, 16) if CUDA else (3, 8)
    parents = torch.full((bs, n), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(max(0, i - 4), i, (bs,))
    parents, num = parents.to(DEV), torch.full((bs,), n, device=DEV)
    add("build_tree", f"bs={bs} N={n}", lambda: ref.build_tree_ref(parents, num),
        lambda: ops.build_tree(parents, num), ref_graph=False)  # fmt: skip
    depth, _, fc, ns = ref.build_tree_ref(parents, num)
    width = int(depth.max()) + 1
    tokens = torch.randint(0, 2, (bs, n), device=DEV, generator=g)
    target = torch.randint(0, 2, (bs, n), device=DEV, generator=g)
    greedy = (tokens, target, fc, ns, num, width)
    add("verify_greedy", f"bs={bs} N={n}", lambda: ref.verify_greedy_ref(*greedy),
        lambda: ops.verify_greedy(*greedy), ref_graph=False)  # fmt: skip
    sbs = 16 if CUDA else 2
    probs = torch.softmax(torch.randn(sbs, n, V, device=DEV, generator=g), dim=-1)
    coins = torch.rand(sbs, n, device=DEV, generator=g)
    noise = torch.empty(sbs, V, device=DEV).exponential_(generator=g)
    sampling = (tokens[:sbs], probs, coins, noise, fc[:sbs], ns[:sbs], num[:sbs], width)
    add("verify_sampling", f"bs={sbs} N={n} V={V}", lambda: ref.verify_sampling_ref(*sampling),
        lambda: ops.verify_sampling(*sampling), ref_graph=False)  # fmt: skip

    page_size, max_pages = 16, 64
    page_table = torch.randperm(bs * max_pages, device=DEV).view(bs, max_pages).int()
    base_lens = torch.randint(0, 512, (bs,), device=DEV)
    accept_index = torch.stack([torch.arange(width)] * bs).to(DEV)
    accept_index[:, 1:] += 1  # node j+1 moves to j: every pair moves
    accept_len = torch.full((bs,), width, device=DEV)
    slots = (page_table, base_lens, accept_index, accept_len, page_size)
    add("accepted_slots", f"bs={bs} W={width} page={page_size}",
        lambda: ref.accepted_slots_ref(*slots), lambda: ops.accepted_slots(*slots),
        ref_graph=False, kernel_graph=False)  # fmt: skip
    src, dst = ref.accepted_slots_ref(*slots)
    layers, heads, dim = (32, 8, 128) if CUDA else (2, 2, 4)
    pools = [torch.zeros(bs * max_pages * page_size, heads, dim, device=DEV, dtype=dtype)
             for _ in range(2 * layers)]  # fmt: skip
    add("compact_accepted", f"{2 * layers} caches x {len(src)} pairs",
        lambda: ref.compact_accepted_ref(pools, src, dst),
        lambda: ops.compact_accepted(pools, src, dst), ref_graph=False)  # fmt: skip
    for tokens_n in (64, 4096) if CUDA else (5,):
        k = torch.randn(tokens_n, heads, dim, device=DEV, dtype=dtype, generator=g)
        slot_mapping = torch.randperm(len(pools[0]), device=DEV)[:tokens_n]
        store = (k, k, pools[0], pools[1], slot_mapping)
        add("store_kv", f"tokens={tokens_n} H={heads} D={dim}",
            partial(ref.store_kv_ref, *store), partial(ops.store_kv, *store),
            ref_graph=True)  # fmt: skip
    return out


def sweep_top1(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Split counts and tiles for `top1` (graph timings), to retune `default_splits`."""
    from kernels.top1 import default_splits, launch_top1

    out = []
    for rows in (1, 8, 64, 256) if CUDA else (1,):
        x = torch.randn(rows, V, device=DEV, dtype=torch.bfloat16 if CUDA else torch.float32)
        for block in (1024, 2048):
            for splits in sorted({8, 16, 32, 64, 128, default_splits(rows, V, block)}):
                call = partial(launch_top1, x, num_splits=splits, block=block)
                us = time_graph(call, args.iters, args.reps)
                out.append({"rows": rows, "block": block, "splits": splits, "us": us})
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sweep", action="store_true", help="also sweep top1's split counts")
    parser.add_argument("--iters", type=int, default=20, help="calls per measurement")
    parser.add_argument("--reps", type=int, default=25, help="measurements (median)")
    args = parser.parse_args()
    if not CUDA:
        args.iters, args.reps = 1, 2
        print("no CUDA device: running tiny shapes in Triton's interpreter to check the bench; "
              "the timings mean nothing", file=sys.stderr)  # fmt: skip
    import triton

    device = torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter)"
    rows = bench_top1(args, (1, 8, 64, 256) if CUDA else (1, 3))
    rows += bench_others(args)
    sweep = sweep_top1(args) if args.sweep else []
    bars = {r: next(x for x in rows if x.shape.startswith(f"rows={r} ") and x.op == "top1")
            for r in (1, 64) if CUDA}  # fmt: skip
    verdict = {
        "top1 rows=1 >= 10x": bars[1].speedup >= 10 if CUDA else None,
        "top1 rows=64 >= 5x": bars[64].speedup >= 5 if CUDA else None,
    }
    if args.json:
        result = {
            "device": device,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "rows": [asdict(r) | {"speedup": r.speedup} for r in rows],
            "bars": verdict,
            "sweep": sweep,
        }
        print(json.dumps(result, indent=1))
        return 0
    clock = "CUDA events" if CUDA else "perf_counter"
    print(f"{device} | torch {torch.__version__} | triton {triton.__version__} | "
          f"median of {args.reps} x {args.iters} calls, {clock}")  # fmt: skip
    print(f"{'op':<16} {'shape':<30} {'baseline':<20} {'mode':<6} {'base us':>9} "
          f"{'kern graph':>10} {'kern eager':>10} {'speedup':>8}")  # fmt: skip
    for r in rows:
        graph = f"{r.kernel_graph_us:10.1f}" if r.kernel_graph_us is not None else f"{'-':>10}"
        print(f"{r.op:<16} {r.shape:<30} {r.baseline:<20} {r.baseline_mode:<6} "
              f"{r.baseline_us:9.1f} {graph} {r.kernel_eager_us:10.1f} "
              f"{r.speedup:7.1f}x")  # fmt: skip
    for name, ok in verdict.items():
        print(f"{name}: {'n/a (no CUDA)' if ok is None else ('PASS' if ok else 'FAIL')}")
    if sweep:
        print(f"\ntop1 sweep (graph us)\n{'rows':>6} {'block':>6} {'splits':>7} {'us':>9}")
        for s in sweep:
            print(f"{s['rows']:6d} {s['block']:6d} {s['splits']:7d} {s['us']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
