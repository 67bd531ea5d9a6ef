"""Device-chain runs on the draft (docs/device-cycle.md): one local stream's ``ChainBegin``,
``ChainStep`` and ``ChainEnd`` (the target's end is ``tandem/link/chain_remote.py``), on the
engine's worker thread.

A stream gets a :class:`ChainPeer` when the target's hello offered a transport this draft's
device can share (``TENSOR_TRANSPORT_CUDA_IPC`` on CUDA, ``_SHM`` on CPU; the draft's hello
then names it, with its prompt buffer: ``prompts.py``). Runs need a drafter that can run
chains (one module with draft graphs: ``DraftChain``); another refuses every ``ChainBegin``.
The engine holds the active run (``DraftEngine.chain_run``), its one owner; a peer reaches
its stream's run there.

- ``ChainBegin``: every row must be this stream's, tracked at the committed length the target
  gives and a chain of the run's S, the bucket one of the draft's, no other run active and no
  other stream holding requests (the draft's buckets are shared: another stream's steps would
  rewrite what a run's graphs read). The draft reserves its pages, stages its buckets, maps
  the target's ``Chains`` (described the first time a bucket runs on the stream) and answers
  ``ChainReady`` with its ``Outcome`` descriptions (the first time) or the reason it refuses.
- ``ChainStep``: this stream waits for the target's event, the draft reserves for the
  lengths and unread steps the target gives, queues its half, records its own event and
  answers ``ChainStepDone`` (or why it could not: the run then ends at the target).
- ``ChainEnd``: each row's committed tokens are appended and the drafter's host state rebuilt
  (``DraftChain.end``); finished rows, or every row of an abandoned run, are released.

A step of another stream while a run is active disturbs it: the run's next step fails. A run
that the stream's next message does not step (the target gave up on ``ChainReady``) is dropped
(``drop_unstarted``): its reservation goes back.
"""

from __future__ import annotations

import logging

import torch

from draft_service.context import StreamContext
from draft_service.engine import ChainRun
from draft_service.session import StreamSteps
from tandem.draft.chain_draft import DraftChain
from tandem.draft.drafter import ModelDrafter
from tandem.graphs.base import Bucket
from tandem.link import ipc
from tandem.spec.chain import Chains
from tandem.v1 import draft_pb2

logger = logging.getLogger(__name__)


