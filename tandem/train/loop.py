"""The optimisation loop every trainer runs: AdamW, warm-up + cosine, clipping, progress.

One step: ``step_fn()`` returns the loss, the tokens it covered and named metrics; the loop
backpropagates, clips, steps and prints a progress line every ``log_every`` steps (step, loss,
metrics, lr, tokens/s, elapsed). Compute runs under bf16 autocast on CUDA and in float32 on CPU;
parameters stay float32.

Time budget: with ``max_seconds`` the cosine runs on elapsed time instead of steps (from the
end of warm-up to ``max_seconds``) and the loop stops when the time is up (or after ``steps``),
so a stage never overruns by more than a step whatever its speed. The steps actually run are
returned and recorded by the callers: passing them as ``steps`` without a budget repeats the
run with the step-based cosine (the same curve when the speed was steady).
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

StepFn = Callable[[], tuple[torch.Tensor, int, dict[str, torch.Tensor]]]
Log = Callable[[str], None]


def log_stdout(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """Optimiser and schedule of one training stage."""

    steps: int  # total steps, or the most a time budget may plan
    lr: float
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0  # applied to matrices only
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    max_seconds: float | None = None  # time budget for this stage (cosine over time)
    log_every: int = 50

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: must be >= 1, got {self.steps}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.log_every < 1:
            raise ValueError("warmup_steps/log_every: must be >= 0 / >= 1")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds: must be > 0 when given, got {self.max_seconds}")

    def lr_at(self, step: int, progress: float) -> float:
        """Linear warm-up over the first ``warmup_steps`` steps, then a cosine from ``lr`` to
        ``lr * min_lr_ratio`` over ``progress`` in [0, 1]."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def progress(self, step: int) -> float:
        """Cosine progress after ``step`` steps of a run of ``steps`` (no budget)."""
        return (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)


@dataclass
class LoopResult:
    steps: int  # steps run
    seconds: float
    tokens: int
    final_loss: float  # mean training loss over the last logging window
    metrics: dict[str, float] = field(default_factory=dict)  # same window


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # every device's generator


def autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA; nothing (float32) elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def optimizer(params: list[nn.Parameter], settings: LoopSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms, biases or 1-D tensors)."""
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    fused = bool(params) and params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, fused=fused)


def run(
    name: str,
    params: list[nn.Parameter],
    step_fn: StepFn,
    settings: LoopSettings,
    *,
    log: Log = log_stdout,
) -> LoopResult:
    """Trains ``params`` for ``settings.steps`` steps or until ``settings.max_seconds``."""
    opt = optimizer(params, settings)
    budget = settings.max_seconds
    start = time.perf_counter()
    warm_end: float | None = None  # elapsed seconds when warm-up ended (budgeted runs)
    tokens = window_tokens = window_steps = step = 0
    window_start = start
    sums: dict[str, torch.Tensor] = {}  # on the device: read back only when logging
    last: dict[str, float] = {}
    while step < settings.steps:
        elapsed = time.perf_counter() - start
        if budget is None:
            progress = settings.progress(step)
        else:
            if elapsed >= budget:
                break
            if step >= settings.warmup_steps and warm_end is None:
                warm_end = elapsed
            progress = 0.0 if warm_end is None else (elapsed - warm_end) / (budget - warm_end)
        lr = settings.lr_at(step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, num_tokens, metrics = step_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip > 0:
            nn.utils.clip_grad_norm_(params, settings.grad_clip)
        opt.step()
        step += 1
        tokens += num_tokens
        window_tokens += num_tokens
        window_steps += 1
        for key, value in {"loss": loss, **metrics}.items():
            value = value.detach().float()
            sums[key] = sums[key] + value if key in sums else value
        if step % settings.log_every == 0 or step == settings.steps:
            last = {k: float(v) / window_steps for k, v in sums.items()}  # syncs the device
            now = time.perf_counter()
            shown = " ".join(f"{k} {v:.4f}" for k, v in last.items())
            rate = window_tokens / max(now - window_start, 1e-9)
            of = (
                f"/{settings.steps}" if budget is None else f" ({budget - (now - start):.0f}s left)"
            )
            log(
                f"[{name}] step {step}{of} {shown} lr {lr:.2e} tok/s {rate:,.0f} "
                f"elapsed {now - start:.1f}s"
            )
            sums, window_steps, window_tokens, window_start = {}, 0, 0, now
    if sums:  # the partial window of a budgeted stop
        last = {k: float(v) / window_steps for k, v in sums.items()}
    seconds = time.perf_counter() - start
    final_loss = last.pop("loss", float("nan"))
    return LoopResult(
        steps=step, seconds=seconds, tokens=tokens, final_loss=final_loss, metrics=last
    )


def chunks(n: int, size: int) -> Iterator[slice]:
    """Slices of ``range(n)`` of at most ``size`` (evaluation batches)."""
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))
