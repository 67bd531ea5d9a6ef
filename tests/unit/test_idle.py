"""GPU idle from step-window profiles: the interval math on hand-made intervals, the profiler's
clock (kineto's event times are ``time.time_ns()``), and a real two-process profile on CPU
through the arm file, merged."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.bench import idle
from tandem.bench.idle import Profile
from tandem.bench.inprocess import Workload
from tandem.bench.probe import _MARGIN, probe_window
from tandem.bench.report import Row, table
from tandem.serving import profiling

REPO = Path(__file__).resolve().parents[2]


def _profile(name: str, window: tuple[int, int], **intervals: list[tuple[int, int]]) -> Profile:
    return Profile(
        process=name,
        timeline="gpu_kernels",
        window=window,
        labels={k: f"{k} GPU" for k in intervals},
        intervals=dict(intervals),
    )


def test_union_merges_overlapping_nested_and_touching() -> None:
    got = idle.union([(50, 60), (10, 20), (15, 30), (12, 14), (30, 35), (40, 40), (70, 71)])
    assert got == [(10, 35), (50, 60), (70, 71)]  # (40, 40) is empty: dropped
    assert idle.union([]) == []


def test_gaps_and_busy_with_edges_and_overhang() -> None:
    window = (0, 100)
    busy = [(-5, 10), (15, 30), (20, 25), (50, 60), (95, 120)]
    assert idle.gaps(busy, window) == [(10, 15), (30, 50), (60, 95)]
    assert idle.busy_ns(busy, window) == 10 + 15 + 10 + 5
    # Idle at both edges.
    assert idle.gaps([(40, 60)], window) == [(0, 40), (60, 100)]
    assert idle.gaps([], window) == [(0, 100)]
    assert idle.gaps([(0, 100)], window) == []
    assert idle.clip([(-10, -1), (101, 200), (90, 110)], window) == [(90, 100)]


def test_two_processes_two_devices() -> None:
    # The target on gpu0, the draft on gpu0 and gpu1 (say a copy), windows offset.
    target = _profile("target-1", (0, 1000), gpu0=[(0, 400), (500, 700)])
    draft = _profile("draft-2", (100, 1100), gpu0=[(350, 450), (800, 850)], gpu1=[(100, 600)])
    report = idle.analyse([target, draft], top=2)
    assert report.window_start_ns == 100 and report.window_ms == 900 / 1e6
    gpu0, gpu1 = report.devices
    assert (gpu0.device, gpu1.device) == ("gpu0", "gpu1")
    # gpu0 over [100, 1000): busy 100..450, 500..700, 800..850 = 350 + 200 + 50.
    assert gpu0.busy_ms == 600 / 1e6
    assert gpu0.idle_fraction == pytest.approx(1 - 600 / 900)
    assert gpu0.num_gaps == 3  # 450..500, 700..800, 850..1000
    assert gpu0.num_long_gaps == 0 and gpu0.long_gap_idle_share == 0.0
    assert gpu0.largest_gaps == [(750 / 1e6, 150 / 1e6), (600 / 1e6, 100 / 1e6)]
    assert gpu0.busy_by_process == pytest.approx({"target-1": 500 / 900, "draft-2": 150 / 900})
    assert gpu1.idle_fraction == pytest.approx(1 - 500 / 900)
    assert gpu1.busy_by_process["target-1"] == 0.0
    text = idle.format_report(report)
    assert "gpu0 GPU: idle 33.3%" in text and "target-1 55.6%" in text


def test_turns_of_two_processes_sharing_a_device() -> None:
    """A device-chain run on one GPU: the target's verify, then the draft's half, in turns;
    kernels of one turn merge (a gap inside a turn stays in it), the period is start to start."""
    target = _profile("target-1", (0, 100), gpu=[(0, 30), (32, 40), (50, 90)])
    draft = _profile("draft-2", (0, 100), gpu=[(42, 45), (46, 48), (92, 95)])
    (gpu,) = idle.analyse([target, draft]).devices
    assert gpu.turns["target-1"] == [40 / 1e6, 50 / 1e6, 2.0]  # [0, 40) and [50, 90)
    assert gpu.turns["draft-2"] == [4.5 / 1e6, 50 / 1e6, 2.0]  # [42, 48) and [92, 95)
    assert "turns (median ms, period ms, count)" in idle.format_report(
        idle.analyse([target, draft])
    )
    # One process alone, or one turn each: no turns.
    assert idle.turns({"target-1": [(0, 30), (50, 90)]}, (0, 100)) == {}
    assert idle.turns({"a-1": [(0, 10)], "b-2": [(20, 30)]}, (0, 100)) == {}


def test_long_gaps() -> None:
    ms = 1_000_000
    busy = [(0, ms), (ms + 5_000, 2 * ms), (3 * ms, 4 * ms)]  # a 5 us gap, a 1 ms gap
    (gpu,) = idle.analyse([_profile("t-1", (0, 4 * ms), gpu=busy)]).devices
    assert (gpu.num_gaps, gpu.num_long_gaps) == (2, 1)
    assert gpu.long_gap_idle_share == pytest.approx(ms / (ms + 5_000))


def test_windows_that_do_not_overlap_are_refused() -> None:
    with pytest.raises(ValueError, match="do not overlap"):
        idle.common_window([_profile("a-1", (0, 10)), _profile("b-2", (10, 20))])
    with pytest.raises(ValueError, match="none given"):
        idle.common_window([])


def test_config_from_env() -> None:
    assert profiling.ProfileConfig.from_env({}) is None
    config = profiling.ProfileConfig.from_env(
        {profiling.ENV_DIR: "/x", profiling.ENV_NUM_STEPS: "7", profiling.ENV_ARM_FILE: "/x/a"}
    )
    assert config == profiling.ProfileConfig(
        out_dir=Path("/x"), start_step=50, num_steps=7, arm_file=Path("/x/a")
    )
    with pytest.raises(ValueError, match=profiling.ENV_START_STEP):
        profiling.ProfileConfig.from_env({profiling.ENV_DIR: "/x", profiling.ENV_START_STEP: "a"})
    with pytest.raises(ValueError, match="start_step"):
        profiling.ProfileConfig(out_dir=Path("/x"), start_step=0)


def test_kineto_times_are_time_ns(tmp_path: Path) -> None:
    """Each profiled op lies inside the time.time_ns() bracket taken around it, and the file
    holds exactly the window's steps."""
    config = profiling.ProfileConfig(out_dir=tmp_path, start_step=2, num_steps=4)
    window = profiling.StepWindow("unit", "cpu", config)
    x = torch.randn(64, 64)
    brackets = []
    for _ in range(8):
        before = time.time_ns()
        torch.mm(x, x)
        brackets.append((before, time.time_ns()))
        window.step()
    (path,) = window.windows_written
    assert path == tmp_path / f"unit-{os.getpid()}.json"
    record = json.loads(path.read_text())
    assert record["timeline"] == "cpu_ops" and record["window"]["first_step"] == 3
    assert record["event_kinds"]["CPU/cpu_op"] >= 4
    mm = record["names"].index("aten::mm")
    spans = [(r[1], r[2]) for r in record["intervals"] if r[0] == mm]
    assert len(spans) == 4  # steps 3..6: the warm-up steps' ops are dropped
    for start, end in spans:
        assert any(lo <= start <= end <= hi for lo, hi in brackets), (start, end)
    window.step()  # one window per process without an arm file
    assert len(window.windows_written) == 1


