"""Requests the draft lost, taken in again.

A draft can lose a request's state: a restarted draft service, a broken stream, a full draft
pool (``Drafter.take_dropped``), a device-chain run whose draft failed, a prompt whose features
were not all captured. The target has no copy of the features the draft needs to take it in
(its prompt's, its accepted tokens'), so once the draft is healthy again such a request is
recomputed: preempted, its KV freed, and prefilled again, which gathers them, and admitted as
a new prompt. It verifies without trees until then. Recomputing costs a prefill of the whole
sequence, so it is done at most ``MAX_READMISSIONS`` times a request and only with
``READMIT_MIN_TOKENS`` or more still to generate; otherwise the request finishes without
speculation. Nor is a request recomputed while the draft's KV pool (as its last answer
reported it) has no room for it and ``READMIT_HEADROOM`` more tokens: one a full draft pool
dropped would be dropped again, at the price of a prefill each time (32 requests of 2,048
tokens through the services ran at 0.32x of target-only so); it decodes without trees and is
looked at again at the next step. Greedy output is unchanged (a recomputed KV is the KV), and a
sampled request's generator goes on where it was.
"""

from __future__ import annotations

import logging

from tandem.spec.base import Drafter, DraftState
from tandem.target.scheduler import Scheduler

logger = logging.getLogger(__name__)

MAX_READMISSIONS = 2
READMIT_MIN_TOKENS = 32
# Tokens of room a readmitted request needs in the draft's pool beyond its own.
READMIT_HEADROOM = 256


def readmit_lost(scheduler: Scheduler, drafter: Drafter, max_model_len: int) -> None:
    """Recomputes the decoding requests that speculate but the draft does not track, once
    the draft is healthy (see the module docstring)."""
    lost = [r for r in scheduler.running if r.speculate and not r.in_draft and r.decoding]
    status = drafter.status()
    if not lost or status.state is not DraftState.HEALTHY:
        return
    # Tokens the draft's pool has free (None: not reported).
    free = (status.kv_pages_total - status.kv_pages_used) * status.kv_page_size
    draft_room = free if status.kv_pages_total else None
    for req in lost:
        room = req.length_limit(max_model_len) - req.num_tokens
        if req.readmissions >= MAX_READMISSIONS or room < READMIT_MIN_TOKENS:
            req.speculate = False
            continue
        if draft_room is not None:
            need = req.num_tokens + min(room, READMIT_HEADROOM)
            if need > draft_room:
                continue  # the draft could not hold it now: no trees for it this step
            draft_room -= need
        logger.info("request %s: recomputed to be taken in by the draft", req.request_id)
        req.readmissions += 1
        scheduler.recompute(req)
