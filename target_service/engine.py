"""The target's step loop on its own thread: commands in, commits out.

The servicer never touches the engine: it queues admits and aborts, and the loop applies them
between steps, runs ``Engine.step()`` (schedule, target forward, verify, commit, draft) and
hands each step's commits to the stream that admitted the request. Nothing here runs inside the
event loop, so health checks and streams stay responsive while the model works.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from tandem import transfer, wire
from tandem.errors import InvalidRequest, NotFound, TandemError
from tandem.request import FinishReason, RequestOutput
from tandem.sampling import SamplingParams
from tandem.serving import profiling
from tandem.serving.step_log import StepLog
from tandem.spec.types import SpecStats
from tandem.target.engine import Engine, GenerationResult
from tandem.v1 import common_pb2, target_pb2
from target_service.observe import TargetObserver

logger = logging.getLogger(__name__)

# An idle target's wait for the rest of a burst (TargetLoop._gather): under way, the gap
# stretches to this many times the burst's mean spacing, at most this many gaps.
BURST_GAP_SPACINGS = 4
BURST_GAP_MAX = 5

# A stream's sink: called on the engine thread with each message for that stream.
Sink = Callable[[target_pb2.ControlResponse], None]


@dataclass(frozen=True)
class Admit:
    stream_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculate: bool
    lane: int = 0
    trace_context: dict[str, str] = field(default_factory=dict)  # the gateway's request span


@dataclass(frozen=True)
class Move:
    """A lane assignment: the requests step in ``lane`` from their next step."""

    request_ids: list[str]
    lane: int


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]
    reason: FinishReason = FinishReason.ABORT


@dataclass(frozen=True)
class Detach:
    """A gateway stream ended: abort what it admitted, forget its sink."""

    stream_id: int


@dataclass(frozen=True)
class Refuse:
    """An admit the servicer could not read (an empty id, a NaN temperature): refused, in the
    order it came, to the stream that sent it; the stream and its other requests go on."""

    stream_id: int
    request_id: str
    error: TandemError


@dataclass
class _Streams:
    sinks: dict[int, Sink] = field(default_factory=dict)
    owner: dict[str, int] = field(default_factory=dict)  # request id -> stream id


class TargetLoop:
    def __init__(
        self,
        engine: Engine,
        *,
        status: Callable[[], target_pb2.TargetStatus],
        status_interval_s: float = 0.25,
        admission_window_s: float = 0.0,
        admission_gap_s: float = 0.002,
        step_log: StepLog | None = None,
        model_name: str = "",
    ) -> None:
        self.engine = engine
        self._step_log = step_log  # each step's StepStats, for the benchmarks
        self._status = status
        self._status_interval_s = status_interval_s
        self._admission_window_s = admission_window_s
        self._admission_gap_s = admission_gap_s
        self._inbox: queue.Queue[Admit | Abort | Move | Detach | Refuse] = queue.Queue()
        self._streams = _Streams()
        self._lock = threading.Lock()  # guards _streams.sinks (servicer adds, loop reads)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="target-engine", daemon=True)
        self._step_id = 0
        self._last_status = 0.0
        self.observe = TargetObserver(
            engine, fallbacks=lambda: _fallback_steps(engine), model_name=model_name
        )
        self._profile = profiling.step_window("target", engine.config.device)  # None: off

    # -- called from the event loop ----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def attach(self, stream_id: int, sink: Sink) -> None:
        with self._lock:
            self._streams.sinks[stream_id] = sink
        self._last_status = 0.0  # a new stream gets a status right away

    def status(self) -> target_pb2.TargetStatus:
        """The pool and draft state now (counts read off the engine thread: a snapshot)."""
        return self._status()

    def submit(self, command: Admit | Abort | Move | Detach | Refuse) -> None:
        self._inbox.put(command)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(Abort([]))  # wake the loop
        self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        transfer.bind_thread(self.engine.config.device)
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            if idle and self._profile is not None:
                self._profile.idle()  # a round ended: a window its steps did not close is written
            self._drain(block=idle)
            if self.engine.has_unfinished():
                self._step()
            else:
                self.engine.flush_draft()  # an abort while idle frees the draft's pages too
            self._maybe_status()
        if self._profile is not None:
            self._profile.close()  # on this thread, where its profiler runs

    def _drain(self, *, block: bool) -> None:
        """Applies what the servicer queued; ``block`` (idle): waits for a first command, then
        for the rest of an admission burst (see ``_gather``)."""
        try:
            command = self._inbox.get(timeout=self._status_interval_s) if block else None
        except queue.Empty:
            return
        while True:
            if command is not None:
                self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                if block and self.engine.has_unfinished():
                    self._gather()
                return

    def _gather(self) -> None:
        """An idle engine just got work: requests of one burst (a client's batch, a gateway
        forwarding several streams) arrive a fraction of a millisecond apart, and a prefill
        step launched on the first would leave the others waiting for the whole of it. Takes
        what arrives until the admission gap passes with none, the admission window (from the
        first) closes, or the waiting requests fill a step. Once a burst is under way the gap
        stretches to ``BURST_GAP_SPACINGS`` times its mean spacing (at most ``BURST_GAP_MAX``
        gaps): a gateway forwarding 64 streams a millisecond apart, with a hiccup of a few, had
        its burst cut into prefill steps of 8 (a step's more for the batch)."""
        window, gap = self._admission_window_s, self._admission_gap_s
        start = last = time.monotonic()
        gathered = 1
        while not self.engine.scheduler.step_full():
            now = time.monotonic()
            left = start + window - now
            if left <= 0:
                break
            wait = gap
            if gathered > 1:
                spacing = (last - start) / (gathered - 1)
                wait = min(max(gap, BURST_GAP_SPACINGS * spacing), BURST_GAP_MAX * gap)
            try:
                command = self._inbox.get(timeout=min(left, wait))
            except queue.Empty:
                break
            last = time.monotonic()
            self._apply(command)
            gathered += 1
        logger.debug(
            "admission: %d commands in %.1f ms", gathered, (time.monotonic() - start) * 1e3
        )

    def _apply(self, command: Admit | Abort | Move | Detach | Refuse) -> None:
        if isinstance(command, Admit):
            if command.request_id in self._streams.owner:
                error = InvalidRequest("request_id", f"{command.request_id!r} is already running")
                self._refuse(command.stream_id, command.request_id, error)
                return
            carrier = self.observe.admitted(command.request_id, command.trace_context, command.lane)
            try:
                self.engine.add_request(
                    command.prompt_ids,
                    command.params,
                    command.request_id,
                    speculate=command.speculate,
                    lane=command.lane,
                    trace_context=carrier,
                )
            except TandemError as exc:
                self.observe.failed([command.request_id], str(exc))
                self._refuse(command.stream_id, command.request_id, exc)
                return
            self._streams.owner[command.request_id] = command.stream_id
        elif isinstance(command, Abort):
            for request_id in command.request_ids:
                self._abort(request_id, command.reason)
        elif isinstance(command, Refuse):
            self._refuse(command.stream_id, command.request_id, command.error)
        elif isinstance(command, Move):
            # Validated by the servicer; ids that just finished are ignored.
            self.engine.set_lane(command.request_ids, command.lane)
        else:
            owned = [r for r, s in self._streams.owner.items() if s == command.stream_id]
            for request_id in owned:
                self._abort(request_id, FinishReason.ABORT)
            with self._lock:
                self._streams.sinks.pop(command.stream_id, None)

    def _abort(self, request_id: str, reason: FinishReason) -> None:
        try:
            self.engine.abort(request_id)
        except NotFound:
            return  # already finished: its last commit is on its way
        result = self.engine.pop_finished(request_id)
        self._send([self._final(request_id, result=result, reason=reason)])

    def _refuse(self, stream_id: int, request_id: str, exc: TandemError) -> None:
        code = grpc.StatusCode.INVALID_ARGUMENT
        if not isinstance(exc, InvalidRequest):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
        error = common_pb2.ErrorStatus(
            code=code.value[0], message=str(exc), field=getattr(exc, "field", "")
        )
        commit = self._final(request_id, error=error)
        with self._lock:
            sink = self._streams.sinks.get(stream_id)
        if sink is not None:
            report = target_pb2.StepReport(step_id=self._step_id, commits=[commit])
            sink(target_pb2.ControlResponse(step=report))

    def _step(self) -> None:
        start = time.perf_counter_ns()
        step_span = self.observe.maybe_step_span()
        try:
            result = self.engine.step()
        except Exception:
            # A bug, not a bad request: fail what is running rather than hang it.
            logger.exception("engine step failed; failing the running requests")
            if step_span is not None:
                step_span.end()
            self._fail_all()
            return
        self._step_id += 1
        self.observe.stepped(result.outputs, result.stats, result.timing, result.lane, step_span)
        stats = _step_stats(result.stats)
        timing = result.timing
        stats.step_ns = time.perf_counter_ns() - start
        stats.verify_ns = timing.forward_ns
        stats.draft_ns = timing.draft_model_ns
        stats.wire_ns = max(0, timing.draft_wait_ns - timing.draft_model_ns)
        stats.host_ns = max(0, stats.step_ns - timing.forward_ns - timing.draft_wait_ns)
        commits = [self._commit(out) for out in result.outputs]
        if self._step_log is not None and stats.batch_size:
            self._step_log.write(stats)
        self._send(commits, stats, lane=result.lane)
        if self._profile is not None:
            self._profile.step()

    def _commit(self, output: RequestOutput) -> target_pb2.Commit:
        if output.finished:
            commit = self._final(
                output.request_id,
                result=self.engine.pop_finished(output.request_id),
                tokens=output.new_token_ids,
                logprobs=output.new_logprobs,
            )
        else:
            commit = target_pb2.Commit(
                request_id=output.request_id,
                token_ids=output.new_token_ids,
                logprobs=output.new_logprobs,
            )
        for top in output.new_top_logprobs:
            commit.top_logprobs.add(token_ids=top.token_ids, logprobs=top.logprobs)
        return commit

    def _final(
        self,
        request_id: str,
        *,
        result: GenerationResult | None = None,
        reason: FinishReason | None = None,
        tokens: list[int] | None = None,
        logprobs: list[float] | None = None,
        error: common_pb2.ErrorStatus | None = None,
    ) -> target_pb2.Commit:
        """A request's last commit: its last tokens and how it ended, with ``error`` (refused
        or failed) or with the engine's ``result`` (finished by ``reason``, else by the
        engine's finish reason), whose usage it reports."""
        commit = target_pb2.Commit(
            request_id=request_id, token_ids=tokens or [], logprobs=logprobs or []
        )
        if error is not None:
            commit.finish_reason = common_pb2.FINISH_REASON_ERROR
            commit.error.CopyFrom(error)
            return commit
        assert result is not None, "a final commit needs the engine's result or an error"
        reason = reason or result.finish_reason
        prompt_tokens, completion_tokens = len(result.prompt_ids), len(result.token_ids)
        self.observe.finished(
            request_id, reason.value, result.stats, prompt_tokens, completion_tokens
        )
        commit.finish_reason = wire.finish_reason_to_proto(reason)
        commit.usage.CopyFrom(wire.usage_to_proto(result.stats, prompt_tokens, completion_tokens))
        return commit

    def _fail_all(self) -> None:
        scheduler = self.engine.scheduler
        ids = [r.request_id for r in (*scheduler.running, *scheduler.waiting)]
        self.observe.failed(ids, "target step failed")
        error = common_pb2.ErrorStatus(
            code=grpc.StatusCode.INTERNAL.value[0], message="target step failed"
        )
        commits = []
        for request_id in ids:
            with contextlib.suppress(NotFound, KeyError):
                self.engine.abort(request_id)
                self.engine.pop_finished(request_id)
            commits.append(self._final(request_id, error=error))
        self._send(commits)

    def _send(
        self,
        commits: list[target_pb2.Commit],
        stats: target_pb2.StepStats | None = None,
        lane: int = 0,
    ) -> None:
        """Groups commits by the stream that admitted each request; finished ones are forgotten."""
        by_stream: dict[int, list[target_pb2.Commit]] = {}
        for commit in commits:
            stream_id = self._streams.owner.get(commit.request_id)
            if stream_id is None:
                continue
            by_stream.setdefault(stream_id, []).append(commit)
            if commit.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                del self._streams.owner[commit.request_id]
        with self._lock:
            sinks = dict(self._streams.sinks)
        for stream_id, group in by_stream.items():
            sink = sinks.get(stream_id)
            if sink is None:
                continue
            report = target_pb2.StepReport(step_id=self._step_id, lane_id=lane, commits=group)
            if stats is not None:
                report.stats.CopyFrom(stats)
            sink(target_pb2.ControlResponse(step=report))

    def _maybe_status(self) -> None:
        now = time.monotonic()
        if now - self._last_status < self._status_interval_s:
            return
        self._last_status = now
        message = target_pb2.ControlResponse(status=self._status())
        with self._lock:
            sinks = list(self._streams.sinks.values())
        for sink in sinks:
            sink(message)


def _step_stats(stats: SpecStats) -> target_pb2.StepStats:
    """The step's verification counters (every stream gets the whole step's)."""
    return target_pb2.StepStats(
        batch_size=stats.verify_steps,
        num_speculating=stats.drafts,
        num_draft_tokens=stats.draft_tokens,
        num_accepted_tokens=stats.accepted_tokens,
        num_accepted_per_pos=stats.accepted_per_position,
        num_committed_tokens=stats.accepted_tokens + stats.verify_steps,
        without_tree=wire.without_tree_to_proto(stats.without_tree),
    )


def _fallback_steps(engine: Engine) -> int:
    """Steps that went without their trees so far (a late or gone draft)."""
    return 0 if engine.drafter is None else engine.drafter.status().fallback_steps
