"""The SMG worker protocol (``gateway.smg``) through a real gRPC channel to the gateway's
``--smg-port``, against `EchoTarget` (tests/helpers/gateway.py): streamed and unstreamed
generation with counts and logprobs, stop conditions, refusals by field, abort and a dropped
stream freeing the target, admission limits, health, model and server info, loads, and the
tokenizer bundle the router builds its tokenizer from."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from gateway.smg.server import SERVICE_NAME
from tandem.models.tokenizer import load_tokenizer
from tandem.serving.security import MIN_TOKEN_CHARS
from tandem.smg import common_pb2 as smg_common_pb2
from tandem.smg import sglang_scheduler_pb2 as smg_pb2
from tandem.smg import sglang_scheduler_pb2_grpc as smg_grpc
from tests.helpers.gateway import (
    ABORT,
    EOS,
    MAX_MODEL_LEN,
    SERVING,
    VOCAB,
    Stack,
    health_status,
    run,
    stack,
    wait_until,
)


@asynccontextmanager
async def worker(
    tokenizer: Path, **overrides: Any
) -> AsyncIterator[tuple[Stack, smg_grpc.SglangSchedulerStub, grpc.aio.Channel]]:
    """The stack with its SMG port on, and a stub on that port."""
    async with stack(tokenizer, smg_port=0, **overrides) as s:
        assert s.gateway.smg is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.gateway.smg.port}") as channel:
            yield s, smg_grpc.SglangSchedulerStub(channel), channel


def request(
    ids: list[int], *, rid: str = "r1", stream: bool = True, logprobs: bool = False, **sampling: Any
) -> smg_pb2.GenerateRequest:
    """A worker request as the router sends one: explicit sampling values (SGLang's)."""
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    return smg_pb2.GenerateRequest(
        request_id=rid,
        tokenized=smg_pb2.TokenizedInput(input_ids=ids),
        sampling_params=smg_pb2.SamplingParams(**{**params, **sampling}),
        return_logprob=logprobs,
        logprob_start_len=-1,
        stream=stream,
    )


async def collect(
    call: AsyncIterator[smg_pb2.GenerateResponse],
) -> tuple[list[smg_pb2.GenerateStreamChunk], smg_pb2.GenerateComplete]:
    chunks: list[smg_pb2.GenerateStreamChunk] = []
    async for response in call:
        assert response.request_id
        if response.HasField("chunk"):
            chunks.append(response.chunk)
        else:
            return chunks, response.complete
    raise AssertionError("no completion")


def test_streamed_generation_counts_and_logprobs(words: Path) -> None:
    async def body() -> None:
        async with worker(words, tokens_per_step=2) as (s, stub, _):
            chunks, done = await collect(
                stub.Generate(request([5, 6, 7, 8], logprobs=True, max_new_tokens=6))
            )
            assert [list(c.token_ids) for c in chunks] == [[5, 6], [7, 8], [5, 6]]
            assert [c.completion_tokens for c in chunks] == [2, 4, 6]
            assert all(c.prompt_tokens == 4 for c in chunks)
            for c in chunks:
                assert list(c.output_logprobs.token_logprobs) == [-0.5, -0.5]
                assert list(c.output_logprobs.token_ids) == list(c.token_ids)
            assert done.finish_reason == "length" and not done.output_ids  # chunks had them
            assert (done.prompt_tokens, done.completion_tokens) == (4, 6)
            # Speculation shows only as acceptance: 3 steps of 2 tokens, 1 draft token each.
            assert (done.spec_draft_tokens, done.spec_accepted_tokens) == (3, 3)
            (admit,) = s.target.admits
            assert admit.sampling.temperature == 0.0 and admit.sampling.top_k == 0
            assert admit.sampling.max_new_tokens == 6 and admit.sampling.logprobs

            # Logprobs only when asked for.
            chunks, _ = await collect(stub.Generate(request([5, 6], max_new_tokens=2)))
            assert chunks and not any(c.HasField("output_logprobs") for c in chunks)

    run(body)


def test_unstreamed_generation_is_one_completion(words: Path) -> None:
    async def body() -> None:
        async with worker(words) as (_, stub, _):
            call = stub.Generate(request([5, 6, 7], stream=False, logprobs=True, max_new_tokens=5))
            chunks, done = await collect(call)
            assert chunks == []
            assert list(done.output_ids) == [5, 6, 7, 5, 6]
            assert list(done.output_logprobs.token_ids) == [5, 6, 7, 5, 6]
            assert list(done.output_logprobs.token_logprobs) == [-0.5] * 5
            assert (done.finish_reason, done.completion_tokens) == ("length", 5)

    run(body)


def test_stop_token_ids_eos_and_stop_strings(words: Path) -> None:
    async def body() -> None:
        async with worker(words) as (s, stub, _):
            call = stub.Generate(request([5, 6, 7, 8], stream=False, stop_token_ids=[7]))
            _, done = await collect(call)
            assert list(done.output_ids) == [5, 6, 7]
            assert done.finish_reason == "stop" and done.matched_token_id == 7

            _, done = await collect(stub.Generate(request([5, EOS, 9], stream=False)))
            assert list(done.output_ids) == [5, EOS] and done.finish_reason == "stop"
            _, done = await collect(
                stub.Generate(request([5, EOS, 9], stream=False, ignore_eos=True, max_new_tokens=4))
            )
            assert list(done.output_ids) == [5, EOS, 9, 5] and done.finish_reason == "length"

            # A stop string (matched on the text here) ends the request at the target.
            call = stub.Generate(request([5, 6, 7, 8], stop=["w7"], max_new_tokens=20))
            chunks, done = await collect(call)
            assert [t for c in chunks for t in c.token_ids] == [5, 6, 7]
            assert done.finish_reason == "stop" and done.matched_stop_str == "w7"
            await wait_until(lambda: bool(s.target.aborts))

    run(body)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"sampling_params": {"n": 17}}, "n"),
        ({"sampling_params": {"logit_bias": {"five": 1.0}}}, "sampling_params.logit_bias"),
        ({"sampling_params": {"logit_bias": {"5": 101.0}}}, "sampling.logit_bias"),
        ({"sampling_params": {"presence_penalty": 2.5}}, "sampling.presence_penalty"),
        ({"sampling_params": {"regex": "a+"}}, "sampling_params.constraint"),
        ({"return_logprob": True, "top_logprobs_num": 21}, "sampling.top_logprobs"),
        ({"lora_id": "x"}, "lora_id"),
        ({"request_id": ""}, "request_id"),
        ({"tokenized": {"input_ids": [VOCAB + 5]}}, "token_ids"),
        ({"sampling_params": {"max_new_tokens": MAX_MODEL_LEN}}, "sampling.max_new_tokens"),
        ({"sampling_params": {"temperature": 5.0}}, "sampling.temperature"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(
    words: Path, change: dict[str, Any], field: str
) -> None:
    async def body() -> None:
        async with worker(words) as (s, stub, _):
            bad = request([5, 6])
            for key, value in change.items():
                if isinstance(value, dict):
                    getattr(bad, key).MergeFrom(type(getattr(bad, key))(**value))
                    if key == "tokenized":
                        del bad.tokenized.input_ids[:]
                        bad.tokenized.input_ids.extend(value["input_ids"])
                else:
                    setattr(bad, key, value)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(stub.Generate(bad))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (refused.value.details() or "").startswith(f"{field}:")
            assert s.target.admits == []

    run(body)


def test_sampling_features_reach_the_target(words: Path) -> None:
    async def body() -> None:
        async with worker(words) as (s, stub, _):
            asked = request([5, 6], max_new_tokens=4)
            asked.sampling_params.MergeFrom(
                smg_pb2.SamplingParams(
                    presence_penalty=0.5,
                    frequency_penalty=-1.25,
                    min_new_tokens=2,
                    logit_bias={"7": -100.0, "9": 2.5},
                )
            )
            asked.return_logprob, asked.top_logprobs_num = True, 3
            await collect(stub.Generate(asked))
            sampling = s.target.admits[-1].sampling
            assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.25)
            assert sampling.min_tokens == 2 and dict(sampling.logit_bias) == {7: -100.0, 9: 2.5}
            assert sampling.logprobs and sampling.top_logprobs == 3
            asked.return_logprob = False  # top-N only with logprobs, as OpenAI's API has it
            await collect(stub.Generate(asked))
            assert s.target.admits[-1].sampling.top_logprobs == 0

            # n completions, by index: each its own request at the target.
            for stream in (False, True):
                many = request([5, 6, 7], max_new_tokens=3, stream=stream)
                many.sampling_params.n = 2
                done: dict[int, list[int]] = {0: [], 1: []}
                async for response in stub.Generate(many):
                    if response.HasField("chunk"):
                        done[response.chunk.index] += list(response.chunk.token_ids)
                    else:
                        done[response.complete.index] += list(response.complete.output_ids)
                assert done == {0: [5, 6, 7], 1: [5, 6, 7]}
            assert len({a.request_id for a in s.target.admits[-4:]}) == 4

    run(body)


