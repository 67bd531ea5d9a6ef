"""Target failover at the gateway (gateway/failover.py) against `EchoTarget`
(tests/helpers/gateway.py), whose server the tests stop and start again on the same port: an
in-flight request is re-admitted with its prompt plus what it streamed and the budget left, and
its client sees one stream (text, logprobs, usage); a queued one keeps waiting and its slot
bound holds; a new one is refused at once; an abort during the outage, a request complete when
the target went, the wait bound, the re-admission bound, and a target back with another model or
a shorter context."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.detokenize import IncrementalDetokenizer
from gateway.failover import MAX_RESUMES
from tandem.models.tokenizer import load_tokenizer
from tandem.v1 import common_pb2, gateway_pb2, target_pb2
from tests.helpers.gateway import (
    ABORT,
    EOS,
    LENGTH,
    STOP,
    EchoTarget,
    Stack,
    generate,
    ids_request,
    run,
    stack,
    start_target,
    wait_until,
)


def _port(s: Stack) -> int:
    return int(s.gateway.client.address.rsplit(":", 1)[1])


# The gateway reconnects to a restarted target within its backoff (at most 2 s); on a loaded
# two-core machine that has taken more than 5 s (the wait's default).
RECONNECT_S = 15.0


async def _restart(s: Stack, target: EchoTarget | None = None) -> EchoTarget:
    """Stops the target's server and serves a fresh target on the same port."""
    await s.target_server.stop(0)
    target = target or EchoTarget(step_s=0.01)
    s.target_server, _ = await start_target(target, _port(s))
    s.target = target
    return target


async def _collect(call: Any) -> tuple[list[int], str, list[float], gateway_pb2.GenerateComplete]:
    tokens: list[int] = []
    text, logprobs = "", []
    while (response := await call.read()) is not grpc.aio.EOF:  # read(): some were read before
        if response.HasField("chunk"):
            tokens += response.chunk.token_ids
            text += response.chunk.text
            logprobs += response.chunk.logprobs
        elif response.HasField("complete"):
            return tokens, text, logprobs, response.complete
        # An error in the stream: the status follows.
    raise AssertionError("the stream ended without a completion")


def test_in_flight_requests_continue_across_two_target_restarts(words: Path) -> None:
    prompt, budget = [5, 6, 7], 40

    async def scenario() -> None:
        async with stack(words, step_s=0.01, failover_wait_s=10, max_running=1) as s:
            call = s.stub.Generate(ids_request(prompt, max_new_tokens=budget, logprobs=True))
            first = await call.read()
            queued = asyncio.create_task(
                _collect(s.stub.Generate(ids_request([9], max_new_tokens=3)))
            )
            head = list(first.chunk.token_ids)
            await wait_until(lambda: s.gateway.servicer.admission.num_waiting == 1)
            readmits: list[target_pb2.AdmitCommand] = []
            for _ in range(2):  # the target dies twice while the request streams
                target = await _restart(s)
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # a new one: at once
                    await generate(s.stub, ids_request([5], max_new_tokens=2))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "not connected" in (refused.value.details() or "")
                # The request keeps its slot, so the queued one still waits.
                assert s.gateway.servicer.admission.num_running == 1
                assert s.gateway.servicer.admission.num_waiting == 1
                await wait_until(lambda t=target: len(t.admits) == 1, RECONNECT_S)  # type: ignore[misc]
                readmits.append(target.admits[0])
                await asyncio.sleep(0.05)  # a few commits from this target
            rest, text, logprobs, complete = await _collect(call)
            tokens = head + rest
            after = await queued
        text = first.chunk.text + text
        logprobs = list(first.chunk.logprobs) + logprobs
        # One stream: every token once, the budget kept, usage of the original prompt.
        assert len(tokens) == budget and complete.finish_reason == LENGTH
        assert complete.usage.prompt_tokens == len(prompt)
        assert complete.usage.completion_tokens == budget
        assert len(logprobs) == budget
        # Each re-admission: the prompt plus what was streamed, the budget left.
        ids = [r.request_id for r in readmits]
        assert len(set(ids)) == 2
        for readmit in readmits:
            streamed = len(readmit.prompt_token_ids) - len(prompt)
            assert streamed >= len(head)
            assert list(readmit.prompt_token_ids) == prompt + tokens[:streamed]
            assert readmit.sampling.max_new_tokens == budget - streamed
            assert readmit.sampling.logprobs and readmit.sampling.ignore_eos is False
        # The text continues as one detokenizer over the whole output would have it.
        tokenizer = load_tokenizer(words)
        whole = IncrementalDetokenizer(tokenizer, prompt)
        assert text == whole.add(tokens) + whole.flush()
        assert after[3].finish_reason == LENGTH  # the queued request ran once a slot was free

    run(scenario)


async def _read_tokens(call: Any, n: int) -> None:
    """Reads chunks until ``n`` tokens came."""
    while n > 0:
        response = await call.read()
        n -= len(response.chunk.token_ids)


