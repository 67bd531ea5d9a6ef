"""Admission control: at most `max_running` requests at the target, at most `max_queue` waiting.

A request takes a slot before it is admitted at the target and gives it back when it ends.
Waiters are served first come, first served; a request that would make the queue longer than
its bound is refused at once (`Overloaded`, which the servicer turns into RESOURCE_EXHAUSTED
with retry info), so memory and latency stay bounded however many clients call (docs/design.md
section 8, "overload"). A queued request can be withdrawn (`withdraw`, for Abort) or cancelled
(client gone) without disturbing the order of the others.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from tandem.errors import TandemError


class Overloaded(TandemError):
    """The running set and the queue are full (RESOURCE_EXHAUSTED); retry later."""


class Withdrawn(TandemError):
    """A queued request was aborted before it got a slot."""


class Admission:
    """Slots for running requests plus a bounded FIFO of waiters; one per gateway."""

    def __init__(self, *, max_running: int, max_queue: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_running = max_running
        self.max_queue = max_queue
        self._running: set[str] = set()
        self._waiters: OrderedDict[str, asyncio.Future[None]] = OrderedDict()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def can_acquire_now(self) -> bool:
        return not self._waiters and len(self._running) < self.max_running

    async def acquire(self, request_id: str) -> None:
        """Waits for a slot. Raises Overloaded when the queue is full and Withdrawn when the
        request is withdrawn while it waits."""
        if request_id in self._running or request_id in self._waiters:
            raise ValueError(f"request {request_id!r} already holds or awaits a slot")
        if self.can_acquire_now():
            self._running.add(request_id)
            return
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(
                f"{len(self._running)} requests running and {len(self._waiters)} queued "
                f"(limits {self.max_running} and {self.max_queue})"
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        try:
            await waiter
        except BaseException:
            # Cancelled or withdrawn while queued; if the slot was granted in the same tick,
            # hand it on rather than leak it.
            if self._waiters.get(request_id) is waiter:
                del self._waiters[request_id]
            elif request_id in self._running:
                self.release(request_id)
            raise
        # release() moved us from the waiters into the running set.
        assert request_id in self._running

    def release(self, request_id: str) -> None:
        """Gives a slot back and grants it to the oldest waiter; unknown ids are ignored."""
        self._running.discard(request_id)
        while self._waiters and len(self._running) < self.max_running:
            next_id, waiter = self._waiters.popitem(last=False)
            if waiter.done():
                continue
            self._running.add(next_id)
            waiter.set_result(None)

    def withdraw(self, request_id: str) -> bool:
        """Removes a queued request (its acquire raises Withdrawn); False if it is not queued."""
        waiter = self._waiters.pop(request_id, None)
        if waiter is None:
            return False
        if not waiter.done():
            waiter.set_exception(Withdrawn(f"request {request_id!r} aborted while queued"))
        return True