def test_abort_and_a_dropped_stream_free_the_target(words: Path) -> None:
    async def body() -> None:
        async with worker(words, step_s=0.005) as (s, stub, _):
            s.target.paused = True
            call = stub.Generate(request([5, 6], max_new_tokens=20))
            await wait_until(lambda: len(s.target.admits) == 1)
            loads = await stub.GetLoads(smg_pb2.GetLoadsRequest())
            assert loads.loads[0].num_running_reqs == 1 and loads.aggregate.total_running_reqs == 1
            answer = await stub.Abort(smg_pb2.AbortRequest(request_id="r1"))
            assert answer.success
            assert not (await stub.Abort(smg_pb2.AbortRequest(request_id="r1"))).success
            chunks, done = await collect(call)
            assert chunks == [] and done.finish_reason == "abort"
            admit = s.target.admits[0]
            await wait_until(lambda: bool(s.target.aborts))
            assert [(list(a.request_ids), a.finish_reason) for a in s.target.aborts] == [
                ([admit.request_id], ABORT)
            ]

            # The router drops a stream: the request ends at the target and frees its slot.
            s.target.paused = False
            call = stub.Generate(request([5, 6], max_new_tokens=MAX_MODEL_LEN - 2))
            first = await call.read()
            assert first.chunk.token_ids
            call.cancel()
            await wait_until(lambda: len(s.target.aborts) == 2)
            assert list(s.target.aborts[1].request_ids) == [s.target.admits[1].request_id]
            admission = s.gateway.servicer.admission
            await wait_until(lambda: admission.num_running == 0)
            assert s.gateway.client.num_in_flight == 0

    run(body)


