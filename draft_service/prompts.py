"""The prompt buffer of a local stream that shares the draft's device with its target (CUDA
IPC, or shared memory on CPU): the draft allocates it, its hello describes it, and the target
writes prompt and outcome features into it instead of sending them inline
(``TensorFrame.shared_offset``); the stream's session reads them out (``read``) and lets the
target reuse the regions once it has answered (``settle``).
"""

from __future__ import annotations

import logging

import torch

from tandem.errors import InvalidRequest
from tandem.link import ipc
from tandem.spec.chain import share_on_cpu
from tandem.v1 import draft_pb2

logger = logging.getLogger(__name__)


class PromptBuffer:
    """One local stream's shared prompt buffer (worker thread only)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer  # [bytes] uint8, shared with the target
        self._copying = False  # copies out of it queued, not waited for (``settle``)

    @classmethod
    def allocate(cls, nbytes: int, device: torch.device, stream: int) -> PromptBuffer | None:
        """A shareable buffer of ``nbytes``; None (prompts travel inline) when there is none:
        a size of 0, no memory for it, or a small /dev/shm."""
        if not nbytes:
            return None
        try:
            buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            share_on_cpu(buffer)
        except (RuntimeError, OSError) as exc:
            logger.warning(
                "stream %d: no %d-byte prompt buffer (%s); prompts travel inline",
                stream,
                nbytes,
                exc,
            )
            return None
        return cls(buffer)

    def describe(self, hello: draft_pb2.SpeculateHello) -> None:
        """The stream's hello names the buffer."""
        hello.prompt_buffer = ipc.describe(self.buffer)
        hello.prompt_buffer_bytes = self.buffer.numel()

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        """A copy of prompt (or outcome) features the target wrote at ``offset``, queued on
        this thread's stream, where the draft step that uses it follows; ``settle`` waits for
        it before the step's answer leaves (the target reuses the region then). Waiting here,
        frame by frame, would take a turn of a GPU shared with the target's forward for every
        frame of a step."""
        if offset + nbytes > self.buffer.numel():
            raise InvalidRequest("frames.shared_offset", "outside the buffer")
        self._copying = self.buffer.device.type == "cuda"
        return self.buffer[offset : offset + nbytes].clone()

    def settle(self) -> None:
        """Waits for the copies ``read`` queued (by now the step that used them has been
        read, so they are done)."""
        if self._copying:
            torch.cuda.current_stream(self.buffer.device).synchronize()
        self._copying = False
