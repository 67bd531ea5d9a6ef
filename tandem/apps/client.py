"""A client of the public API: ``tandem generate --server`` runs on it, and it shows how to call
the gateway from Python (docs/client.md).

A batch keeps at most ``max_in_flight`` requests open at once (by default the gateway's own
admission limit, ``max_running`` from its GetServerInfo), so a file of any length goes through
without flooding the gateway's queue. A request the gateway refuses for load
(RESOURCE_EXHAUSTED with a ``google.rpc.RetryInfo``: its queue is full, or the target's KV pool
is) or cannot serve now (UNAVAILABLE: the target or the gateway is restarting) is sent again,
no sooner than the RetryInfo's delay and with exponential backoff beyond it (tenacity). A
RESOURCE_EXHAUSTED without a RetryInfo (a request too large) is final. A retried request starts
over and its record holds only the attempt that completed, so no token is lost or repeated;
prompt i's seed is the same on every attempt, so a seeded sample is the same too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)
from tenacity.wait import wait_base

from tandem.serving.rpc import channel_options
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
# In flight when the gateway does not report its limits (one from before GetServerInfo had
# them): its default --max-running.
DEFAULT_MAX_IN_FLIGHT = 64
_STATUS_DETAILS = "grpc-status-details-bin"

Prompt = str | list[int]
OnRetry = Callable[[grpc.StatusCode, float], None]  # the refusal's code, the wait before retry
OnDone = Callable[[int, dict[str, Any]], None]  # a prompt's index and its record


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently a refused request is sent again."""

    attempts: int = 8  # in all, the first included; 1: never retry
    initial_backoff_s: float = 0.25  # the backoff doubles from here, with jitter
    max_backoff_s: float = 30.0  # the longest wait, a server's RetryInfo delay included

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts: must be >= 1, got {self.attempts}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("initial_backoff_s: must be > 0 and <= max_backoff_s")

    def backoff(self) -> wait_base:
        """Doubling from ``initial_backoff_s`` up to ``max_backoff_s``, plus as much jitter, so
        requests refused together do not come back together."""
        doubling = wait_exponential(multiplier=self.initial_backoff_s, max=self.max_backoff_s)
        return doubling + wait_random(0, self.initial_backoff_s)


class GenerateFailed(Exception):
    """A prompt of a batch failed for good (a final error, or its retries ran out)."""

    def __init__(self, index: int, error: BaseException) -> None:
        self.index = index
        self.code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
        what = f"{self.code.name}: {detail}" if self.code is not None else detail
        super().__init__(f"prompt {index}: {what}")


def retry_delay(error: BaseException) -> float | None:
    """The delay the ``google.rpc.RetryInfo`` in an error's status details asks for, if any."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return None
    for key, value in error.trailing_metadata() or ():
        if key != _STATUS_DETAILS or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            return None
        for detail in status.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return float(info.retry_delay.ToNanoseconds()) / 1e9
    return None


def retryable(error: BaseException) -> bool:
    """UNAVAILABLE, and RESOURCE_EXHAUSTED for load (it carries a RetryInfo; a message too
    large does not, and is final)."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return False
    code = error.code()
    return code == grpc.StatusCode.UNAVAILABLE or (
        code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_delay(error) is not None
    )


async def generate_one(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    prompt: Prompt,
    sampling: common_pb2.SamplingParams,
) -> dict[str, Any]:
    """Streams one generation, one attempt; returns what ``tandem generate --json`` prints. A
    prompt of token ids is sent as ids and not detokenized (``text`` is then empty)."""
    token_ids: list[int] = []
    text: list[str] = []
    record: dict[str, Any] = {"prompt": prompt}
    if isinstance(prompt, str):
        request = gateway_pb2.GenerateRequest(text=prompt, sampling=sampling)
    else:
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling=sampling,
            stream_options=gateway_pb2.StreamOptions(detokenize=False),
        )
    error: gateway_pb2.GenerateError | None = None
    async for response in stub.Generate(request):
        which = response.WhichOneof("payload")
        if which == "chunk":
            token_ids += response.chunk.token_ids
            text.append(response.chunk.text)
        elif which == "complete":
            usage = response.complete.usage
            record.update(
                finish_reason=_FINISH.get(response.complete.finish_reason, "unknown"),
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                accept_length=round(usage.accept_length, 4),
                draft_tokens=usage.draft_tokens,
                accepted_tokens=usage.accepted_tokens,
                verify_steps=usage.verify_steps,
            )
        elif which == "error":  # the gateway ends the stream with its status code next
            error = response.error
    if error is not None or "finish_reason" not in record:
        why = f"{error.field}: {error.message}" if error is not None else "no completion"
        raise RuntimeError(why)
    record.update(token_ids=token_ids, text="".join(text))
    return record


