"""The file of one profiled window (``tandem.serving.profiling``; read by ``tandem.bench.idle``):
the service, its device, the window on ``CLOCK_REALTIME`` and how it closed, and every device
interval in it (GPU kernels, memcpys and memsets; CPU ops off CUDA)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto activity types that occupy a GPU
CPU_KIND = "cpu_op"
INTERVAL_FIELDS = ("name", "start_ns", "end_ns", "device_index", "stream", "kind")


@dataclass(frozen=True, kw_only=True)
class Window:
    service: str
    device: str
    cuda: bool  # the device timeline (else CPU ops)
    start_ns: int
    end_ns: int
    steps: tuple[int, int]  # the loop's first and last step in it
    closed: str  # steps, idle, follow or stop (tandem.serving.profiling)


def write(path: Path, w: Window, events: list[Any]) -> Path:
    """Writes ``w``'s file at ``path`` (atomically) from the profiler's kineto ``events``."""
    names: dict[str, int] = {}
    rows: list[list[Any]] = []
    devices: dict[str, dict[str, str]] = {}
    kinds: dict[str, int] = {}  # every event seen, by "<device type>/<activity type>"
    for e in events:
        kind = _activity(e)
        seen = f"{e.device_type().name}/{kind}"
        kinds[seen] = kinds.get(seen, 0) + 1
        if w.cuda:
            if kind not in GPU_KINDS or e.device_type() != torch.autograd.DeviceType.CUDA:
                continue
            index, stream = e.device_index(), getattr(e, "device_resource_id", lambda: 0)()
        else:
            if kind != CPU_KIND:
                continue
            index, stream = 0, e.start_thread_id()
        if e.end_ns() <= w.start_ns or e.start_ns() >= w.end_ns:
            continue  # the warm-up steps, or work that started after the window
        name_id = names.setdefault(e.name(), len(names))
        rows.append([name_id, e.start_ns(), e.end_ns(), index, stream, kind])
        if str(index) not in devices:
            devices[str(index)] = _device_info(w.cuda, index)
    if not w.cuda:
        devices.setdefault("0", _device_info(w.cuda, 0))
    rows.sort(key=lambda r: r[1])
    if not rows and w.steps[1] >= w.steps[0]:  # a window without steps has nothing to show
        logger.warning(
            "%s: no %s in the window; events seen: %s",
            w.service,
            "GPU activity" if w.cuda else "CPU ops",
            kinds,
        )
    record = {
        "version": FORMAT_VERSION,
        "service": w.service,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": w.device,
        "timeline": "gpu_kernels" if w.cuda else "cpu_ops",
        "clock": "CLOCK_REALTIME ns (time.time_ns)",
        "realtime_minus_monotonic_ns": time.time_ns() - time.monotonic_ns(),
        "window": {
            "start_ns": w.start_ns,
            "end_ns": w.end_ns,
            "first_step": w.steps[0],
            "last_step": w.steps[1],
            "num_steps": w.steps[1] - w.steps[0] + 1,
            "closed": w.closed,  # steps, idle, follow or stop (tandem.serving.profiling)
        },
        "devices": devices,
        "event_kinds": kinds,
        "names": list(names),
        "interval_fields": list(INTERVAL_FIELDS),
        "intervals": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, separators=(",", ":")))
    os.replace(tmp, path)  # a reader polling for the file never sees half of it
    return path


def _device_info(cuda: bool, index: int) -> dict[str, str]:
    """A key that names the physical device for every process on the host."""
    if not cuda:
        return {"key": f"cpu@{socket.gethostname()}", "name": "cpu", "label": "cpu"}
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    key = f"GPU-{uuid}" if uuid is not None else f"cuda:{index}@{socket.gethostname()}"
    return {"key": key, "name": props.name, "label": f"cuda:{index}"}


def _activity(event: Any) -> str:
    """An event's activity type ("kernel", "gpu_memcpy", ...). Older torch (2.11) has no
    ``activity_type`` on its events: there, device events count as kernels (every CUDA
    event kineto records in a CUDA-only window is device work) and host events as CPU ops."""
    get = getattr(event, "activity_type", None)
    if get is not None:
        return str(get())
    if event.device_type() == torch.autograd.DeviceType.CUDA:
        return GPU_KINDS[0]
    return CPU_KIND
