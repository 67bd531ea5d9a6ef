"""A service's step log: one JSON line per step, for the benchmarks (``tandem.bench``) to read
back the steps of the rounds they measured.

A service whose ``TANDEM_<SERVICE>_STEP_LOG`` names a file appends each step's record there
with ``monotonicNs``, the ``time.monotonic_ns()`` it was taken at: one clock for every process
on the host, so a reader can keep the steps sent within its own measured windows
(``read_steps``). The step thread pays one queue put; a writer thread serialises and writes,
a line at a time, so a reader sees whole steps.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

TARGET_ENV = "TANDEM_TARGET_STEP_LOG"  # the target's steps: target_pb2.StepStats as JSON
DRAFT_ENV = "TANDEM_DRAFT_STEP_LOG"  # the draft's answers: its timings per Speculate step


class StepLog:
    """Appends step records to ``path`` from a writer thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pending: queue.SimpleQueue[tuple[int, Message | Mapping[str, Any]]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._write, name="step-log", daemon=True).start()

    @classmethod
    def from_env(cls, name: str) -> StepLog | None:
        """The log the environment variable ``name`` asks for, or None."""
        path = os.environ.get(name)
        return cls(Path(path)) if path else None

    def write(self, record: Message | Mapping[str, Any]) -> None:
        """Queues one step's record (a protobuf message is not changed once sent, so it is
        serialised later, on the writer thread)."""
        self._pending.put((time.monotonic_ns(), record))

    def _write(self) -> None:
        with self.path.open("a", buffering=1) as f:
            while True:
                at, record = self._pending.get()
                fields = (
                    json_format.MessageToDict(record)
                    if isinstance(record, Message)
                    else dict(record)
                )
                f.write(json.dumps({"monotonicNs": at, **fields}) + "\n")


def read_steps(path: Path, windows: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """The records logged in ``path`` within one of ``windows`` ([start_ns, end_ns] of
    ``time.monotonic_ns()``), in the order logged, without their ``monotonicNs``."""
    steps: list[dict[str, Any]] = []
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        record = json.loads(line)
        at = int(record.pop("monotonicNs"))
        if any(start <= at <= end for start, end in windows):
            steps.append(record)
    return steps
