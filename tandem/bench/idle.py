"""GPU idle time from the services' step-window profiles (``tandem.serving.profiling``).

Every file holds one process's window and its device-busy intervals on the host's wall clock.
Per device (a physical GPU, named by its UUID so that two processes' ordinals need not agree)
the intervals of all processes are merged (their union: a kernel of the target and one of the
draft running at once count once), and over the common window, the overlap of all the
processes' windows, this reports the busy time, the idle fraction, the idle gaps (the largest
with their offset from the window's start) and each process's own busy fraction. A window its
steps did not close (``closed`` in the file: a loop that went idle, followed another's window
or stopped; ``tandem.serving.profiling``) is merged like any other: it holds every step the process
ran in it; the report lists such windows with their step counts.

``python -m tandem.bench.idle DIR... [--json] [--top N]`` prints it for the ``*.json`` files
in the directories (docs/performance.md, "GPU idle").
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.serving.profile_file import FORMAT_VERSION

Interval = tuple[int, int]  # [start_ns, end_ns)
LONG_GAP_NS = 100_000  # far above the gap between two launched kernels


@dataclass(frozen=True, kw_only=True)
class Profile:
    """One process's window, its intervals grouped by device key."""

    process: str  # "<service>-<pid>"
    timeline: str  # "gpu_kernels", or "cpu_ops" where the process ran without CUDA
    window: Interval
    labels: dict[str, str]  # device key -> a readable name ("cuda:0 <its device name>")
    intervals: dict[str, list[Interval]]  # device key -> busy intervals
    closed: str = "steps"  # how the window ended: steps, idle, follow or stop
    num_steps: int | None = None  # loop steps inside the window (None: an older file)


@dataclass(kw_only=True)
class DeviceIdle:
    device: str  # the key: "GPU-<uuid>", or "cpu@<host>"
    label: str
    busy_ms: float
    idle_fraction: float  # 1 - busy / window
    num_gaps: int  # idle stretches, the window's edges included
    num_long_gaps: int  # those of LONG_GAP_NS or more: host or wire stalls, not launch gaps
    long_gap_idle_share: float  # the share of the idle time in long gaps
    largest_gaps: list[tuple[float, float]]  # (offset from the window's start, length), ms
    busy_by_process: dict[str, float] = field(default_factory=dict)  # own busy / window
    # Where processes take turns on the device (a device-chain run: the target's verify, then
    # the draft's half): process -> [median turn ms, median start-to-start period ms, turns].
    turns: dict[str, list[float]] = field(default_factory=dict)


@dataclass(kw_only=True)
class IdleReport:
    timeline: str
    window_start_ns: int
    window_ms: float
    processes: list[str]
    devices: list[DeviceIdle]
    # Windows not closed by their steps: process -> "<closed>, <n> steps".
    unclosed: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


