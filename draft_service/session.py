"""The protocol state of one Speculate stream on the draft, whatever carries it (the gRPC
stream in ``server.py``, the local socket in ``local.py``).

Per stream, a :class:`_Session` keeps the state the wire contract implies: prompt frames that
continue in later messages of the lane, outcomes that arrive for a request whose prompt tensor
is not complete yet (merged into its admit once it is: an admit of L tokens followed by an
outcome of k accepted tokens is the admit of the L + k + 1 tokens, with the features
concatenated), and each request's committed length, checked against every outcome's
``committed_len``. :class:`StreamSteps` wraps it around engine steps: the hello check, spans,
the response with its timings, and the release of the stream's requests when it ends.

A malformed stream (no hello, a wrong protocol version, bad step speculation) raises
InvalidRequest, which ends it; a malformed request inside a good message only drops that
request (logged, listed in ``dropped_request_ids``): nothing else is disturbed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draft_service.context import StreamContext
from draft_service.engine import DraftInfo, StepResult
from draft_service.observe import StreamSpans
from tandem import wire
from tandem.errors import InvalidRequest
from tandem.spec.types import DraftAdmit, SpecConfig, VerifyOutcome
from tandem.v1 import common_pb2, draft_pb2

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """An admitted request whose prompt tensor is still arriving."""

    msg: draft_pb2.DraftAdmit
    admit: DraftAdmit  # validated; features set once complete
    length: int  # committed tokens, buffered outcomes included
    assembler: wire.FrameAssembler | None  # None when the draft needs no features
    complete: bool = False
    outcomes: list[VerifyOutcome] = field(default_factory=list)  # buffered, in order


@dataclass
class _Work:
    """One message turned into a drafter step."""

    admits: list[DraftAdmit] = field(default_factory=list)
    outcomes: list[VerifyOutcome] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


class _Session:
    """Protocol state of one Speculate stream (see the module docstring)."""

    def __init__(self, info: DraftInfo, max_spec: SpecConfig) -> None:
        self.info = info
        self.max_spec = max_spec
        self.pending: dict[str, _Pending] = {}
        self.lengths: dict[str, int] = {}  # complete requests -> committed tokens
        # A local stream's shared buffer (draft_service/prompts.py): (offset, bytes) -> a copy
        # of them. None: prompt and outcome frames must carry their bytes.
        self.shared: Callable[[int, int], torch.Tensor] | None = None
        # Waits for the copies ``shared`` queued: called before each answer leaves.
        self.settle: Callable[[], None] | None = None

    def apply(self, request: draft_pb2.SpeculateRequest) -> _Work:
        work = _Work()
        for request_id in request.released_request_ids:
            self.pending.pop(request_id, None)
            if self.lengths.pop(request_id, None) is not None:
                work.released.append(request_id)
        step_spec = wire.spec_from_proto(
            request.speculation, None, field="speculation", deployed_kind=self.info.kind
        )
        admitted: list[str] = []
        for i, new in enumerate(request.new_requests):
            path = f"new_requests[{i}]"
            self._guard(work, new.request_id, self._admit, new, step_spec, path, work)
            admitted.append(new.request_id)
        for j, frames in enumerate(request.prompt_frames):
            self._guard(work, frames.request_id, self._frames, frames, f"prompt_frames[{j}]")
        for request_id in admitted:
            p = self.pending.get(request_id)
            if p is not None and not p.complete and p.assembler and not p.assembler.in_progress:
                self._drop(work, request_id, "new_requests: its prompt_frames must start here")
        for i, outcome in enumerate(request.outcomes):
            self._guard(work, outcome.request_id, self._outcome, outcome, work, f"outcomes[{i}]")
        for request_id in [r for r, p in self.pending.items() if p.complete]:
            work.admits.append(self._complete(self.pending.pop(request_id)))
        return work

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.pending.pop(request_id, None)
            self.lengths.pop(request_id, None)

    def _guard(self, work: _Work, request_id: str, fn: Callable[..., None], *args: object) -> None:
        """Runs one request's conversion; an InvalidRequest drops only that request."""
        try:
            fn(*args)
        except InvalidRequest as exc:
            self._drop(work, request_id, str(exc))

    def _drop(self, work: _Work, request_id: str, reason: str) -> None:
        logger.warning("request %s dropped: %s", request_id, reason)
        self.pending.pop(request_id, None)
        if self.lengths.pop(request_id, None) is not None:
            work.released.append(request_id)
        if request_id and request_id not in work.dropped:
            work.dropped.append(request_id)

    def _admit(
        self, msg: draft_pb2.DraftAdmit, step_spec: SpecConfig | None, path: str, work: _Work
    ) -> None:
        self.pending.pop(msg.request_id, None)  # a re-admission starts over
        if self.lengths.pop(msg.request_id, None) is not None:
            work.released.append(msg.request_id)
        if len(msg.prompt_token_ids) >= self.info.max_model_len:
            raise InvalidRequest(
                f"{path}.prompt_token_ids",
                f"{len(msg.prompt_token_ids)} tokens fill the {self.info.max_model_len}-token "
                "context",
            )
        admit = self._convert_admit(msg, step_spec, path)
        spec, limit = admit.spec, self.max_spec
        if spec.num_steps > limit.num_steps or spec.topk > limit.topk:
            raise InvalidRequest(f"{path}.speculation", f"S, K above this draft's {limit}")
        if spec.tree_size > limit.tree_size:
            raise InvalidRequest(f"{path}.speculation.num_draft_tokens", "above this draft's N")
        assembler = None
        if self.info.target_layer_ids:  # exactly [L, F] of the negotiated dtype
            expect = self._features(len(msg.prompt_token_ids))
            assembler = wire.FrameAssembler(
                max_bytes=expect.nbytes,
                path=f"prompt_frames[{msg.request_id}]",
                shared=self.shared,
                expect=expect,
            )
        self.pending[msg.request_id] = _Pending(
            msg=msg,
            admit=admit,
            length=len(admit.token_ids),
            assembler=assembler,
            complete=assembler is None,
        )

    def _frames(self, msg: draft_pb2.PromptFrames, path: str) -> None:
        p = self.pending.get(msg.request_id)
        if p is None or p.assembler is None or p.complete:
            raise InvalidRequest(f"{path}.request_id", "no admitted request awaits frames")
        for frame in msg.frames:
            if p.complete:
                raise InvalidRequest(f"{path}.frames", "frames after the last chunk")
            tensor = p.assembler.add(frame)
            if tensor is not None:  # checks its shape [len(prompt_token_ids), F]
                p.admit = wire.admit_with_features(
                    p.admit,
                    tensor,
                    num_prompt_tokens=len(p.msg.prompt_token_ids),
                    field=f"prompt_frames[{p.msg.request_id}]",
                    feature_size=self.info.feature_size,
                )
                p.complete = True

    def _outcome(self, msg: draft_pb2.VerifyOutcome, work: _Work, path: str) -> None:
        request_id = msg.request_id
        p = self.pending.get(request_id)
        if p is None and request_id not in self.lengths:
            if request_id not in work.dropped:
                work.dropped.append(request_id)  # unknown here: the target stops sending it
            return
        rows = len(msg.accepted_token_ids) + 1
        outcome = wire.outcome_from_proto(
            msg,
            self._features(rows).nbytes,
            path=path,
            vocab_size=self.info.target_vocab_size,
            feature_size=self.info.feature_size,
            feature_dtype=self.info.hidden_dtype,
            shared=self.shared,
        )
        if self.info.target_layer_ids and outcome.features is None:
            raise InvalidRequest(f"{path}.hidden_states", "this draft needs the path's features")
        expected = (p.length if p is not None else self.lengths[request_id]) + rows
        if msg.committed_len != expected:
            raise InvalidRequest(
                f"{path}.committed_len", f"{msg.committed_len}, the draft counts {expected}"
            )
        if p is not None:
            p.length = expected
            p.outcomes.append(outcome)
        else:
            self.lengths[request_id] = expected
            work.outcomes.append(outcome)

    def _features(self, rows: int) -> wire.Expected:
        """The features of ``rows`` tokens as the stream negotiated them (GetInfo's hidden
        dtype and feature size): frames announcing anything else are refused unread."""
        return wire.Expected(self.info.hidden_dtype, (rows, self.info.feature_size))

    def _complete(self, p: _Pending) -> DraftAdmit:
        """The admit with every buffered outcome merged in."""
        admit = p.admit
        for outcome in p.outcomes:
            admit.token_ids = [
                *admit.token_ids,
                *outcome.accepted_token_ids,
                outcome.bonus_token_id,
            ]
            if admit.features is not None and outcome.features is not None:
                rows = outcome.features.to(admit.features)  # its dtype and device
                admit.features = torch.cat([admit.features, rows])  # [len(token_ids) - 1, F]
        self.lengths[admit.request_id] = len(admit.token_ids)
        return admit

    def _convert_admit(
        self,
        msg: draft_pb2.DraftAdmit,
        step_spec: SpecConfig | None,
        path: str,
    ) -> DraftAdmit:
        """The admit without its prompt's features (``_frames`` adds them)."""
        return wire.admit_from_proto(
            msg,
            None,
            default_spec=step_spec,
            path=path,
            vocab_size=self.info.target_vocab_size,
        )


