"""The Speculate stream's messages at the target's end: what one stream has told the draft
(``StreamState``: the requests it tracks, with the committed length the draft counts, and the
prompts not fully sent yet), how a step goes out (``Outgoing``) and how an answer reads
(``Answer``, ``parse_trees``). Both transports use them.

``build(...)`` turns one lane's step into a SpeculateRequest: released ids the draft knows of,
new admits queued in order, outcomes (merged into the admit when the admit has not gone out yet:
an admit of L tokens plus an outcome of k accepted tokens is the admit of L + k + 1 tokens) and
as many prompt frames as fit in one message; an admit leaves with its first frame and the rest
follow in the next messages, whatever their lane (the draft applies messages in stream order).
Features travel in the dtype the draft asked for. With a buffer the draft shares
(``tandem.link.prompt_ring``), a step's outcome features of ``SHARED_OUTCOME_BYTES`` or more are
written into it together (from the device: the draft client leaves them there), one frame
each naming where; without room they go inline. A new stream starts with a new state.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from tandem import transfer, wire
from tandem.errors import InvalidRequest
from tandem.spec.types import DraftAdmit, Tree, VerifyOutcome
from tandem.transfer import nbytes
from tandem.v1 import draft_pb2

logger = logging.getLogger(__name__)

# A step's outcome features that go through a buffer the draft shares rather than inline: a
# large batch's step (32 requests: about 3 MiB for an 8B EAGLE-3 head) and the runs K=0 held,
# sent when speculation resumes. Serialising them would hold the engine thread (and the GIL).
SHARED_OUTCOME_BYTES = 1 << 20


class StreamState:
    """What one stream has told the draft; ``build`` turns a lane's step into its message."""

    def __init__(self, *, budget: int, frame_bytes: int, hidden_dtype: torch.dtype) -> None:
        self.budget = budget  # bytes one message may take
        self.frame_bytes = frame_bytes  # bytes one tensor frame may take
        self.hidden_dtype = hidden_dtype
        self.tracked: dict[str, int] = {}  # request id -> committed tokens (draft's count)
        # A local stream with the draft's prompt buffer (``tandem.link.prompt_ring.PromptRing``):
        # (step id, tensors) -> their frames once written there, None when it has no room.
        self.stage: Callable[[int, list[torch.Tensor]], list[wire.EncodedFrame] | None] | None
        self.stage = None
        # Prompts not fully sent, in admission order: an admit not sent yet, or the frames
        # still to send of one that was.
        self.outbox: dict[str, DraftAdmit | deque[wire.EncodedFrame]] = {}

    def forget(self, request_ids: list[str]) -> None:
        """Requests the draft dropped."""
        for request_id in request_ids:
            self.tracked.pop(request_id, None)
            self.outbox.pop(request_id, None)

    def build(
        self,
        request: draft_pb2.SpeculateRequest,
        admits: list[DraftAdmit],
        outcomes: list[VerifyOutcome],
        released: list[str],
    ) -> Outgoing:
        """One lane's step: ``request`` (step id, lane and deadline set) filled in, and the
        prompt frames that go with it."""
        message = Outgoing(request)
        for request_id in released:
            unsent = isinstance(self.outbox.pop(request_id, None), DraftAdmit)
            if self.tracked.pop(request_id, None) is not None and not unsent:
                request.released_request_ids.append(request_id)
        for admit in admits:  # a re-admission starts over at the draft too
            self.outbox.pop(admit.request_id, None)
            self.outbox[admit.request_id] = admit
            self.tracked[admit.request_id] = len(admit.token_ids)
        share = self.stage is not None and shares_outcomes(outcomes)
        staged: list[tuple[draft_pb2.VerifyOutcome, torch.Tensor]] = []
        for outcome in outcomes:
            request_id = outcome.request_id
            if request_id not in self.tracked:
                continue  # dropped earlier; the engine stops sending it after take_dropped
            self.tracked[request_id] += len(outcome.accepted_token_ids) + 1
            queued = self.outbox.get(request_id)
            if isinstance(queued, DraftAdmit):
                self.outbox[request_id] = queued.then(outcome)
                continue
            features = self._cast(outcome.features)
            msg = wire.outcome_to_proto(
                replace(outcome, features=None if share else features),
                self.tracked[request_id],
                max_frame_bytes=self.frame_bytes,
                into=request.outcomes.add(),
            )
            if share and features is not None:
                staged.append((msg, features))
        if staged:
            self._share_outcomes(request.step_id, staged)
        if self.outbox:  # (sizing the message costs host time: only when prompts wait)
            self._add_prompts(message)
        return message

    def _add_prompts(self, message: Outgoing) -> None:
        """Moves prompts from the outbox into the message while it has room, in order: an
        admit leaves with its first frame; at least one item goes per message. Frames wait
        encoded and go out as they are (``Outgoing``)."""
        request = message.request
        size, empty = request.ByteSize(), True
        while self.outbox:
            request_id, entry = next(iter(self.outbox.items()))
            must = False  # a just-admitted request's first frame goes with it
            if isinstance(entry, DraftAdmit):
                msg, _ = wire.admit_to_proto(replace(entry, features=None))
                frames = deque(self._frames(request.step_id, self._cast(entry.features)))
                first = frames[0].size + 16 if frames else 0
                if not empty and size + msg.ByteSize() + first + 16 > self.budget:
                    return  # (encoded again next time: once per message at most)
                request.new_requests.append(msg)
                size, empty, must = size + msg.ByteSize() + 16, False, True
                entry = self.outbox[request_id] = frames
            part: list[wire.EncodedFrame] = []
            while entry and (must or empty or size + entry[0].size + 16 <= self.budget):
                part.append(entry.popleft())
                size, empty, must = size + part[-1].size + 16, False, False
            if part:
                message.prompts.append((request_id, part))
            if entry:
                return  # the rest follows in the next message
            del self.outbox[request_id]

    def _share_outcomes(
        self, step_id: int, outcomes: list[tuple[draft_pb2.VerifyOutcome, torch.Tensor]]
    ) -> None:
        """Outcome features written into the draft's buffer in one copy, each outcome's frame
        naming where its rows lie; inline (from the host) when it has no room."""
        features = [f for _, f in outcomes]
        frames = None if self.stage is None else self.stage(step_id, features)
        if frames is None:
            for (msg, _), host in zip(outcomes, transfer.read_host(*features), strict=True):
                for frame in wire.encode_frames(wire.HIDDEN_STATES, host, self.frame_bytes):
                    frame.add_to(msg.hidden_states)
            return
        for (msg, _), frame in zip(outcomes, frames, strict=True):
            frame.add_to(msg.hidden_states)

    def _frames(self, step_id: int, features: torch.Tensor | None) -> list[wire.EncodedFrame]:
        """A prompt's frames: one naming where it lies in the draft's prompt buffer, or its
        bytes inline (from the host)."""
        if features is None:
            return []
        if self.stage is not None:
            shared = self.stage(step_id, [features])
            if shared is not None:
                return shared
        return wire.encode_frames(wire.HIDDEN_STATES, features.cpu(), self.frame_bytes)

    def _cast(self, features: torch.Tensor | None) -> torch.Tensor | None:
        """Features in the dtype the draft asked for (bf16 halves the bytes on the wire)."""
        return None if features is None else features.to(self.hidden_dtype)


