"""Slow readers: a Generate stream whose client does not take its messages is cut off, so a
client that stops reading cannot hold an admission slot and the target's KV pages.

gRPC's flow control holds a response back while the client's HTTP/2 window is full: the
servicer's ``yield`` returns only once the transport took the message. So what a client that
does not read costs is bounded in bytes (its window in the transport, the one message the
servicer is writing, and the request's commits not turned into messages yet, at most its token
budget) and, with a `ReadWatch`, in time: a message that waits longer than
``slow_reader_timeout_s`` cuts the request off. It leaves the running set (its admission slot
goes to the next request) and the target aborts it (its pages are freed); should the client read
again, it gets what was written and then RESOURCE_EXHAUSTED. gRPC gives a servicer no way to
reset a stream whose write waits, so the call itself stays open until the client reads or goes
away, holding that one message and nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

CUT_OFF_CODE = grpc.StatusCode.RESOURCE_EXHAUSTED


class ReadWatch:
    """Times the writes of one stream: ``writing`` before a message is yielded, ``written``
    once the transport took it; ``on_timeout`` runs (once) when a write outlasts the timeout."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[], None]) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._timer: asyncio.TimerHandle | None = None
        self.expired = False  # a write outlasted the timeout: the request was cut off

    @property
    def reason(self) -> str:
        return (
            f"cut off: the client read nothing for {self.timeout_s:g} s "
            "(the gateway's slow_reader_timeout_s)"
        )

    def writing(self) -> None:
        if self._timer is None and not self.expired:
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire)

    def written(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        self.expired = True
        self._on_timeout()
