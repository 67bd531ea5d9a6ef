"""A step-window profiler for service loops: ``torch.profiler`` over N steps, written out as
device-busy intervals on the host's wall clock, so that the windows of several processes
sharing a GPU can be merged (``tandem.bench.idle``; docs/performance.md, "GPU idle").

Configured by the environment; a loop builds one with :func:`step_window` (None when off) and
calls :meth:`StepWindow.step` once at the end of each of its steps, :meth:`StepWindow.idle`
when it has no work and :meth:`StepWindow.close` when the service stops; a follower (below)
also calls :meth:`StepWindow.begin` at the start of each step and :meth:`StepWindow.wait`
when it had no step for a while. All on the loop's thread, where the profiler runs:

| variable | meaning | default |
|---|---|---|
| ``TANDEM_PROFILE_DIR`` | where windows are written; unset: profiling off | - |
| ``TANDEM_PROFILE_START_STEP`` | steps to skip before the window (warm-up) | 50 |
| ``TANDEM_PROFILE_NUM_STEPS`` | steps in the window | 50 |
| ``TANDEM_PROFILE_ARM_FILE`` | count steps only once this file appears (see :func:`arm`) | - |

Without an arm file a process profiles one window, counted from its first step. With one, it
waits for the file to be written (one there when the process starts is a leftover, ignored),
profiles a window counted from there into the directory the file names, and waits for the
file to be written again (a new inode) for the next window: a benchmark places windows inside
the rounds it chooses without restarting the services.

A window that its steps do not close is written anyway, and says how it closed (``closed``
and ``num_steps`` in the file): a loop with no work left (the target between rounds) writes
it as it stands (``idle``; with an arm file only), and so does a stopping service (``stop``).

A loop whose steps another process drives follows instead of counting (``follow``; with an
arm file only). The draft service steps when its target sends it work, which is not once per
target step: a batch's prompts take it one long step while the target decodes on with K=0,
and a target decoding with K=0 sends it nothing (``tandem.target.exchange``). Counted in its
own steps, its window under ``tandem bench --profile-idle`` never ended in a K=0 round (the
bench waited for a file that never came) and, speculating, could open after the target's had
closed. A follower notices an arm before its next step, or in a ``wait`` if no step comes;
its window opens at its last step's end or at the arm, whichever is later (no step of its ran
in between), with the profiler running from there, and ends at the first step or ``wait``
that finds another process's window in the directory (``follow``). So it covers the
counting process's window, with every step it ran in it.

Clock. ``torch.profiler``'s ``kineto_results.events()`` report ``start_ns()``/``end_ns()`` in
nanoseconds since the Unix epoch on ``CLOCK_REALTIME``, i.e. ``time.time_ns()``, for host and
device events alike: CPU ops are stamped with the TSC and converted by kineto's
``ApproximateClockToUnixTimeConverter`` (calibrated against ``clock_gettime(CLOCK_REALTIME)``);
CUPTI records are stamped either by CUPTI's default Linux clock (``CLOCK_REALTIME``) or, with
kineto's TSC timestamp callback (CUDA >= 11.6, the default), by the TSC and converted by the
same converter (``convertCuptiTimestamp`` in libkineto). ``FunctionEvent.time_range`` (what
``prof.events()`` gives) is the same value minus ``kineto_results.trace_start_ns()``, so it is
relative to each process's own trace start: this module reads ``kineto_results`` instead and
writes the absolute values. ``CLOCK_REALTIME`` is one clock for every process on the host, so
intervals from two processes line up; the file also carries ``realtime_minus_monotonic_ns`` to
move them onto ``CLOCK_MONOTONIC``. Checked on CPU (torch 2.13): every ``aten::mm`` event of a
profiled loop lies inside the ``time.time_ns()`` bracket taken around its call
(``tests/unit/test_idle.py``). A wall-clock step (NTP) inside a window would shift it; windows
are a second or so, so this is not corrected.

Costs: off, one ``is not None`` in the loop. On, kineto's one-time set-up (seconds) runs when
the loop builds its window, the profiler starts ``WARMUP_STEPS`` before the window (CUPTI's
start-up and first records are slow) and the window's file is written on the loop's
thread right after it (a few hundred ms for tens of thousands of kernels): the step after a
window is slow, the window itself is not. A follower's profiler starts at the arm (before the
round, where CUPTI's start-up costs nothing) and records until the other window is written;
while armed it lists the directory once a step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from tandem.serving import profile_file

logger = logging.getLogger(__name__)

ENV_DIR = "TANDEM_PROFILE_DIR"
ENV_START_STEP = "TANDEM_PROFILE_START_STEP"
ENV_NUM_STEPS = "TANDEM_PROFILE_NUM_STEPS"
ENV_ARM_FILE = "TANDEM_PROFILE_ARM_FILE"

WARMUP_STEPS = 2  # the profiler runs this many steps before the window opens


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    out_dir: Path  # where windows are written (an armed window may name another)
    start_step: int = 50  # steps skipped before the window (after arming, with an arm file)
    num_steps: int = 50
    arm_file: Path | None = None

    def __post_init__(self) -> None:
        if self.start_step < 1:
            raise ValueError(f"start_step: must be >= 1, got {self.start_step}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps: must be >= 1, got {self.num_steps}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ProfileConfig | None:
        """The configuration in ``env``; None when ``TANDEM_PROFILE_DIR`` is unset or empty."""
        out_dir = env.get(ENV_DIR)
        if not out_dir:
            return None
        arm_file = env.get(ENV_ARM_FILE)
        return cls(
            out_dir=Path(out_dir),
            start_step=_int(env, ENV_START_STEP, 50),
            num_steps=_int(env, ENV_NUM_STEPS, 50),
            arm_file=Path(arm_file) if arm_file else None,
        )


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {text!r}") from None


def step_window(service: str, device: str, *, follow: bool = False) -> StepWindow | None:
    """The loop's profiler as the environment configures it; None when profiling is off.
    ``follow``: a loop whose steps another process drives (see :class:`StepWindow`)."""
    config = ProfileConfig.from_env()
    return None if config is None else StepWindow(service, device, config, follow=follow)


def arm(arm_file: Path, out_dir: Path) -> None:
    """Asks every process watching ``arm_file`` for a window written into ``out_dir``.

    Written to a temporary name and renamed, so a reader sees all of it or nothing, and every
    arm is a new inode (which is what a waiting process looks for)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = arm_file.with_name(f".{arm_file.name}.{os.getpid()}.tmp")
    tmp.write_text(str(out_dir.resolve()))
    os.replace(tmp, arm_file)


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