class Unfinished(EchoTarget):
    """Streams every token of a request but never its last commit's finish: the target goes
    between a request's last token and the commit that would have ended it."""

    def _advance(self, r: Any) -> target_pb2.Commit | None:
        if r.output and not r.abort_reason and _complete(r.admit.sampling, r.output):
            return None
        commit = super()._advance(r)
        if commit is not None and not r.abort_reason:
            commit.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
            commit.ClearField("usage")
        return commit


def _complete(sampling: common_pb2.SamplingParams, output: list[int]) -> bool:
    last = output[-1]
    eos = last == EOS and not sampling.ignore_eos
    return eos or last in sampling.stop_token_ids or len(output) >= sampling.max_new_tokens


def test_aborts_complete_requests_and_the_wait_is_bounded(words: Path) -> None:
    async def body() -> None:
        async with stack(words, step_s=0.01, failover_wait_s=1.5) as s:
            # The stream that reached the new target, not a count of the gateway's connects: a
            # first stream the old target never took is retried by gRPC onto the new one.
            restarted = await _restart(s, Unfinished(step_s=0.05))
            await wait_until(
                lambda: restarted.controls == 1 and s.gateway.client.connected, RECONNECT_S
            )
            done = s.stub.Generate(ids_request([5], max_new_tokens=4))
            eos = s.stub.Generate(ids_request([5, EOS, 6], max_new_tokens=20))
            aborted_request = ids_request([7, 8], max_new_tokens=60)
            aborted_request.request_id = "aborted"
            aborted = s.stub.Generate(aborted_request)
            waits = s.stub.Generate(ids_request([7, 8], max_new_tokens=60))
            for call, streamed in ((done, 4), (eos, 2), (aborted, 1), (waits, 1)):
                await _read_tokens(call, streamed)  # all of done's and eos's: they stall
            await s.target_server.stop(0)  # and it does not come back
            started = asyncio.get_running_loop().time()
            # Complete when the target went: complete here, at once.
            _, _, _, complete = await _collect(done)
            assert complete.finish_reason == LENGTH and complete.usage.completion_tokens == 4
            _, _, _, complete = await _collect(eos)
            assert complete.finish_reason == STOP and complete.usage.completion_tokens == 2
            # Aborted while it waits: ABORT with what it streamed.
            reply = await s.stub.Abort(gateway_pb2.AbortRequest(request_ids=["aborted"]))
            assert list(reply.aborted_request_ids) == ["aborted"]
            _, _, _, complete = await _collect(aborted)
            assert complete.finish_reason == ABORT and complete.usage.completion_tokens >= 1
            assert asyncio.get_running_loop().time() - started < 1.0
            # The others wait as long as the setting says, then UNAVAILABLE saying why.
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await _collect(waits)
            waited = asyncio.get_running_loop().time() - started
            assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "did not come back within 1.5 s" in (gone.value.details() or "")
            assert 1.4 < waited < 5.0, waited
            assert s.gateway.servicer.admission.num_running == 0

    run(body)


def test_a_request_is_readmitted_a_bounded_number_of_times(words: Path) -> None:
    async def body() -> None:
        async with stack(words, step_s=0.01, failover_wait_s=10) as s:
            call = s.stub.Generate(ids_request([5, 6], max_new_tokens=60))
            assert (await call.read()).chunk.token_ids
            for _ in range(MAX_RESUMES):
                target = await _restart(s)
                await wait_until(lambda t=target: len(t.admits) == 1, RECONNECT_S)  # type: ignore[misc]
                target.paused = True  # no progress: the request is still in flight
            await s.target_server.stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await _collect(call)
            assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"lost {MAX_RESUMES + 1} times" in (gone.value.details() or "")

    run(body)


class Renamed(EchoTarget):
    """A target that serves another model."""

    async def GetInfo(self, request: Any, context: Any) -> target_pb2.TargetServiceGetInfoResponse:
        info = await super().GetInfo(request, context)
        info.model_id = "another"
        return info


def test_a_target_back_with_another_model_gets_no_readmission(words: Path) -> None:
    async def body() -> None:
        async with stack(words, step_s=0.01, failover_wait_s=10) as s:
            call = s.stub.Generate(ids_request([5, 6], max_new_tokens=60))
            assert (await call.read()).chunk.token_ids
            renamed = await _restart(s, Renamed(step_s=0.01))
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await _collect(call)
            assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "came back serving 'another', not 'echo'" in (gone.value.details() or "")
            assert renamed.admits == []

    run(body)


class Shorter(EchoTarget):
    """A target with a shorter context."""

    async def GetInfo(self, request: Any, context: Any) -> target_pb2.TargetServiceGetInfoResponse:
        info = await super().GetInfo(request, context)
        info.max_model_len = 8
        return info


def test_a_request_that_fills_the_new_context_completes_with_length(words: Path) -> None:
    async def body() -> None:
        async with stack(words, step_s=0.01, failover_wait_s=10) as s:
            call = s.stub.Generate(ids_request([5, 6], max_new_tokens=60))
            await _read_tokens(call, 6)  # 2 + 6 tokens fill a context of 8
            shorter = await _restart(s, Shorter(step_s=0.01))
            _, _, _, complete = await _collect(call)
            assert complete.finish_reason == LENGTH
            assert complete.usage.completion_tokens >= 6
            assert shorter.admits == []

    run(body)
