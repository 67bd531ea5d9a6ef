"""The target's end of the prompt buffer a draft service shares on its local stream
(``tandem.link.local.LocalLink.share_prompts`` maps it; ``draft_service/chain.py``
allocates it). Prompt features go through it, and so do a step's outcome features when
there are enough of them (``tandem.link.messages.SHARED_OUTCOME_BYTES``)."""

from __future__ import annotations

import threading
from collections import deque

import torch

from tandem import wire


class PromptRing:
    """The draft's prompt buffer (``SpeculateHello.prompt_buffer``) mapped at the target:
    features are written there and their frames name the offset
    (``TensorFrame.shared_offset``) instead of carrying the bytes. Regions are handed out in
    step order and reused once their step is answered (answers come in step order), so a
    region is never rewritten before the draft copied it out. ``stage`` waits for its copy
    before returning: the message that names it may leave at once."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer  # uint8 [bytes]
        self._live: deque[tuple[int, int, int]] = deque()  # (step id, start, end), in order
        self._lock = threading.Lock()
        self.staged_bytes = 0

    def stage(self, step_id: int, tensors: list[torch.Tensor]) -> list[wire.EncodedFrame] | None:
        """``tensors`` (one dtype) written one after another into one region of the buffer,
        in one copy: a frame each, or None when the buffer has no room now (all go inline)."""
        if not tensors:
            return []
        flats = [t.detach().reshape(-1) for t in tensors]
        raw = (flats[0] if len(flats) == 1 else torch.cat(flats)).view(torch.uint8)
        with self._lock:
            start = self._place(raw.numel())
            if start is None:
                return None
            self._live.append((step_id, start, start + raw.numel()))
        self.buffer[start : start + raw.numel()].copy_(raw)
        if self.buffer.device.type == "cuda":
            torch.cuda.current_stream(self.buffer.device).synchronize()
        self.staged_bytes += raw.numel()
        frames, offset = [], start
        for t in tensors:
            frames.append(wire.shared_frame(wire.HIDDEN_STATES, t, offset))
            offset += t.numel() * t.element_size()
        return frames

    def _place(self, n: int) -> int | None:
        size = self.buffer.numel()
        if n == 0 or n > size:
            return None
        if not self._live:
            return 0
        oldest, newest = self._live[0][1], self._live[-1][2]
        if self._live[-1][1] >= oldest:  # [oldest, newest) in one piece
            if newest + n <= size:
                return newest
            return 0 if n <= oldest else None
        return newest if newest + n <= oldest else None  # wrapped: the gap before the oldest

    def release(self, step_id: int) -> None:
        """``step_id`` is answered: its regions, and any older ones, are free."""
        with self._lock:
            while self._live and self._live[0][0] <= step_id:
                self._live.popleft()