# -- interval math -------------------------------------------------------------------------


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time (empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def busy_ns(intervals: Iterable[Interval], window: Interval) -> int:
    return sum(e - s for s, e in clip(union(intervals), window))


def gaps(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The idle stretches of ``window`` between the (merged) busy intervals."""
    lo, hi = window
    idle: list[Interval] = []
    cursor = lo
    for start, end in clip(union(intervals), window):
        if start > cursor:
            idle.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < hi:
        idle.append((cursor, hi))
    return idle


def turns(by_process: dict[str, list[Interval]], window: Interval) -> dict[str, list[float]]:
    """Each process's turns on one device: maximal stretches of its intervals with no other
    process's interval starting in between; per process the median turn (first start to last
    end) and the median period between the starts of its turns, in ms, and the number of
    turns. Empty unless two processes or more ran on the device; a process needs two turns."""
    tagged = sorted(
        (start, end, process)
        for process, intervals in by_process.items()
        for start, end in clip(intervals, window)
    )
    if len({process for _, _, process in tagged}) < 2:
        return {}
    stretches: dict[str, list[Interval]] = {}
    last = ""  # the process whose turn is open
    for start, end, process in tagged:
        spans = stretches.setdefault(process, [])
        if process == last:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
            last = process
    result = {}
    for process, spans in stretches.items():
        if len(spans) < 2:
            continue
        lengths = [e - s for s, e in spans]
        periods = [b[0] - a[0] for a, b in itertools.pairwise(spans)]
        result[process] = [
            statistics.median(lengths) / 1e6,
            statistics.median(periods) / 1e6,
            float(len(spans)),
        ]
    return result


def common_window(profiles: Sequence[Profile]) -> Interval:
    """The overlap of every process's window."""
    if not profiles:
        raise ValueError("profiles: none given")
    lo = max(p.window[0] for p in profiles)
    hi = min(p.window[1] for p in profiles)
    if hi <= lo:
        raise ValueError(
            "profiles: the windows do not overlap ("
            + ", ".join(f"{p.process} {p.window[0]}..{p.window[1]}" for p in profiles)
            + ")"
        )
    return lo, hi


def analyse(profiles: Sequence[Profile], top: int = 5) -> IdleReport:
    window = common_window(profiles)
    length = window[1] - window[0]
    keys: dict[str, str] = {}
    for p in profiles:
        for key, label in p.labels.items():
            keys.setdefault(key, label)
    devices = []
    for key, label in sorted(keys.items(), key=lambda kv: kv[1]):
        merged = [i for p in profiles for i in p.intervals.get(key, [])]
        busy = busy_ns(merged, window)
        idle = gaps(merged, window)
        largest = sorted(idle, key=lambda g: g[1] - g[0], reverse=True)[:top]
        long = [e - s for s, e in idle if e - s >= LONG_GAP_NS]
        idle_ns = length - busy
        devices.append(
            DeviceIdle(
                device=key,
                label=label,
                busy_ms=busy / 1e6,
                idle_fraction=1.0 - busy / length,
                num_gaps=len(idle),
                num_long_gaps=len(long),
                long_gap_idle_share=sum(long) / idle_ns if idle_ns else 0.0,
                largest_gaps=[((s - window[0]) / 1e6, (e - s) / 1e6) for s, e in largest],
                busy_by_process={
                    p.process: busy_ns(p.intervals.get(key, []), window) / length for p in profiles
                },
                turns=turns({p.process: p.intervals.get(key, []) for p in profiles}, window),
            )
        )
    timelines = sorted({p.timeline for p in profiles})
    return IdleReport(
        timeline="+".join(timelines),
        window_start_ns=window[0],
        window_ms=length / 1e6,
        processes=[p.process for p in profiles],
        devices=devices,
        unclosed={
            p.process: f"{p.closed}, {p.num_steps} steps" for p in profiles if p.closed != "steps"
        },
    )


# -- files ---------------------------------------------------------------------------------


def load(path: Path) -> Profile:
    record = json.loads(path.read_text())
    if record.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: version {record.get('version')!r}, expected {FORMAT_VERSION}")
    fields = record["interval_fields"]
    at = {name: fields.index(name) for name in ("start_ns", "end_ns", "device_index")}
    devices = record["devices"]
    intervals: dict[str, list[Interval]] = {d["key"]: [] for d in devices.values()}
    for row in record["intervals"]:
        key = devices[str(row[at["device_index"]])]["key"]
        intervals[key].append((row[at["start_ns"]], row[at["end_ns"]]))
    labels = {d["key"]: _label(d) for d in devices.values()}
    window = record["window"]
    return Profile(
        process=f"{record['service']}-{record['pid']}",
        timeline=record["timeline"],
        window=(window["start_ns"], window["end_ns"]),
        labels=labels,
        intervals=intervals,
        closed=window.get("closed", "steps"),
        num_steps=window.get("num_steps"),
    )


def _label(device: dict[str, str]) -> str:
    label = device.get("label", device["key"])
    return label if device["name"] == label else f"{label} {device['name']}"


def profile_files(dirs: Iterable[Path]) -> list[Path]:
    return sorted(f for d in dirs for f in d.glob("*.json"))


def missing(out_dir: Path, services: Iterable[str]) -> list[str]:
    """The services with no window in ``out_dir`` (files are ``<service>-<pid>.json``)."""
    written = {f.name.rsplit("-", 1)[0] for f in profile_files([out_dir])}
    return [s for s in services if s not in written]


def from_dirs(dirs: Iterable[Path], top: int = 5) -> IdleReport:
    files = profile_files(dirs)
    if not files:
        raise ValueError("dirs: no profile files (*.json) found")
    return analyse([load(f) for f in files], top)


def format_report(report: IdleReport) -> str:
    lines = [
        f"common window {report.window_ms:.2f} ms over {', '.join(report.processes)} "
        f"({report.timeline})"
    ]
    if report.unclosed:
        shown = ", ".join(f"{p} ({how})" for p, how in report.unclosed.items())
        lines.append(f"windows not closed by their steps: {shown}")
    for d in report.devices:
        lines.append(
            f"{d.label}: idle {d.idle_fraction:.1%}, busy {d.busy_ms:.2f} ms, {d.num_gaps} gaps, "
            f"{d.num_long_gaps} of them >= {LONG_GAP_NS / 1e6:g} ms "
            f"({d.long_gap_idle_share:.0%} of the idle time)"
        )
        shares = ", ".join(f"{p} {f:.1%}" for p, f in d.busy_by_process.items())
        lines.append(f"  busy by process: {shares}")
        if d.turns:
            shown = ", ".join(
                f"{p} {turn:.3f} every {period:.3f} ({n:.0f})"
                for p, (turn, period, n) in d.turns.items()
            )
            lines.append(f"  turns (median ms, period ms, count): {shown}")
        if d.largest_gaps:
            gaps_text = ", ".join(f"{length:.3f} @ {at:.2f}" for at, length in d.largest_gaps)
            lines.append(f"  largest gaps (ms @ offset ms): {gaps_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="directories of profile files")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--top", type=int, default=5, help="largest gaps listed per device")
    args = parser.parse_args(argv)
    try:
        report = from_dirs(args.dirs, args.top)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    if args.json:
        sys.stdout.write(json.dumps(report.to_json()) + "\n")
    else:
        sys.stdout.write(format_report(report) + "\n")


if __name__ == "__main__":
    main()
