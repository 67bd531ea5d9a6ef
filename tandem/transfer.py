"""Copies between the host and the device that do not make the host wait for the stream.

A copy from pageable memory (``torch.tensor(..., device="cuda")``, ``Tensor.to("cpu")``) waits
for everything queued on the stream first: with the engine decoding ahead that is the next
forward, and a step of small copies paid one wait each. Every copy here goes through pinned
memory from the caching host allocator behind the stream's work (``Tensor.pin_memory()`` asks
the driver whether its source is pinned first, a cost per call that a step of small copies
would pay many times):

- ``to_device`` / ``device_ints``: host data onto the device; nothing waits.
- ``read_host``: device tensors onto the host after one wait, for the last copy only.
- ``to_host``: a step's feature tensors (the draft service's messages: EAGLE-3 sends three
  target layers per token) concatenated and cast on the device and copied in one go; nothing
  waits, and the returned event marks the copy done (the draft client waits on it). Tensors
  already on the host pass through (cast).

On CPU they are plain ``.to`` calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def bind_thread(device: torch.device | str) -> None:
    """Makes ``device`` the calling thread's current CUDA device (no-op elsewhere). Triton
    launches on the current device whatever its arguments' device, and a thread starts on
    cuda:0: a service on cuda:1 failed its first kernel ("Pointer argument cannot be accessed
    from Triton"). Every thread that runs a model calls this first."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:  # "cuda": the current one already
        torch.cuda.set_device(device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, copied from pinned memory behind the stream."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


def device_ints(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``values`` as int64 on ``device`` (``to_device``): nothing waits for the stream, so the
    step decoding ahead (tandem/target/ahead.py) may use it."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def device_segments(
    segments: Sequence[Sequence[int]], device: torch.device | str
) -> list[torch.Tensor]:
    """Each of ``segments`` as int64 on ``device``, from one upload (``device_ints``), every
    one starting on a 16-byte boundary: Triton compiles a kernel per alignment of its pointer
    arguments, so a segment that followed an odd number of values would compile a new variant
    mid-serving (about a second while every request waits)."""
    flat: list[int] = []
    starts: list[int] = []
    for segment in segments:
        starts.append(len(flat))
        flat += segment
        flat += [0] * (len(flat) % 2)
    host = device_ints(flat, device)
    return [host[s : s + len(g)] for s, g in zip(starts, segments, strict=True)]


def read_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of ``tensors`` on the host after one wait for the device (``.tolist()`` per
    tensor waits once per tensor)."""
    if not tensors or tensors[0].device.type != "cuda":
        return tuple(t.cpu() for t in tensors)
    out = tuple(_pinned_copy(t) for t in tensors)
    _recorded().synchronize()
    return out


def to_host(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """``tensors`` (2-D, equal widths, on one device) as host tensors of ``dtype``: views of
    one pinned buffer, valid once the returned event has completed (None: valid now)."""
    on_device = [t for t in tensors if t.device.type == "cuda"]
    if not on_device:
        return [t.to(dtype) for t in tensors], None
    host = _pinned_copy(torch.cat([t.to(dtype) for t in on_device]))  # [sum(rows), F]
    copied = iter(host.split([t.shape[0] for t in on_device]))
    return [next(copied) if t.device.type == "cuda" else t.to(dtype) for t in tensors], _recorded()


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that ``t`` is copied into behind the stream's work (the allocators
    keep both alive until the copy is done)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _recorded() -> torch.cuda.Event:
    """An event recorded on the current stream: done once the work queued so far is."""
    done = torch.cuda.Event()
    done.record()
    return done


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s elements (0 for None)."""
    return 0 if t is None else t.numel() * t.element_size()
