"""A lone prompt's prefill step: wall time per prompt length, and where one step's time goes.

Builds a random model of a preset's shape in memory (no checkpoint written) and an ``Engine``
without a draft, then per ``--prompt-lens`` entry runs prompts one at a time (each alone in its
step, ``max_new_tokens=1``) and reports the median wall time from ``add_request`` to the
request's end, synchronised. One 128-token (or the first length's) prefill then runs under
``torch.profiler``: GPU busy time, kernel count, the top GPU kernels and host ops.
``--prefill-graph-tokens off`` measures the eager prefill (``tandem/target/prefill_graphs.py``).

    python bench/profile_prefill.py [--preset llama-3.1-8b] [--prompt-lens 16,128,512]
                                    [--prefill-graph-tokens off]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_decode import random_model

from tandem.bench.presets import PRESETS
from tandem.config import PREFILL_GRAPH_TOKENS, EngineConfig
from tandem.sampling import SamplingParams
from tandem.target.engine import Engine


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--prompt-lens", default="16,128,512")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill-graph-tokens", default=",".join(map(str, PREFILL_GRAPH_TOKENS)))
    args = p.parse_args(argv)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    widths = (
        ()
        if args.prefill_graph_tokens == "off"
        else tuple(int(n) for n in args.prefill_graph_tokens.split(","))
    )
    model = random_model(args.preset, "cuda", torch.bfloat16, None)
    config = EngineConfig(
        model=Path("in-memory"),
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=4,
        max_model_len=max(lens) + 64,
        num_pages=(max(lens) + 64) // 16 * 4,
        prefill_graph_tokens=widths,
    )
    engine = Engine(config, model)
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def prefill(n: int, salt: int) -> float:
        prompt = [(7919 * (salt + 1) + 31 * j) % (vocab - 4) + 4 for j in range(n)]
        engine.add_request(prompt, params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    print(f"{torch.cuda.get_device_name()}, {args.preset}, prefill graphs {widths or 'off'}")
    for n in lens:
        for s in range(3):  # warm-up (compiles, cuBLAS heuristics)
            prefill(n, s)
        walls = [prefill(n, 10 + s) for s in range(args.repeats)]
        print(f"prefill {n:5d} tokens: wall p50 {statistics.median(walls):7.2f} ms")
    n = 128 if 128 in lens else lens[0]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        prefill(n, 99)
    gpu: dict[str, float] = defaultdict(float)
    host: dict[str, float] = defaultdict(float)
    count = 0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            gpu[evt.name[:70]] += evt.device_time
            count += 1
        else:
            host[evt.name[:70]] += evt.self_cpu_time_total
    print(f"prefill {n} tokens: GPU busy {sum(gpu.values()) / 1e3:.2f} ms, {count} kernels")
    for name, us in sorted(gpu.items(), key=lambda t: -t[1])[:8]:
        print(f"  gpu  {us / 1e3:7.3f} ms  {name}")
    for name, us in sorted(host.items(), key=lambda t: -t[1])[:8]:
        print(f"  host {us / 1e3:7.3f} ms  {name}")


if __name__ == "__main__":
    main()