_LOOP = """
import sys, time, torch
from tandem.serving import profiling
window = profiling.step_window(sys.argv[1], "cpu")
x = torch.randn(96, 96)
print("ready", flush=True)
deadline = time.monotonic() + 20
while not window.windows_written and time.monotonic() < deadline:
    for _ in range(3):
        x = torch.tanh(x @ x)
    time.sleep(0.005)  # idle between steps, as a host stall would be
    window.step()
print(window.windows_written[0] if window.windows_written else "none", flush=True)
"""


@contextlib.contextmanager
def _profiled(
    tmp_path: Path, arm: Path, scripts: list[tuple[str, str]]
) -> Iterator[tuple[dict[str, str], list[subprocess.Popen[str]]]]:
    """``python -c code arg`` per script, profiling from ``arm`` (a window of steps 3-23);
    yields once every one printed "ready", kills them all on the way out."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        profiling.ENV_DIR: str(tmp_path / "default"),
        profiling.ENV_ARM_FILE: str(arm),
        profiling.ENV_START_STEP: "3",
        profiling.ENV_NUM_STEPS: "20",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, arg],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for code, arg in scripts
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield env, procs
    finally:
        for p in procs:
            p.kill()


@pytest.mark.e2e
def test_two_processes_through_the_arm_file(tmp_path: Path) -> None:
    arm = tmp_path / "arm"
    profiling.arm(arm, tmp_path / "leftover")  # from an earlier run: ignored
    with _profiled(tmp_path, arm, [(_LOOP, "target"), (_LOOP, "draft")]) as (env, procs):
        time.sleep(0.2)  # stepping, unarmed: nothing is written
        assert not (tmp_path / "default").exists()
        assert not list((tmp_path / "leftover").iterdir())
        out_dir = tmp_path / "bs1"
        profiling.arm(arm, out_dir)
        written = [p.communicate(timeout=25)[0].strip() for p in procs]
    files = idle.profile_files([out_dir])
    assert [str(f) for f in files] == sorted(written)
    profiles = [idle.load(f) for f in files]
    lo, hi = idle.common_window(profiles)  # the windows overlap
    assert hi - lo > 0
    report = idle.from_dirs([out_dir])
    (cpu,) = report.devices
    assert cpu.label == "cpu" and report.timeline == "cpu_ops"
    assert 0.0 < 1.0 - cpu.idle_fraction <= 1.0
    assert cpu.num_gaps >= 1
    assert set(cpu.busy_by_process) == {p.process for p in profiles}
    assert all(0.0 < share <= 1.0 for share in cpu.busy_by_process.values())
    done = subprocess.run(
        [sys.executable, "-m", "tandem.bench.idle", str(out_dir), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["devices"][0]["idle_fraction"] == cpu.idle_fraction


def _armed_window(
    tmp_path: Path, start_step: int = 2, *, follow: bool = False
) -> profiling.StepWindow:
    config = profiling.ProfileConfig(
        out_dir=tmp_path / "default", start_step=start_step, num_steps=50, arm_file=tmp_path / "arm"
    )
    return profiling.StepWindow("unit", "cpu", config, follow=follow)


def _mm_steps(window: profiling.StepWindow, n: int) -> None:
    x = torch.randn(32, 32)
    for _ in range(n):
        window.begin()
        torch.mm(x, x)
        window.step()


def _mm_spans(record: dict[str, Any]) -> int:
    if "aten::mm" not in record["names"]:
        return 0
    mm = record["names"].index("aten::mm")
    return sum(1 for r in record["intervals"] if r[0] == mm)


def test_a_window_its_round_does_not_close_is_written_when_the_loop_idles(tmp_path: Path) -> None:
    window = _armed_window(tmp_path)
    window.idle()  # not armed: nothing to write
    profiling.arm(tmp_path / "arm", tmp_path / "r1")
    window.wait()  # a counting window ignores waits (and begins): its steps place it
    _mm_steps(window, 5)  # the arming step, then steps 1-4 of a window of 3-52
    window.idle()
    (path,) = window.windows_written
    record = json.loads(path.read_text())
    assert record["window"] | {"start_ns": 0, "end_ns": 0} == {
        "start_ns": 0,
        "end_ns": 0,
        "first_step": 3,
        "last_step": 4,
        "num_steps": 2,
        "closed": "idle",
    }
    assert _mm_spans(record) == 2  # steps 3 and 4
    window.idle()
    _mm_steps(window, 3)  # written: the loop waits for the next arm
    assert len(window.windows_written) == 1
    # A round shorter than the skipped steps: a window without steps, after the last one.
    profiling.arm(tmp_path / "arm", tmp_path / "r2")
    _mm_steps(window, 2)
    last_step_end = time.time_ns()
    window.idle()
    record = json.loads(window.windows_written[1].read_text())
    assert record["window"]["num_steps"] == 0 and record["window"]["closed"] == "idle"
    assert record["window"]["start_ns"] <= last_step_end <= record["window"]["end_ns"]
    assert record["intervals"] == []


def test_without_an_arm_file_idle_leaves_the_window_alone(tmp_path: Path) -> None:
    config = profiling.ProfileConfig(out_dir=tmp_path, start_step=1, num_steps=5)
    window = profiling.StepWindow("unit", "cpu", config, follow=True)
    assert not window.follow  # nothing to follow from: it counts
    _mm_steps(window, 3)
    window.idle()  # its one window may span several requests
    window.wait()
    assert window.windows_written == []
    window.close()  # the service stops: written as it stands
    (path,) = window.windows_written
    assert json.loads(path.read_text())["window"]["closed"] == "stop"
    assert json.loads(path.read_text())["window"]["num_steps"] == 2


def test_a_follower_profiles_from_the_arm_until_another_window_is_written(
    tmp_path: Path,
) -> None:
    window = _armed_window(tmp_path, start_step=50, follow=True)
    window.wait()  # no arm: nothing
    profiling.arm(tmp_path / "arm", tmp_path / "r1")
    armed_ns = os.stat(tmp_path / "arm").st_mtime_ns
    window.wait()  # opens at the arm, the profiler on; no other window yet
    window.wait()
    _mm_steps(window, 3)  # its steps are in the window, however few (not 50 + 50)
    assert window.windows_written == []
    (tmp_path / "r1" / "target-1.json").write_text("{}")  # another process's window
    _mm_steps(window, 1)  # the step that finds it ends the window
    (path,) = window.windows_written
    record = json.loads(path.read_text())
    assert record["window"]["closed"] == "follow" and record["window"]["num_steps"] == 4
    assert record["window"]["first_step"] == 1 and record["window"]["start_ns"] == armed_ns
    assert _mm_spans(record) == 4
    window.wait()  # waits for the next arm
    _mm_steps(window, 2)
    assert len(window.windows_written) == 1
    # Armed between steps: the next step's begin opens the window, so that step is in it.
    profiling.arm(tmp_path / "arm", tmp_path / "r2")
    last_step_end = time.time_ns()
    _mm_steps(window, 1)
    (tmp_path / "r2" / "target-1.json").write_text("{}")
    window.wait()
    record = json.loads(window.windows_written[1].read_text())
    assert record["window"]["closed"] == "follow" and record["window"]["num_steps"] == 1
    assert record["window"]["start_ns"] <= last_step_end and _mm_spans(record) == 1
    window.close()  # nothing open
    assert len(window.windows_written) == 2


def test_close_writes_an_open_window(tmp_path: Path) -> None:
    window = _armed_window(tmp_path)
    profiling.arm(tmp_path / "arm", tmp_path / "r1")
    _mm_steps(window, 4)
    window.close()
    (path,) = window.windows_written
    record = json.loads(path.read_text())
    assert record["window"]["closed"] == "stop" and record["window"]["num_steps"] == 1


_FOLLOWER = """
import sys, time, torch
from tandem.serving import profiling
window = profiling.step_window("draft", "cpu", follow=True)
step_every_s = float(sys.argv[1])  # 0: no step ever (a draft while its target runs K=0)
x = torch.randn(96, 96)
print("ready", flush=True)
deadline = time.monotonic() + 20
last = time.monotonic()
while not window.windows_written and time.monotonic() < deadline:
    time.sleep(0.01)
    if step_every_s and time.monotonic() - last > step_every_s:
        window.begin()
        x = torch.tanh(x @ x)
        window.step()
        last = time.monotonic()
    else:
        window.wait()
