"""Several completions of one prompt in one Generate call (``GenerateRequest.n`` > 1).

Each completion is a request of its own, ``REQUEST_ID/i``, that takes the one-request path
whole (admission, lanes, stop strings, failover, the slow-reader cut-off); with a seed,
completion i samples from seed + i, so each is what a lone request with that seed returns. A text
prompt is tokenized once. Their messages interleave in the order they are ready, each carrying
the request's id and its index; a queue of one message per completion passes on each one's
back-pressure. The first error ends the call and every completion with it; so does the client
going away. ``Abort`` with the request's id reaches every completion (``Groups``).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Container, Iterator
from typing import Any, cast

import grpc

from tandem.errors import InvalidRequest
from tandem.v1 import gateway_pb2

MAX_N = 16
_SEED_MOD = 2**63  # seeds are in [0, 2**63) (tandem.sampling)

Generate = Callable[
    [gateway_pb2.GenerateRequest, grpc.aio.ServicerContext],
    AsyncIterator[gateway_pb2.GenerateResponse],
]


class Groups:
    """The completions' ids of each running n > 1 request, by principal and request id."""

    def __init__(self) -> None:
        self._ids: dict[tuple[Any, str], list[str]] = {}

    def expand(self, principal: Any, request_id: str) -> list[str]:
        return self._ids.get((principal, request_id), [request_id])

    def refuse_running(
        self,
        principal: Any,
        request: gateway_pb2.GenerateRequest,
        taken: Container[tuple[Any, str]],
    ) -> None:
        """InvalidRequest where the caller runs a request under this one's id already: an n > 1
        one, or (for an n > 1 request) a lone one (``taken``; the lone path checks its own)."""
        key = (principal, request.request_id)
        if request.HasField("request_id") and (
            key in self._ids or (request.n > 1 and key in taken)
        ):
            raise InvalidRequest("request_id", f"{request.request_id!r} is already running")

    @contextlib.contextmanager
    def running(
        self, principal: Any, request_id: str, subs: list[gateway_pb2.GenerateRequest]
    ) -> Iterator[None]:
        """Holds the completions' ids under the request's while it runs."""
        key = (principal, request_id)
        self._ids[key] = [sub.request_id for sub in subs]
        try:
            yield
        finally:
            del self._ids[(principal, request_id)]


def split(
    request: gateway_pb2.GenerateRequest, prompt_ids: list[int] | None
) -> tuple[str, list[gateway_pb2.GenerateRequest]]:
    """The request's id and its completions' requests (the prompt as ids where given)."""
    if request.n > MAX_N:
        raise InvalidRequest("n", f"must be in [0, {MAX_N}], got {request.n}")
    request_id = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
    subs = []
    for i in range(request.n):
        sub = gateway_pb2.GenerateRequest()
        sub.CopyFrom(request)
        sub.ClearField("n")
        sub.request_id = f"{request_id}/{i}"
        if prompt_ids is not None:
            sub.token_ids.ids[:] = prompt_ids
            sub.ClearField("add_special_tokens")
        if request.sampling.HasField("seed"):
            sub.sampling.seed = (request.sampling.seed + i) % _SEED_MOD
        subs.append(sub)
    return request_id, subs


async def interleave(
    generate: Generate,
    request_id: str,
    subs: list[gateway_pb2.GenerateRequest],
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Every completion's messages, as each is ready, with ``request_id`` and its index."""
    queue: asyncio.Queue[tuple[int, gateway_pb2.GenerateResponse | BaseException | None]]
    queue = asyncio.Queue(maxsize=len(subs))

    async def pump(index: int, sub: gateway_pb2.GenerateRequest) -> None:
        try:
            responses = cast(AsyncGenerator[gateway_pb2.GenerateResponse], generate(sub, context))
            async with contextlib.aclosing(responses):
                async for response in responses:
                    await queue.put((index, response))
            await queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the call's status: the first one ends the call
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, sub)) for i, sub in enumerate(subs)]
    try:
        left = len(subs)
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            item.request_id, item.index = request_id, index
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
