"""``python -m tandem.bench.bench_target``: the target service for benchmarks (its
StepStats.verify_ns is the forward's device time, from timing events: ``tandem.clock``, not a
synchronisation after each forward, which would hold back the verification's host work behind
it). Long garbage collections are logged (``rpc.log_gc_pauses``), so that a slow step in
StepStats can be told from a collection, and so are long stretches in which a watchdog thread
did not get the GIL (``tandem.bench.stalls``), with where the other threads stood, and
each admission burst an idle target gathered (how many commands, over how long). With
``TANDEM_BENCH_STEP_LOG`` set, every step that verified something is appended there as one JSON
line (its StepStats and ``monotonic_ns``, the ``time.monotonic_ns()`` it was sent at, one clock
for every process on the host) by a writer thread, so that the benchmark can read the steps of
the rounds it sent through the gateway (:func:`read_steps`). Flags as ``python -m
target_service``."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from google.protobuf import json_format

import target_service.__main__ as target_main
from tandem.bench import stalls
from tandem.serving import rpc
from tandem.v1 import target_pb2
from target_service.engine import TargetLoop

logger = logging.getLogger("tandem.bench.bench_target")

ENV_STEP_LOG = "TANDEM_BENCH_STEP_LOG"


def _logged(send: Any, path: Path) -> Any:
    """``TargetLoop._send`` that also queues each step's stats for a writer thread (the step
    thread pays one queue put; serialising and writing happen off it: each step's stats are a
    message of its own, which nothing changes once sent)."""
    pending: queue.SimpleQueue[tuple[int, target_pb2.StepStats]] = queue.SimpleQueue()

    def write() -> None:
        with path.open("a", buffering=1) as f:  # a line at a time: a reader sees whole steps
            while True:
                at, stats = pending.get()
                record = {"monotonicNs": at, **json_format.MessageToDict(stats)}
                f.write(json.dumps(record) + "\n")

    threading.Thread(target=write, name="step-log", daemon=True).start()

    @functools.wraps(send)
    def run(self: TargetLoop, commits: Any, stats: Any = None, lane: int = 0) -> None:
        if stats is not None and stats.batch_size:
            pending.put((time.monotonic_ns(), stats))
        send(self, commits, stats, lane)

    return run


def read_steps(path: Path, windows: list[tuple[int, int]]) -> list[target_pb2.StepStats]:
    """The steps logged in ``path`` (``TANDEM_BENCH_STEP_LOG``) sent within one of
    ``windows`` ([start_ns, end_ns] of ``time.monotonic_ns()``), in the order sent."""
    steps: list[target_pb2.StepStats] = []
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        record = json.loads(line)
        at = int(record.pop("monotonicNs"))
        if any(start <= at <= end for start, end in windows):
            steps.append(json_format.ParseDict(record, target_pb2.StepStats()))
    return steps


if __name__ == "__main__":
    rpc.log_gc_pauses(logger)
    stalls.log_stalls(logger)
    logging.getLogger("target_service.engine").setLevel(logging.DEBUG)  # admission bursts
    step_log = os.environ.get(ENV_STEP_LOG)
    if step_log:
        TargetLoop._send = _logged(TargetLoop._send, Path(step_log))  # type: ignore[method-assign]
    asyncio.run(target_main.main(target_main.parse_args()))
