"""Zero-loss target failover: an in-flight request outlives the loss of its target.

The gateway holds every request's prompt and the tokens it has streamed to the client. When the
control stream breaks (the target died, restarted, or a separate deployment went away), each
request that was admitted or waiting for admission waits for the target to come back at the same
address, for at most ``failover_wait_s``, and is then admitted again as its own continuation:
the prompt followed by the tokens already streamed, with the budget that is left
(``max_new_tokens`` minus what was streamed) and the same stop conditions and sampling values.
The client sees one uninterrupted stream: the servicer goes on with the same incremental
detokenizer and stop-string matcher, so text, token ids and logprobs continue where they were.

What the continuation is:

- greedy output is the output of an undisturbed run (greedy decoding of prompt + streamed is the
  greedy continuation; the repetition penalty already counts prompt and output alike);
- sampled output continues from what was streamed, from a fresh random stream (the request's
  seed, when it has one, seeds the continuation again from its start), so it is a sample of the
  same distribution but not the tokens an undisturbed seeded run would have drawn;
- usage counts the original prompt and every streamed token; the speculation counts
  (draft_tokens, accepted_tokens, verify_steps) are the target's after the last re-admission,
  the lost target's being lost with it.

A request that was already complete when the target went (its budget spent, its last token a
stop token, the context full) completes at the gateway without the target; one that the client
aborts during the outage completes with ABORT; one whose target does not come back in time, or
comes back serving another model, fails with UNAVAILABLE saying why. A request re-admitted
``MAX_RESUMES`` times is not re-admitted again (a request that kills its target must not keep
killing it). Requests that arrive while the target is gone are refused at once with UNAVAILABLE
(the gateway's health is NOT_SERVING then); only those accepted before the loss wait. A waiting
request keeps its admission slot, so the bound on running requests holds through the outage.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.job import Job
from gateway.target_client import TargetClient, TargetUnavailable
from tandem.v1 import common_pb2

logger = logging.getLogger(__name__)

MAX_RESUMES = 3  # re-admissions of one request


class Failover:
    """Carries in-flight requests across target outages; one per gateway."""

    def __init__(self, client: TargetClient, wait_s: float) -> None:
        self.client = client
        self.wait_s = wait_s  # 0: no failover, a lost target fails its requests at once
        self._aborted: dict[str, asyncio.Event] = {}  # requests waiting, by Job.origin
        self._resumes: dict[str, tuple[str, int]] = {}  # Job.origin -> (first target id, count)

    def abort(self, origin: str) -> None:
        """An Abort for a request: one waiting for the target completes at once (ABORT)."""
        if (event := self._aborted.get(origin)) is not None:
            event.set()

    def forget(self, origin: str) -> None:
        """The request (``Job.origin``) ended at the gateway."""
        self._resumes.pop(origin, None)

    async def resume(self, job: Job, lost: TargetUnavailable) -> common_pb2.FinishReason | None:
        """Waits for the target and makes ``job.admit`` the request's continuation (a new id,
        the streamed tokens appended to the prompt, the budget left); returns None to admit
        it, or the finish reason of a request that ends here instead. Raises TargetUnavailable
        (saying why) when the request cannot go on."""
        if job.aborting:
            return common_pb2.FINISH_REASON_ABORT
        if (done := self._finished(job)) is not None:
            return done
        first, count = self._resumes.get(job.origin, (job.target_id, 0))
        if self.wait_s <= 0:
            raise lost
        if count >= MAX_RESUMES:
            raise TargetUnavailable(f"{lost}; lost {count + 1} times, not re-admitted again")
        model = self.client.info.model_id if self.client.info is not None else ""
        logger.warning(
            "request %s: %s; waiting up to %g s for the target (%d tokens streamed)",
            job.request_id,
            lost,
            self.wait_s,
            len(job.completion_ids),
        )
        if not await self._wait(job.origin):
            return common_pb2.FINISH_REASON_ABORT
        info = self.client.info
        if not self.client.connected or info is None:
            raise TargetUnavailable(
                f"target {self.client.address} did not come back within {self.wait_s:g} s ({lost})"
            )
        if model and info.model_id != model:
            raise TargetUnavailable(
                f"target {self.client.address} came back serving {info.model_id!r}, not {model!r}"
            )
        if (done := self._finished(job)) is not None:  # the new target's context may be shorter
            return done
        self._resumes[job.origin] = (first, count + 1)
        self._continue(job, f"{first}.{count + 1}", info.draft_kind)
        if job.span is not None:
            job.span.add_event("readmitted", {"tandem.streamed_tokens": len(job.completion_ids)})
        logger.info(
            "request %s re-admitted as %s after %d streamed tokens",
            job.request_id,
            job.target_id,
            len(job.completion_ids),
        )
        return None

    async def _wait(self, origin: str) -> bool:
        """Until the target is connected (True), the request is aborted (False) or the wait
        is over (True, still disconnected)."""
        aborted = self._aborted[origin] = asyncio.Event()
        waits = [
            asyncio.ensure_future(self.client.wait_connected()),
            asyncio.ensure_future(aborted.wait()),
        ]
        try:
            await asyncio.wait(waits, timeout=self.wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            del self._aborted[origin]
        return not aborted.is_set()

    def _finished(self, job: Job) -> common_pb2.FinishReason | None:
        """The finish reason of a request whose streamed tokens already complete it (the target
        went between its last token and its last commit)."""
        streamed = job.completion_ids
        if streamed:
            last, sampling = streamed[-1], job.admit.sampling
            eos = self.client.info.eos_token_ids if self.client.info is not None else ()
            if last in job.stop_token_ids or (not sampling.ignore_eos and last in eos):
                return common_pb2.FINISH_REASON_STOP
        if _budget(job) - len(streamed) <= 0:
            return common_pb2.FINISH_REASON_LENGTH
        info = self.client.info
        if info is not None and len(job.prompt_ids) + len(streamed) >= info.max_model_len:
            return common_pb2.FINISH_REASON_LENGTH
        return None

    @staticmethod
    def _continue(job: Job, target_id: str, draft_kind: common_pb2.DraftKind) -> None:
        budget = _budget(job)
        admit = job.admit
        admit.request_id = target_id
        admit.prompt_token_ids[:] = [*job.prompt_ids, *job.completion_ids]
        admit.sampling.max_new_tokens = budget - len(job.completion_ids)
        admit.speculation.draft_kind = draft_kind


def _budget(job: Job) -> int:
    """The request's max_new_tokens: what its current admit asks for plus what that admit's
    prompt already carries of the output."""
    admit = job.admit
    return admit.sampling.max_new_tokens + len(admit.prompt_token_ids) - len(job.prompt_ids)