async def generate_retrying(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    prompt: Prompt,
    sampling: common_pb2.SamplingParams,
    *,
    retry: RetryPolicy = RetryPolicy(),
    on_retry: OnRetry | None = None,
) -> dict[str, Any]:
    """``generate_one``, sent again while the gateway refuses it for load or is unavailable."""
    backoff = retry.backoff()

    def wait(state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome is not None else None
        hinted = retry_delay(error) if error is not None else None
        return min(max(backoff(state), hinted or 0.0), retry.max_backoff_s)

    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        assert isinstance(error, grpc.aio.AioRpcError)  # retryable() let only these through
        delay = state.upcoming_sleep
        code, attempt = error.code(), state.attempt_number
        logger.debug("%s (%s); retry %d in %.2f s", code.name, error.details(), attempt, delay)
        if on_retry is not None:
            on_retry(error.code(), delay)

    async for attempt in AsyncRetrying(
        retry=retry_if_exception(retryable),
        wait=wait,
        stop=stop_after_attempt(retry.attempts),
        before_sleep=before_sleep,
        reraise=True,
    ):
        with attempt:
            record = await generate_one(stub, prompt, sampling)
    return record


async def generate_batch(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    prompts: Sequence[Prompt],
    sampling: Sequence[common_pb2.SamplingParams],
    *,
    max_in_flight: int,
    retry: RetryPolicy = RetryPolicy(),
    on_done: OnDone | None = None,
    on_retry: OnRetry | None = None,
) -> list[dict[str, Any]]:
    """Every prompt through the gateway, at most ``max_in_flight`` at once; records in prompt
    order (``on_done`` gets each with its index as it completes). The first prompt that fails
    for good cancels the rest (the gateway aborts them) and raises ``GenerateFailed``."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight: must be >= 1, got {max_in_flight}")
    if len(sampling) != len(prompts):
        raise ValueError("sampling: one per prompt")
    records: list[dict[str, Any] | None] = [None] * len(prompts)
    pending = iter(range(len(prompts)))  # shared: each worker takes the next index

    async def worker() -> None:
        for i in pending:
            try:
                records[i] = await generate_retrying(
                    stub, prompts[i], sampling[i], retry=retry, on_retry=on_retry
                )
            except (grpc.aio.AioRpcError, RuntimeError) as exc:
                raise GenerateFailed(i, exc) from exc
            if on_done is not None:
                on_done(i, records[i])  # type: ignore[arg-type]

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(max_in_flight, len(prompts))):
                group.create_task(worker())
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    done = [r for r in records if r is not None]
    assert len(done) == len(prompts)  # every index was taken by a worker that finished
    return done


async def server_max_in_flight(stub: gateway_pb2_grpc.GatewayServiceStub) -> int:
    """The in-flight bound a batch uses by default: the gateway's ``max_running``, so the
    target's running set stays full and the gateway's queue is left to other clients."""
    info = await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=30)
    return info.max_running or DEFAULT_MAX_IN_FLIGHT


def generate_remote(
    address: str,
    prompts: Sequence[Prompt],
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repetition_penalty: float,
    seed: int | None,
    max_new_tokens: int,
    ignore_eos: bool,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_tokens: int = 0,
    max_in_flight: int | None = None,
    retry: RetryPolicy = RetryPolicy(),
    on_start: Callable[[int], None] | None = None,
    on_done: OnDone | None = None,
    on_retry: OnRetry | None = None,
) -> list[dict[str, Any]]:
    """Every prompt through the gateway at ``address``, prompt i with seed+i; at most
    ``max_in_flight`` at once (None: ``server_max_in_flight``), which ``on_start`` is told."""
    sampling = []
    for i in range(len(prompts)):
        params = common_pb2.SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            min_tokens=min_tokens,
        )
        if seed is not None:
            params.seed = seed + i
        sampling.append(params)

    async def run() -> list[dict[str, Any]]:
        async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            bound = max_in_flight
            if bound is None:
                async for attempt in AsyncRetrying(
                    retry=retry_if_exception(retryable),
                    wait=retry.backoff(),
                    stop=stop_after_attempt(retry.attempts),
                    reraise=True,
                ):
                    with attempt:
                        bound = await server_max_in_flight(stub)
            assert bound is not None
            if on_start is not None:
                on_start(bound)
            return await generate_batch(
                stub,
                prompts,
                sampling,
                max_in_flight=bound,
                retry=retry,
                on_done=on_done,
                on_retry=on_retry,
            )

    return asyncio.run(run())
