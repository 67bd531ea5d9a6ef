"""Where a target-only decode step's time goes: host phases and GPU kernels.

Builds a random model of a preset's shape in memory (no checkpoint written), runs an
``Engine`` without a draft over ``--batch-size`` requests, then over ``--steps`` decode steps
reports the wall time per step, the host time per phase (schedule, prepare, forward launch,
verify, commit, postprocess), and from a ``torch.profiler`` window the GPU kernels per step,
GPU busy time per step and the kernels that take most of it.

    python bench/profile_decode.py --preset llama-3.1-8b --batch-size 1 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.bench.models import llama_config
from tandem.bench.presets import PRESETS
from tandem.config import EngineConfig
from tandem.models import DecoderLM
from tandem.models.config import ModelConfig
from tandem.sampling import SamplingParams
from tandem.target.engine import Engine


def random_model(preset: str, device: str, dtype: torch.dtype, num_layers: int | None) -> DecoderLM:
    overrides = dict(PRESETS[preset].target)
    if num_layers is not None:
        overrides["num_hidden_layers"] = num_layers
    config = ModelConfig.from_hf(llama_config(overrides, "bfloat16"))
    with torch.device("meta"):
        model = DecoderLM(config)
    model.to_empty(device=device)
    model.to(dtype)
    model.rotary.inv_freq = torch.tensor(config.inv_freq, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


class PhaseTimer:
    """Wraps methods so their host time is summed per phase name."""

    def __init__(self) -> None:
        self.ns: dict[str, list[int]] = defaultdict(list)

    def wrap(self, obj: object, attr: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                with torch.profiler.record_function(phase.strip()):  # named in --trace's trace
                    return inner(*args, **kwargs)
            finally:
                self.ns[phase].append(time.perf_counter_ns() - t0)

        setattr(obj, attr, timed)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's context bound (graph split counts follow it); default: just enough",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode ahead (tandem/target/ahead.py): launch each step before reading the last",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    model = random_model(args.preset, args.device, dtype[args.dtype], args.layers)
    on_cuda = args.device.startswith("cuda")
    total = args.prompt_len + args.steps * 2 + 64
    config = EngineConfig(
        model=Path("in-memory"),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.batch_size, 1),
        max_model_len=args.max_model_len or total,
        num_pages=args.batch_size * (-(-total // 16) + 1) + 8,
        cuda_graphs=on_cuda and not args.no_graphs,
        overlap=args.overlap,
    )
    engine = Engine(config, model)
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=args.steps * 2 + 16, ignore_eos=True)
    for i in range(args.batch_size):
        prompt = [(7919 * (i + 1) + 31 * j) % (vocab - 4) + 4 for j in range(args.prompt_len)]
        engine.add_request(prompt, params)
    for _ in range(8):  # prefill + warm-up
        engine.step()

    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "prepare", "prepare")
    timer.wrap(engine.runner, "prepare_ahead", "prepare (ahead)")
    timer.wrap(engine.runner, "forward", "forward (launch)")
    timer.wrap(engine, "_verify", "verify")
    timer.wrap(engine, "_commit", "commit")
    timer.wrap(engine.scheduler, "postprocess", "postprocess")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    sync()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter_ns()
        engine.step()
        walls.append(time.perf_counter_ns() - t0)
    sync()

    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        sync()
    kernels: dict[str, list[float]] = defaultdict(list)
    busy_us = 0.0
    count = 0
    for evt in prof.events():
        if on_cuda and evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name].append(evt.device_time)
            busy_us += evt.device_time
            count += 1
    n = args.profile_steps
    wall_ms = statistics.median(walls) / 1e6
    result = {
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "preset": args.preset,
        "layers": model.config.num_layers,
        "batch_size": args.batch_size,
        "graphs": config.use_cuda_graphs,
        "overlap": config.overlap,
        "ahead_steps": engine.ahead.launches,
        "step_ms_median": wall_ms,
        "host_ms_per_phase": {k: statistics.median(v) / 1e6 for k, v in timer.ns.items()},
        "gpu_kernels_per_step": count / n,
        "gpu_busy_ms_per_step": busy_us / n / 1e3,
        "top_kernels_ms_per_step": sorted(
            ((name[:90], sum(v) / n / 1e3, len(v) / n) for name, v in kernels.items()),
            key=lambda t: -t[1],
        )[:25],
    }
    print(
        f"device {result['device']}, bs {args.batch_size}, graphs {result['graphs']}, "
        f"overlap {config.overlap} ({engine.ahead.launches} steps decoded ahead)"
    )
    print(f"step (wall, median)     {wall_ms:8.3f} ms")
    for phase, ms in result["host_ms_per_phase"].items():
        print(f"  host {phase:18s} {ms:8.3f} ms")
    print(f"GPU kernels per step    {result['gpu_kernels_per_step']:8.1f}")
    print(f"GPU busy per step       {result['gpu_busy_ms_per_step']:8.3f} ms")
    for name, ms, calls in result["top_kernels_ms_per_step"]:
        print(f"  {ms:7.3f} ms {calls:6.1f}x  {name}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