class StepWindow:
    """Counts a loop's steps and profiles ``num_steps`` of them after ``start_step``; or, with
    ``follow`` and an arm file, profiles from the arm until another process's window is in
    the directory (see the module docstring)."""

    def __init__(
        self, service: str, device: str, config: ProfileConfig, *, follow: bool = False
    ) -> None:
        self.service = service
        self.device = device
        self.config = config
        self.follow = follow and config.arm_file is not None
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self.windows_written: list[Path] = []
        self._done = False  # without an arm file: one window per process
        self._armed = config.arm_file is None
        self._served: tuple[int, int] | None = None  # (inode, mtime) of the last arm used
        if config.arm_file is not None:  # one there before the process is a leftover
            self._served = _signature(config.arm_file)
        self._out_dir = config.out_dir
        self._ticks = 0  # steps ended since arming
        self._profiler: profile | None = None
        self._opened_at: int | None = None  # the tick the window opened after; None: not open
        self._window_start_ns = 0
        self._quiet_since_ns = time.time_ns()  # no step since: the last one's end (or the arm)
        # Kineto's first start takes seconds (its one-time set-up): pay it here, not in a round.
        # CPU only: CUPTI's own start-up is left to the warm-up steps, on the loop's thread.
        with profile(activities=[ProfilerActivity.CPU]):
            pass

    def begin(self) -> None:
        """Called at the start of each loop step of a follower: an arm seen here opens the
        window before the step, so that the step is in it. Never raises (none of these do):
        a profiler failure is logged and ends profiling in this process, the service goes on."""
        if self.follow:
            self._guarded(self._begin)

    def step(self) -> None:
        """Called once at the end of each loop step."""
        self._guarded(self._step)

    def wait(self) -> None:
        """Called by a follower between steps, every so often (whether or not a step ran
        since: it looks at what a step's start and end would): notices an arm and ends a
        window as a step would, so a loop sent no work still does. Call it once the loop is
        loaded (its loading is no step: an arm during it would see the window open too
        early)."""
        if self.follow:
            self._guarded(self._wait)

    def idle(self) -> None:
        """The loop has no work (no request runs): a window counted from an arm and not
        closed by its steps is written as it stands. Arm-file mode only: without one, the
        process's one window may span several requests."""
        self._guarded(self._idle)

    def close(self) -> None:
        """The service stops: a window still open is written as it stands."""
        self._guarded(self._close)

    def _guarded(self, fn: Callable[[], None]) -> None:
        if self._done:
            return
        try:
            fn()
        except Exception:
            logger.exception("%s: profiling failed; profiling is off from now on", self.service)
            self._done = True
            self._profiler = None

    def _begin(self) -> None:
        if not self._armed and self._poll_arm():
            self._open_following()

    def _step(self) -> None:
        if self.follow:
            if self._armed:
                self._ticks += 1
                if self._others_written():
                    self._finish("follow")
        elif not self._armed:
            self._armed = self._poll_arm()
        else:
            self._ticks += 1
            start = self.config.start_step
            if self._profiler is None and self._ticks >= max(1, start - WARMUP_STEPS):
                self._start_profiler()
            if self._ticks == start:
                self._open(time.time_ns())  # after the profiler's own start-up
            if self._ticks == start + self.config.num_steps:
                self._finish("steps")
        self._quiet_since_ns = time.time_ns()

    def _wait(self) -> None:
        if not self._armed:
            if not self._poll_arm():
                return
            self._open_following()
        if self._others_written():
            self._finish("follow")

    def _idle(self) -> None:
        if self.config.arm_file is not None and self._pending():
            self._finish("idle")

    def _close(self) -> None:
        if self._pending():
            self._finish("stop")

    def _pending(self) -> bool:
        """A window is counting (steps since an arm) or open, and not written yet."""
        return self._armed and (self._ticks > 0 or self._opened_at is not None)

    def _open_following(self) -> None:
        """A follower just armed, between steps: its window opens where its last step
        ended (or at the arm, if later), since no step ran in between."""
        self._armed = True
        self._start_profiler()
        self._open(self._quiet_since_ns)

    def _start_profiler(self) -> None:
        # On CUDA only the device timeline: recording every CPU op of a busy service
        # would cost host time (and post-processing) the window is meant to measure.
        activities = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
        self._profiler = profile(activities=activities)
        self._profiler.start()

    def _open(self, start_ns: int) -> None:
        self._opened_at = self._ticks
        self._window_start_ns = start_ns

    def _poll_arm(self) -> bool:
        assert self.config.arm_file is not None
        signature = _signature(self.config.arm_file)
        if signature is None or signature == self._served:
            return False
        try:
            text = self.config.arm_file.read_text().strip()
        except FileNotFoundError:
            return False
        self._served = signature
        self._out_dir = Path(text) if text else self.config.out_dir
        self._ticks = 0
        # A follower polls before each step and while waiting, so no step of its began after
        # the arm was written: its window may start at the arm or its last step's end.
        self._quiet_since_ns = max(self._quiet_since_ns, signature[1])
        return True

    def _path(self) -> Path:
        return self._out_dir / f"{self.service}-{os.getpid()}.json"

    def _others_written(self) -> bool:
        own = self._path().name
        return any(f.name != own for f in self._out_dir.glob("*.json"))

    def _finish(self, closed: str) -> None:
        end_ns = time.time_ns()
        events: list[Any] = []
        if self._profiler is not None:
            self._profiler.stop()
            results = self._profiler.profiler.kineto_results if self._profiler.profiler else None
            events = results.events() if results is not None else []
            self._profiler = None
        if self._opened_at is None:  # closed before its first step: it holds none
            self._open(self._quiet_since_ns)
        assert self._opened_at is not None
        steps = (self._opened_at + 1, self._ticks)
        path = profile_file.write(
            self._path(),
            profile_file.Window(
                service=self.service,
                device=self.device,
                cuda=self.cuda,
                start_ns=self._window_start_ns,
                end_ns=end_ns,
                steps=steps,
                closed=closed,
            ),
            events,
        )
        self.windows_written.append(path)
        logger.info(
            "%s: profiled %d steps from step %d into %s (closed: %s)",
            self.service,
            steps[1] - steps[0] + 1,
            steps[0],
            path,
            closed,
        )
        self._opened_at = None
        if self.config.arm_file is None:
            self._done = True
        else:
            self._armed = False
