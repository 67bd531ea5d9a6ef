"""``tandem bench --profile-idle``: where and over which steps the services profile one round
per row (``tandem.serving.profiling`` step windows, armed by a file), and collecting the idle figure
(``tandem.bench.idle``) into the row."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.bench import idle
from tandem.bench.inprocess import Workload
from tandem.bench.report import Row
from tandem.config import EngineConfig
from tandem.serving import profiling


@dataclass(frozen=True, kw_only=True)
class IdleProbe:
    """Where and over which steps the services profile one round per row.

    Steps count from the arm, and the window must close inside the profiled round: a round of
    ``new_tokens`` takes at least ``ceil((new_tokens - 1) / (S + 1))`` decode steps whatever
    the acceptance, so ``start_step`` skips the largest batch's prefill and two steps more,
    ``num_steps`` ends ``_MARGIN`` steps before that bound, and the profiled round is made
    long enough for ten steps where the workload's is shorter."""

    root: Path
    start_step: int
    num_steps: int
    new_tokens: int  # of the profiled round
    services: tuple[str, ...] = ("target", "draft")  # whose windows each round waits for
    timeout_s: float = 60.0  # for the files after the round

    @property
    def arm_file(self) -> Path:
        return self.root / "arm"

    def env(self) -> dict[str, str]:
        self.root.mkdir(parents=True, exist_ok=True)
        return {
            profiling.ENV_DIR: str(self.root),
            profiling.ENV_ARM_FILE: str(self.arm_file),
            profiling.ENV_START_STEP: str(self.start_step),
            profiling.ENV_NUM_STEPS: str(self.num_steps),
        }

    def arm(self, label: str) -> Path:
        out_dir = self.root / label
        profiling.arm(self.arm_file, out_dir)
        return out_dir

    def collect(self, out_dir: Path, row: Row) -> None:
        """Waits for every service's file in ``out_dir``; the idle fractions join ``row``."""
        deadline = time.monotonic() + self.timeout_s
        while absent := idle.missing(out_dir, self.services):
            if time.monotonic() > deadline:
                row.note = f"idle: no profile from {', '.join(absent)} after {self.timeout_s:.0f} s"
                return
            time.sleep(0.1)
        try:
            report = idle.from_dirs([out_dir])
        except ValueError as exc:
            row.note = f"idle: {exc}"
            return
        row.idle_per_device = [d.idle_fraction for d in report.devices]
        for device in report.devices:
            target = [t for p, t in device.turns.items() if p.startswith("target-")]
            if target:
                row.verify_turn_ms, row.turn_period_ms = target[0][0], target[0][1]
        row.gpu_idle = report.to_json()


_MARGIN = 3  # steps between a window's end and the least a round can take


def probe_window(
    w: Workload, max_batch: int, spec_steps: int, start_step: int | None = None
) -> tuple[int, int, int]:
    """(start_step, num_steps, new tokens of the profiled round): see :class:`IdleProbe`.
    The window starts after the prefill and two steps, or at ``start_step`` (steps skipped)."""
    prefill = math.ceil(max_batch * w.prompt_len / EngineConfig.max_num_batched_tokens)
    start = prefill + 2 if start_step is None else start_step

    def decode_steps(new_tokens: int) -> int:
        return math.ceil((new_tokens - 1) / (spec_steps + 1))

    num = max(10, decode_steps(w.new_tokens) - start - _MARGIN)
    new_tokens = max(w.new_tokens, (spec_steps + 1) * (start + num + _MARGIN) + 1)
    return start, num, new_tokens


def plan_probe(
    root: Path, w: Workload, max_batch: int, spec_steps: int, start_step: int | None = None
) -> IdleProbe:
    start, num, new_tokens = probe_window(w, max_batch, spec_steps, start_step)
    return IdleProbe(root=root, start_step=start, num_steps=num, new_tokens=new_tokens)
