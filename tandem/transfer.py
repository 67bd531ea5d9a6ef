"""A step's feature tensors from the device to the host in one copy that nobody waits for.

Every message to the draft service carries a feature tensor per request (EAGLE-3: three
target layers per token). Copied one by one from pageable memory, each copy waits for
everything queued on the stream first: with the engine decoding ahead, that is the next
forward, and the client's loop (which also reads the draft's answers) stalls behind it. Here
the tensors are concatenated and cast on the device and copied into one pinned buffer behind
the stream's work; the returned event marks the copy done, and the sender polls it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_host(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """``tensors`` (2-D, equal widths, on one device) as host tensors of ``dtype``: views of
    one pinned buffer, valid once the returned event has completed (None: valid now)."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.to("cpu", dtype) for t in tensors], None
    flat = torch.cat([t.to(dtype) for t in tensors])  # [sum(rows), F]
    host = torch.empty(flat.shape, dtype=dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)  # the allocators keep both alive until it is done
    done = torch.cuda.Event()
    done.record()
    return list(host.split([t.shape[0] for t in tensors])), done