def test_admission_limits_apply(words: Path) -> None:
    async def body() -> None:
        async with worker(words, max_running=1, max_queue=0) as (s, stub, _):
            s.target.paused = True
            first = stub.Generate(request([5], max_new_tokens=4))
            await wait_until(lambda: len(s.target.admits) == 1)
            with pytest.raises(grpc.aio.AioRpcError) as overload:
                await collect(stub.Generate(request([6], rid="r2", max_new_tokens=4)))
            assert overload.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            s.target.paused = False
            _, done = await collect(first)
            assert done.finish_reason == "length"

    run(body)


def test_health_model_and_server_info(words: Path) -> None:
    async def body() -> None:
        async with worker(words) as (s, stub, channel):
            assert (await stub.HealthCheck(smg_pb2.HealthCheckRequest())).healthy
            health = health_pb2_grpc.HealthStub(channel)
            assert await health_status(health, SERVICE_NAME) == SERVING
            info = await stub.GetModelInfo(smg_pb2.GetModelInfoRequest())
            assert info.is_generation and info.served_model_name == "echo"
            assert info.model_path == info.tokenizer_path == str(words)
            assert (info.vocab_size, info.max_context_length) == (VOCAB, MAX_MODEL_LEN)
            assert info.max_req_input_len == MAX_MODEL_LEN - 1
            assert list(info.eos_token_ids) == [EOS] and info.bos_token_id == 1
            server = await stub.GetServerInfo(smg_pb2.GetServerInfoRequest())
            assert server.server_type == "grpc" and server.sglang_version.startswith("tandem-")
            # EchoTarget's pool: 3 of 100 pages of 16 tokens.
            assert server.max_total_num_tokens == 1600
            (load,) = (await stub.GetLoads(smg_pb2.GetLoadsRequest())).loads
            assert (load.num_used_tokens, load.max_total_num_tokens) == (48, 1600)
            assert load.token_usage == pytest.approx(0.03)
            assert load.max_running_requests == s.gateway.servicer.config.max_running
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.Embed(smg_pb2.EmbedRequest())
            assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                async for _ in stub.SubscribeKvEvents(smg_common_pb2.SubscribeKvEventsRequest()):
                    pass
            assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED

    run(body)