def shares_outcomes(outcomes: Sequence[VerifyOutcome]) -> bool:
    """Whether a step's outcome features go through a buffer the draft shares (when there is
    one): ``SHARED_OUTCOME_BYTES`` of them or more."""
    return sum(nbytes(o.features) for o in outcomes) >= SHARED_OUTCOME_BYTES


_PROMPT_FRAMES = wire.length_tag(draft_pb2.SpeculateRequest, "prompt_frames")
_REQUEST_ID = wire.length_tag(draft_pb2.PromptFrames, "request_id")
_FRAMES = wire.length_tag(draft_pb2.PromptFrames, "frames")


@dataclass
class Outgoing:
    """A SpeculateRequest as it goes on the stream: ``request`` and, beside it, the prompt
    frames of its ``prompt_frames`` field, encoded (``wire.EncodedFrame``).
    ``SerializeToString`` joins the request's bytes and the frames' (a repeated field may
    follow the rest of a message on the wire): each prompt byte is copied once, where upb
    copied it into the message and twice more in its encoder, holding the GIL the target's
    engine thread needs for as long."""

    request: draft_pb2.SpeculateRequest
    prompts: list[tuple[str, list[wire.EncodedFrame]]] = field(default_factory=list)

    def SerializeToString(self) -> bytes:  # named as on a proto: the serializer calls it
        pieces: list[bytes | memoryview] = [self.request.SerializeToString()]
        for request_id, frames in self.prompts:
            rid = request_id.encode()
            part: list[bytes | memoryview] = [_REQUEST_ID, wire.varint(len(rid)), rid]
            for frame in frames:
                part += [_FRAMES, wire.varint(frame.size), *frame.pieces()]
            pieces += [_PROMPT_FRAMES, wire.varint(sum(map(len, part))), *part]
        return b"".join(pieces)

    def message(self) -> draft_pb2.SpeculateRequest:
        """The whole SpeculateRequest, as the draft parses it (tests, logs)."""
        return draft_pb2.SpeculateRequest.FromString(self.SerializeToString())


@dataclass(frozen=True)
class Answer:
    """A step's answer as the target's end parsed it."""

    trees: dict[str, Tree]
    model_ns: int


def parse_trees(response: draft_pb2.SpeculateResponse, tracked: dict[str, int]) -> dict[str, Tree]:
    """The response's valid trees of requests the stream tracks (a malformed one is logged
    and left out: that request decodes without speculation this step)."""
    trees: dict[str, Tree] = {}
    for i, msg in enumerate(response.trees):
        try:
            request_id, tree = wire.tree_from_proto(msg, path=f"trees[{i}]")
        except InvalidRequest as exc:
            logger.warning("draft sent a malformed tree: %s", exc)
            continue
        if request_id in tracked:
            trees[request_id] = tree
    return trees