class ChainPeer:
    """One stream's device-chain runs (module docstring); worker thread only."""

    def __init__(self, context: StreamContext, steps: StreamSteps, transport: int) -> None:
        self.engine = context.engine
        self.device = context.device
        self.session = steps.session
        self.stream = steps.stream_id
        self.on_cuda = transport == draft_pb2.TENSOR_TRANSPORT_CUDA_IPC
        self._last_run = 0
        self._halves: dict[int, DraftChain] = {}  # per S
        self._chains: dict[tuple[int, Bucket], Chains] = {}  # the target's, mapped here
        self._described: set[tuple[int, Bucket]] = set()  # Outcome descriptions sent
        self._mine: torch.cuda.Event | None = None
        self._theirs: torch.cuda.Event | None = None

    @property
    def run(self) -> ChainRun | None:
        """This stream's active run (the engine holds it)."""
        run = self.engine.chain_run
        return run if run is not None and run.stream == self.stream else None

    def _prefixed(self, request_id: str) -> str:
        return f"{self.stream}/{request_id}"

    def _model(self) -> ModelDrafter:
        """The drafter, when it can run chains (ValueError: why not)."""
        model = self.engine.model
        if model is None or model.graphs is None:
            raise ValueError("this draft has no draft graphs (or static buckets)")
        problem = model.chain_problem()
        if problem:
            raise ValueError(problem)
        return model

    # -- ChainBegin ------------------------------------------------------------------------

    def begin(self, msg: draft_pb2.ChainBegin) -> draft_pb2.ChainReady:
        try:
            return self._begin(msg)
        except ValueError as exc:
            return draft_pb2.ChainReady(run_id=msg.run_id, refused=str(exc))

    def _begin(self, msg: draft_pb2.ChainBegin) -> draft_pb2.ChainReady:
        model = self._model()
        self.drop_unstarted()
        if self.engine.chain_run is not None:
            raise ValueError("a run is active")
        if msg.run_id <= self._last_run:
            raise ValueError(f"run {msg.run_id} is not after run {self._last_run}")
        if self.engine.other_streams_tracked(self.stream):
            raise ValueError("another stream holds requests in this draft")
        s, n = msg.num_steps, len(msg.request_ids)
        if s < 1 or s > self.session.max_spec.num_steps:
            raise ValueError(f"num_steps {s} is outside this draft's 1..S")
        # No row at all: a run of padding rows that captures the bucket's graphs (the
        # target's DeviceChain.warm).
        if n > msg.batch_size or len(msg.committed_lens) != n:
            raise ValueError("rows: request_ids and committed_lens must fill the batch")
        bucket = Bucket(msg.batch_size, s + 1)
        half = self._halves.get(s)
        if half is None:
            half = self._halves[s] = model.chain_half(s, self.device)
        if not half.has_bucket(msg.batch_size):
            raise ValueError(f"no draft bucket for batch size {msg.batch_size}")
        lengths = self.session.lengths
        ids = [self._prefixed(rid) for rid in msg.request_ids]
        for rid, pid, length in zip(msg.request_ids, ids, msg.committed_lens, strict=True):
            if lengths.get(rid) != length or not half.eligible(pid, length):
                raise ValueError(f"request {rid!r} is not tracked here at {length} tokens as S={s}")
        key = (s, bucket)
        if key not in self._chains:
            self._chains[key] = self._open_chains(msg, bucket)
        if self.on_cuda and self._theirs is None:
            if not msg.event:
                raise ValueError("the first ChainBegin must carry the target's event")
            self._theirs = ipc.open_event(bytes(msg.event), half.device.index)
        if half.device.type == "cuda":
            # What this stream still has queued (a late half of an abandoned run writes the
            # target's Chains) is done before the answer: the target writes them after it.
            torch.cuda.current_stream(half.device).synchronize()
        half.request_ids = ids
        if not half.reserve(list(msg.committed_lens), 0):
            raise ValueError("the draft's KV pool is full")
        half.chains = self._chains[key]
        outcome = half.begin(ids, bucket)
        ready = draft_pb2.ChainReady(run_id=msg.run_id)
        if key not in self._described:
            parts = [outcome.base, outcome.accepted, outcome.new, outcome.alive]
            if outcome.features is not None:
                parts.append(outcome.features)
            ready.outcome.extend(ipc.describe(t) for t in parts)
            self._described.add(key)
        if self.on_cuda and self._mine is None:
            self._mine = torch.cuda.Event(interprocess=True)
            self._mine.record()
            ready.event = self._mine.ipc_handle()
        self.engine.chain_run = ChainRun(
            self.stream, msg.run_id, half, list(msg.request_ids), bucket
        )
        self._last_run = msg.run_id
        logger.debug("stream %d: chain run %d of %d rows", self.stream, msg.run_id, n)
        return ready

    def _open_chains(self, msg: draft_pb2.ChainBegin, bucket: Bucket) -> Chains:
        if len(msg.chains) != 2:
            raise ValueError("the first run of a bucket must describe the target's Chains")
        bs, s = bucket.batch_size, bucket.width - 1
        return Chains(
            tokens=ipc.open_buffer(bytes(msg.chains[0]), (bs, s + 1), torch.int64),
            valid=ipc.open_buffer(bytes(msg.chains[1]), (bs, s), torch.bool),
        )

    # -- ChainStep -------------------------------------------------------------------------

    def step(self, msg: draft_pb2.ChainStep) -> draft_pb2.ChainStepDone:
        done = draft_pb2.ChainStepDone(run_id=msg.run_id, step=msg.step)
        run = self.run
        if run is None or run.run_id != msg.run_id:
            done.failed = f"run {msg.run_id} is not active"
            return done
        if msg.step != run.step + 1 or len(msg.committed_lens) != len(run.request_ids):
            run.disturbed = f"step {msg.step} after {run.step}, {len(msg.committed_lens)} rows"
        if run.disturbed:
            done.failed = run.disturbed
            return done
        run.step = msg.step
        half = run.half
        if self._theirs is not None:
            torch.cuda.current_stream(half.device).wait_event(self._theirs)
        if not half.reserve(list(msg.committed_lens), msg.unread):
            run.disturbed = done.failed = "the draft's KV pool is full"
            return done
        half.launch()
        if self._mine is not None:
            self._mine.record()
        return done

    # -- ChainEnd --------------------------------------------------------------------------

    def end(self, msg: draft_pb2.ChainEnd) -> list[str]:
        """Ends the run; returns the requests released (as the stream names them)."""
        run = self.run
        if run is None or run.run_id != msg.run_id or len(msg.rows) != len(run.request_ids):
            logger.warning("stream %d: ChainEnd for run %d ignored", self.stream, msg.run_id)
            return []
        self.engine.chain_run = None
        half, lengths = run.half, self.session.lengths
        finished = [row.finished or msg.abandoned for row in msg.rows]
        for rid, row, done in zip(run.request_ids, msg.rows, finished, strict=True):
            if not done:
                half.commit(self._prefixed(rid), list(row.token_ids))
                lengths[rid] += len(row.token_ids)
        if msg.abandoned:  # the draft's state may be behind: the rows leave it
            logger.warning(
                "stream %d: chain run %d abandoned by the target; releasing %d requests",
                self.stream,
                run.run_id,
                len(run.request_ids),
            )
        half.end(finished)
        released = [rid for rid, done in zip(run.request_ids, finished, strict=True) if done]
        self.session.forget(released)
        self.engine.untrack(self.stream, released)
        return released

    def drop_unstarted(self) -> None:
        """A run that no step reached when the stream's next message is not its step: the
        target did not take the draft's answer in time and never started it."""
        run = self.run
        if run is None or run.step:
            return
        logger.info("stream %d: chain run %d never started; dropped", self.stream, run.run_id)
        run.half.cancel()
        self.engine.chain_run = None

    def close(self) -> None:
        """The stream ended: a run of it ends too (its requests are released with the stream)."""
        if self.run is not None:
            self.engine.chain_run = None
        self._chains.clear()