def test_tokenizer_bundle_rebuilds_the_tokenizer(words: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with worker(words) as (_, stub, _):
            chunks = [c async for c in stub.GetTokenizer(smg_common_pb2.GetTokenizerRequest())]
            data = b"".join(c.data for c in chunks)
            assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
            assert all(not c.sha256 for c in chunks[:-1])
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                assert "tokenizer.json" in archive.namelist()
                archive.extractall(tmp_path)
            again = [c async for c in stub.GetTokenizer(smg_common_pb2.GetTokenizerRequest())]
            assert b"".join(c.data for c in again) == data  # the same bytes every time

    run(body)
    original, rebuilt = load_tokenizer(words), load_tokenizer(tmp_path)
    assert rebuilt("w5 w6 w7")["input_ids"] == original("w5 w6 w7")["input_ids"]


def test_bearer_tokens_guard_the_worker_port(words: Path) -> None:
    token = "t" * MIN_TOKEN_CHARS

    async def body() -> None:
        async with worker(words, auth_tokens=(token,)) as (_, stub, channel):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetModelInfo(smg_pb2.GetModelInfoRequest())
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            metadata = (("authorization", f"Bearer {token}"),)
            call = stub.Generate(request([5, 6], stream=False, max_new_tokens=2), metadata=metadata)
            _, done = await collect(call)
            assert list(done.output_ids) == [5, 6]
            health = health_pb2_grpc.HealthStub(channel)  # probes need no token
            assert await health_status(health, SERVICE_NAME) == SERVING

    run(body)


def test_oversize_requests_are_refused_before_parsing(words: Path) -> None:
    async def body() -> None:
        async with worker(words) as (s, stub, _):
            cases = {
                "tokenized": request([5] * 2000),  # more ids than the context could hold
                "request": request([5], stop=["w" * 40_000, "x" * 40_000]),
                "token_ids": request([5] * MAX_MODEL_LEN),  # parsed: fills the context
            }
            for field, bad in cases.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await collect(stub.Generate(bad))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
                assert (refused.value.details() or "").startswith(f"{field}:"), field
            assert s.target.admits == []

    run(body)


def test_undecodable_bytes_are_invalid_argument(words: Path) -> None:
    async def body() -> None:
        async with worker(words) as (s, _, channel):
            garbage = b"\x0a\xff\xff\xff\xff\x0f"  # a length past the end of the message
            generate = channel.unary_stream(f"/{SERVICE_NAME}/Generate")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in generate(garbage):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            info = channel.unary_unary(f"/{SERVICE_NAME}/GetModelInfo")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await info(garbage)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert s.target.admits == []

    run(body)