print(window.windows_written[0] if window.windows_written else "none", flush=True)
"""


@pytest.mark.parametrize("step_every_s", [0.0, 0.05])
@pytest.mark.e2e
def test_a_follower_covers_the_counting_process_window(tmp_path: Path, step_every_s: float) -> None:
    arm = tmp_path / "arm"
    scripts = [(_LOOP, "target"), (_FOLLOWER, str(step_every_s))]
    with _profiled(tmp_path, arm, scripts) as (_, procs):
        out_dir = tmp_path / "bs1"
        profiling.arm(arm, out_dir)
        written = [p.communicate(timeout=25)[0].strip() for p in procs]
    assert [str(f) for f in idle.profile_files([out_dir])] == sorted(written)
    assert idle.missing(out_dir, ["target", "draft", "gateway"]) == ["gateway"]
    target, draft = (idle.load(Path(w)) for w in written)
    assert (target.closed, draft.closed) == ("steps", "follow")
    # Counted in its own steps (3 + 20 of one per 50 ms) it would have ended a second later.
    assert draft.window[0] <= target.window[0] and target.window[1] <= draft.window[1]
    report = idle.from_dirs([out_dir])
    assert (report.window_start_ns, report.window_ms) == (
        target.window[0],
        (target.window[1] - target.window[0]) / 1e6,
    )
    (cpu,) = report.devices
    assert cpu.busy_by_process[target.process] > 0.0
    assert cpu.idle_fraction < 1.0
    if step_every_s:
        assert draft.num_steps and draft.num_steps > 0
        assert cpu.busy_by_process[draft.process] > 0.0
    else:
        assert draft.num_steps == 0 and cpu.busy_by_process[draft.process] == 0.0
        assert cpu.busy_by_process[target.process] == pytest.approx(1.0 - cpu.idle_fraction)
    assert report.unclosed == {draft.process: f"follow, {draft.num_steps} steps"}
    assert f"windows not closed by their steps: {draft.process} (follow, " in (
        idle.format_report(report)
    )


def test_missing_names_the_services_without_a_window(tmp_path: Path) -> None:
    assert idle.missing(tmp_path / "absent", ["target", "draft"]) == ["target", "draft"]
    (tmp_path / "draft-12.json").write_text("{}")
    (tmp_path / ".target-3.json.tmp").write_text("{}")  # half written: not there yet
    assert idle.missing(tmp_path, ["target", "draft"]) == ["target"]


@pytest.mark.parametrize("max_batch", [1, 64])
@pytest.mark.parametrize("new_tokens", [12, 128, 1024])
@pytest.mark.parametrize("spec_steps", [1, 3, 7])
def test_probe_window_closes_inside_the_round(
    max_batch: int, new_tokens: int, spec_steps: int
) -> None:
    w = Workload(prompt_len=128, new_tokens=new_tokens, warmup_tokens=16, rounds=1)
    start, num, round_tokens = probe_window(w, max_batch, spec_steps)
    assert num >= 10 and round_tokens >= new_tokens
    least_steps = -(-(round_tokens - 1) // (spec_steps + 1))  # every step commits <= S + 1
    assert start + num + _MARGIN <= least_steps


def test_idle_column_only_when_profiled() -> None:
    plain = table([Row(mode="services", batch_size=1)], {})
    assert "GPU idle" not in plain
    row = Row(mode="services-control", batch_size=1, idle_per_device=[0.08, 0.5])
    text = table([row], {})
    assert "GPU idle" in text and "0.08/0.50" in text
    turned = replace(row, verify_turn_ms=5.98, turn_period_ms=7.36)
    assert "v_turn" in text and "5.98" in table([turned], {}) and "7.36" in table([turned], {})
