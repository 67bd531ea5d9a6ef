"""Where a speculating engine's prefill step goes: the target's prefill and the drafter's intake
of the new prompts (``ModelDrafter.step`` with admits), per batch of prompts arriving together.

Writes (or reuses) the preset's random bf16 target and EAGLE-3 head under ``--models-dir``,
builds the in-process engine (K=1, S=3, simulated acceptance), then for each ``--batch-sizes``
entry adds that many ``--prompt-len`` prompts at once and times the step that prefills them
(wall, synchronised) and the drafter's share of it; the last repeat runs under cProfile and the
drafter's heaviest calls are printed.

    python bench/profile_admit.py [--batch-sizes 1,8] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tandem.bench.inprocess import build_engine
from tandem.bench.models import write_preset
from tandem.bench.presets import PRESETS
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/tandem-bench-models"))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument(
        "--kernels", action="store_true", help="also print one prefill step's GPU time by kernel"
    )
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    paths = write_preset(preset, args.models_dir / f"{preset.name}-bfloat16", device="cuda")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = build_engine(
        paths.target,
        paths.draft,
        spec=SpecConfig(num_steps=3, topk=1),
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        num_pages=max(sizes) * (args.prompt_len // 16 + 4) + 64,
        max_batch=max(sizes),
        simulate_accept_length=3.0,
    )
    drafter = engine.drafter
    assert drafter is not None
    spent: list[int] = []
    inner = drafter.step

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return inner(*a, **k)
        finally:
            torch.cuda.synchronize()
            spent.append(time.perf_counter_ns() - t0)

    drafter.step = timed  # type: ignore[method-assign]
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    print(f"{torch.cuda.get_device_name()}, {preset.name}, prompts of {args.prompt_len} tokens")
    for bs in sizes:
        walls, drafts = [], []
        for r in range(args.repeats + 2):
            for i in range(bs):
                prompt = [
                    (7919 * (r * 64 + i + 1) + 31 * j) % (vocab - 4) + 4
                    for j in range(args.prompt_len)
                ]
                engine.add_request(prompt, params)
            torch.cuda.synchronize()
            spent.clear()
            profile = cProfile.Profile() if r == args.repeats + 1 else None
            kernels = None
            if args.kernels and r == args.repeats:
                kernels = torch.profiler.profile(
                    activities=[
                        torch.profiler.ProfilerActivity.CPU,
                        torch.profiler.ProfilerActivity.CUDA,
                    ]
                )
                kernels.start()
            t0 = time.perf_counter_ns()
            if profile is not None:
                profile.enable()
            engine.step()  # the prefill, and the drafter's intake of the prompts
            torch.cuda.synchronize()
            if profile is not None:
                profile.disable()
            if kernels is not None:
                kernels.stop()
                table = kernels.key_averages().table(sort_by="self_device_time_total", row_limit=30)
                print(f"bs {bs}: the prefill step by GPU time\n{table}")
            wall = time.perf_counter_ns() - t0
            while engine.has_unfinished():
                engine.step()
            engine.flush_draft()
            if r >= 2 and profile is None and kernels is None:
                walls.append(wall / 1e6)
                drafts.append(sum(spent) / 1e6)
        print(
            f"bs {bs:3d}: prefill step p50 {statistics.median(walls):7.2f} ms, "
            f"of which the drafter's intake {statistics.median(drafts):7.2f} ms"
        )
        if profile is not None:
            out = io.StringIO()
            stats = pstats.Stats(profile, stream=out).sort_stats("cumulative")
            stats.print_stats(28)
            print(out.getvalue()[-6000:])


if __name__ == "__main__":
    main()