def _step_record(
    request: draft_pb2.SpeculateRequest,
    work: _Work,
    result: StepResult,
    response: draft_pb2.SpeculateResponse,
) -> dict[str, int]:
    """One step's line in the draft's step log (``TANDEM_DRAFT_STEP_LOG``): the work (requests
    drafted, admits, outcomes and their rows) and where the time went: ``applyNs`` taking the
    message in (outcome features read from the shared buffer included), ``stepNs`` the
    drafter's step, of which ``modelNs`` in the model, ``totalNs`` from the message's arrival
    to its answer. ``wire`` in the target's StepStats, less this ``totalNs - modelNs``, is the
    transport and the target's own side of the exchange."""
    return {
        "stepId": request.step_id,
        "lane": request.lane_id,
        "requests": len(result.trees),
        "admits": len(work.admits),
        "outcomes": len(work.outcomes),
        "rows": sum(len(o.accepted_token_ids) + 1 for o in work.outcomes),
        "applyNs": response.extend_ns,
        "stepNs": response.draft_ns,
        "modelNs": response.model_ns,
        "totalNs": response.total_ns,
    }


class StreamSteps:
    """One Speculate stream around engine steps: ``begin`` a request (hello check, session,
    spans), run the engine step, ``finish`` into its response; ``close`` once, when the stream
    ends for any reason (its requests are released)."""

    def __init__(self, context: StreamContext, info: DraftInfo, peer: str) -> None:
        self.context = context
        self.info = info
        self.stream_id = context.next_stream_id()
        self.session = _Session(info, context.max_spec)
        self.spans = StreamSpans()
        self._first = True
        self._received = 0
        self._extend_ns = 0
        logger.info("stream %d opened by %s", self.stream_id, peer)

    def begin(self, request: draft_pb2.SpeculateRequest) -> _Work:
        self._received = time.perf_counter_ns()
        _check_hello(request, self._first)
        work = self.session.apply(request)
        self.spans.ended(work.released, "released")
        self.spans.admitted(work.admits)
        self._extend_ns = time.perf_counter_ns() - self._received
        return work

    def finish(
        self, request: draft_pb2.SpeculateRequest, work: _Work, result: StepResult
    ) -> draft_pb2.SpeculateResponse:
        if self.session.settle is not None:
            self.session.settle()  # the target may reuse the shared regions once answered
        self.session.forget(result.dropped)
        self.spans.ended([*work.dropped, *result.dropped], "dropped")
        response = draft_pb2.SpeculateResponse(
            step_id=request.step_id,
            lane_id=request.lane_id,
            trees=[wire.tree_to_proto(r, t) for r, t in result.trees.items()],
            dropped_request_ids=[*work.dropped, *result.dropped],
            kv_usage=common_pb2.KvUsage(
                pages_used=result.kv_usage.pages_used,
                pages_total=result.kv_usage.pages_total,
                page_size=result.kv_usage.page_size,
            ),
            extend_ns=self._extend_ns,
            draft_ns=result.draft_ns,
            model_ns=result.model_ns,
        )
        if self._first:
            response.hello.CopyFrom(self.context.hello(self.info))
            self._first = False
        response.total_ns = time.perf_counter_ns() - self._received
        if self.context.step_log is not None:
            self.context.step_log.write(_step_record(request, work, result, response))
        self.context.metrics.stepped(
            result.trees.values(), response.total_ns / 1e9, request.lane_id
        )
        if request.deadline_ns and response.total_ns > request.deadline_ns:
            logger.debug("stream %d step %d late", self.stream_id, request.step_id)
        return response

    def close(self) -> None:
        self.spans.close()
        self.context.engine.release_stream(self.stream_id)
        logger.info("stream %d closed", self.stream_id)


def _check_hello(request: draft_pb2.SpeculateRequest, first: bool) -> None:
    if not first:
        if request.HasField("hello"):
            raise InvalidRequest("hello", "set in the stream's first message only")
        return
    if not request.HasField("hello"):
        raise InvalidRequest("hello", "the stream's first SpeculateRequest must carry one")
    if request.hello.protocol_version != wire.PROTOCOL_VERSION:
        raise InvalidRequest(
            "hello.protocol_version",
            f"{request.hello.protocol_version} is not supported (this draft speaks "
            f"{wire.PROTOCOL_VERSION})",
        )
