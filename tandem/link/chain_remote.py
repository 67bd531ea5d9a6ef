"""The draft's half of a device-chain run (``tandem/target/device_chain.py``) in a draft service:
the target's end of docs/device-cycle.md's messages on the local stream.

``RemoteChain`` stands where an in-process run has a ``DraftChain``, with the same calls. It
works only over a local stream whose hellos agreed on ``TENSOR_TRANSPORT_CUDA_IPC`` (both
services on one GPU) or ``_SHM`` (CPU, the stand-in the tests use), and talks to
``draft_service/chain.py``:

- ``begin``: ``ChainBegin`` (the run's rows and committed lengths; for a bucket new to the
  stream, the descriptions of this process's ``Chains`` buffers; the first time, this side's
  interprocess event) answered by ``ChainReady`` (the draft's ``Outcome`` descriptions and
  event the first time) or a refusal, which leaves the ordinary cycle running.
- ``launch``, after the target's half is queued: this side's event recorded, ``ChainStep``
  (the lengths last read and the steps unread, from which the draft reserves its pages); the
  draft queues its half behind that event and answers ``ChainStepDone``; only then does this
  stream wait for the draft's event, so the next verify reads the chains the draft wrote. No
  answer by the deadline (or a refusal) fails the step: the run ends and the draft's chains
  are not used again (``abandoned``).
- ``end``: ``ChainEnd`` with each row's tokens committed since ``begin`` and whether it
  finished; the draft appends them and rebuilds its host state. An abandoned run's rows are
  released on both sides: they decode without speculation, their output unchanged.

Each buffer is allocated by its reader (the draft owns ``Outcome``, this process ``Chains``)
and described once per stream and bucket; a new link starts over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from tandem.graphs.base import Bucket
from tandem.link import ipc
from tandem.link.local import LocalLink
from tandem.spec.chain import Chains, DraftHalf, Outcome
from tandem.v1 import draft_pb2

logger = logging.getLogger(__name__)

_QUIET_S = 1.0  # after a refusal, no run starts for this long (each try is a round trip)


class RemoteChain(DraftHalf):
    """A draft service's share of a run, seen from the target (module docstring)."""

    def __init__(
        self,
        num_steps: int,
        device: torch.device,
        *,
        chain_link: Callable[[], LocalLink | None],
        deadline_s: float,
    ) -> None:
        self.chain_link = chain_link  # the draft client's local link, when it runs chains
        self.deadline_s = deadline_s
        self.num_steps = num_steps
        self.width = num_steps + 1
        self.device = device
        self.on_cuda = self.device.type == "cuda"
        self.request_ids: list[str] = []
        self.outcome: Outcome | None = None
        self.chains: Chains | None = None
        self.failed = ""  # why the run's last step went without the draft ('' when it did not)
        self.steps: dict[Bucket, int] = {}  # steps launched per bucket
        self.refusals = 0
        self._quiet_until = 0.0
        self._link: LocalLink | None = None  # the link the buffers below belong to
        self._outcomes: dict[Bucket, Outcome] = {}  # the draft's, mapped here
        self._described: set[Bucket] = set()  # buckets whose Chains the draft has mapped
        self._mine: torch.cuda.Event | None = None
        self._theirs: torch.cuda.Event | None = None
        self._run_id = 0
        self._step = 0
        self._bucket = Bucket(1, self.width)
        self._lengths: list[int] = []
        self._unread = 0
        self._tokens: list[list[int]] = []  # per row: committed since begin
        self._rows: dict[str, int] = {}

    def link(self) -> LocalLink | None:
        """The local link when it can carry a run for this device, else None."""
        link = self.chain_link()
        if link is None:
            return None
        if link is not self._link:  # a new stream: nothing of the old one is mapped there
            self._link = link
            self.epoch += 1
            self._outcomes.clear()
            self._described.clear()
            self._mine = self._theirs = None
        return link

    def ready(self) -> bool:
        """Whether a run may start: a link that can carry it, no refusal just now."""
        return self.link() is not None and time.monotonic() >= self._quiet_until

    def eligible(self, request_id: str, num_tokens: int) -> bool:
        """Whether the draft holds ``request_id`` at ``num_tokens`` committed tokens, as far
        as this stream has told it (the draft checks again at ``begin``)."""
        link = self.link()
        return (
            link is not None
            and link.stream.tracked.get(request_id) == num_tokens
            and request_id not in link.stream.outbox
        )

    def reserve(self, lengths: Sequence[int], unread: int) -> bool:
        """Kept for the next message: the draft reserves its pages itself."""
        self._lengths, self._unread = list(lengths), unread
        return True

    def begin(
        self, request_ids: Sequence[str], bucket: Bucket, *, features_width: int | None
    ) -> Outcome | None:
        """``ChainBegin`` and its answer: the draft's ``Outcome`` for ``bucket``, or None when
        the draft refused, did not answer or the link is gone (the run does not start)."""
        assert self.chains is not None, "begin: the target's chains first"
        link = self.link()
        if link is None:
            return None
        self._run_id += 1
        msg = draft_pb2.ChainBegin(
            run_id=self._run_id,
            batch_size=bucket.batch_size,
            num_steps=self.num_steps,
            request_ids=list(request_ids),
            committed_lens=self._lengths,
        )
        if bucket not in self._described:
            msg.chains.extend([ipc.describe(self.chains.tokens), ipc.describe(self.chains.valid)])
        if self.on_cuda and self._mine is None:
            self._mine = torch.cuda.Event(interprocess=True)
            self._mine.record()
            msg.event = self._mine.ipc_handle()
        run_id = self._run_id
        answer = link.call(
            draft_pb2.SpeculateRequest(chain_begin=msg),
            self._deadline(),
            lambda a: a.HasField("chain_ready") and a.chain_ready.run_id == run_id,
        )
        ready = None if answer is None else answer.chain_ready
        if ready is None or ready.refused:
            why = "no answer" if ready is None else ready.refused
            logger.info("device chain: the draft refused run %d: %s", self._run_id, why)
            self.refusals += 1
            self._quiet_until = time.monotonic() + _QUIET_S
            return None
        try:
            self._map(ready, bucket, features_width)
        except ValueError as exc:  # a malformed answer: this stream runs no chains
            logger.warning("device chain: the draft's buffers: %s; closing the stream", exc)
            link.close()
            return None
        self._described.add(bucket)
        self.request_ids = list(request_ids)
        self._rows = {rid: i for i, rid in enumerate(self.request_ids)}
        self._tokens = [[] for _ in self.request_ids]
        self._bucket, self._step, self.failed = bucket, 0, ""
        self.outcome = self._outcomes[bucket]
        return self.outcome

    def _map(self, ready: draft_pb2.ChainReady, bucket: Bucket, features_width: int | None) -> None:
        if self.on_cuda and self._theirs is None:
            if not ready.event:
                raise ValueError("no event handle in the first ChainReady")
            self._theirs = ipc.open_event(bytes(ready.event), self.device.index)
        if bucket in self._outcomes:
            return
        bs, w = bucket.batch_size, self.width
        described = [bytes(d) for d in ready.outcome]
        if len(described) not in (4, 5):
            raise ValueError(f"{len(described)} Outcome descriptions, not 4 or 5")
        link = self._link
        assert link is not None
        features = None
        if len(described) == 5:
            if features_width is None:
                raise ValueError("the draft reads features this target does not capture")
            shape = (bs * w, features_width)
            features = ipc.open_buffer(described[4], shape, link.stream.hidden_dtype)
        self._outcomes[bucket] = Outcome(
            base=ipc.open_buffer(described[0], (bs,), torch.int64),
            accepted=ipc.open_buffer(described[1], (bs,), torch.int64),
            new=ipc.open_buffer(described[2], (bs, w), torch.int64),
            alive=ipc.open_buffer(described[3], (bs,), torch.bool),
            features=features,
        )

    def launch(self) -> bool:
        """After the target's half: ``ChainStep`` and its answer, then this stream waits for
        the draft's half. False (``failed`` says why) when the draft did not queue it."""
        link = self._link
        assert link is not None and self.chains is not None
        self._step += 1
        self.steps[self._bucket] = self.steps.get(self._bucket, 0) + 1
        if self._mine is not None:
            self._mine.record()
        msg = draft_pb2.ChainStep(
            run_id=self._run_id, step=self._step, committed_lens=self._lengths, unread=self._unread
        )
        run_id, step = self._run_id, self._step
        answer = link.call(
            draft_pb2.SpeculateRequest(chain_step=msg),
            self._deadline(),
            lambda a: (a.chain_step_done.run_id, a.chain_step_done.step) == (run_id, step),
        )
        done = None if answer is None else answer.chain_step_done
        if done is None:
            self.failed = link.broken or "no answer by the deadline"
        elif done.failed:
            self.failed = done.failed
        if self.failed:
            logger.warning("device chain: step %d without the draft: %s", self._step, self.failed)
            return False
        if self._theirs is not None:
            torch.cuda.current_stream(self.device).wait_event(self._theirs)
        return True

    def commit(self, request_id: str, tokens: list[int]) -> None:
        self._tokens[self._rows[request_id]].extend(tokens)

    def end(self, finished: Sequence[bool]) -> None:
        """``ChainEnd``; the stream's count of each row follows. After a failed step every row
        leaves the draft (the caller stops speculating them)."""
        abandoned = bool(self.failed)
        rows = [
            draft_pb2.ChainRow(token_ids=tokens, finished=done)
            for tokens, done in zip(self._tokens, finished, strict=True)
        ]
        link = self._link
        if link is not None:
            end = draft_pb2.ChainEnd(run_id=self._run_id, rows=rows, abandoned=abandoned)
            link.post(draft_pb2.SpeculateRequest(chain_end=end))
            tracked = link.stream.tracked
            for rid, tokens, done in zip(self.request_ids, self._tokens, finished, strict=True):
                if abandoned or done:
                    tracked.pop(rid, None)
                elif rid in tracked:
                    tracked[rid] += len(tokens)
        self.request_ids, self._tokens, self._rows = [], [], {}
        self.outcome = self.chains = None

    def _deadline(self) -> float:
        return time.monotonic() + self.deadline_s
