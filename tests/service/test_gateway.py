"""The gateway over gRPC (in-process servers on loopback ports), against `EchoTarget`: a small,
deterministic TargetService that speaks the Control contract (admit, abort, commits, status)
and echoes each prompt cyclically, so every expectation below is known in advance. One test
runs the gateway against the real target service as well."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.__main__ import SERVICE_NAME, Gateway, start_gateway
from gateway.config import GatewayConfig
from tandem.models.tokenizer import load_tokenizer
from tandem.testing.random_model import write_tokenizer
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

VOCAB = 300  # covers both test tokenizers (word-level: 64 words; byte-level: 258 tokens)
MAX_MODEL_LEN = 64
EOS = 2
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


@dataclass
class _Running:
    admit: target_pb2.AdmitCommand
    output: list[int] = field(default_factory=list)
    steps: int = 0
    abort_reason: int = 0


class EchoTarget(target_pb2_grpc.TargetServiceServicer):
    """Generates prompt[0], prompt[1], ... (cyclically), `tokens_per_step` tokens per step;
    finishes on a stop token, EOS (unless ignore_eos), max_new_tokens, or an abort (with the
    abort's reason). Records every admit and abort it receives."""

    def __init__(self, *, tokens_per_step: int = 1, step_s: float = 0.002) -> None:
        self.tokens_per_step = tokens_per_step
        self.step_s = step_s
        self.paused = False  # running requests make no progress (aborts still apply)
        self.refuse: target_pb2.Commit | None = None  # answer every admit with this error
        self.admits: list[target_pb2.AdmitCommand] = []
        self.aborts: list[target_pb2.AbortCommand] = []
        self.status = target_pb2.TargetStatus(
            kv_usage=common_pb2.KvUsage(pages_used=3, pages_total=100, page_size=16),
            draft_state=common_pb2.DRAFT_STATE_HEALTHY,
        )

    async def GetInfo(self, request: Any, context: Any) -> target_pb2.TargetServiceGetInfoResponse:
        return target_pb2.TargetServiceGetInfoResponse(
            model_id="echo",
            vocab_size=VOCAB,
            max_model_len=MAX_MODEL_LEN,
            eos_token_ids=[EOS],
            draft_kind=common_pb2.DRAFT_KIND_NGRAM,
            status=self.status,
        )

    async def Control(
        self, request_iterator: AsyncIterator[target_pb2.ControlRequest], context: Any
    ) -> AsyncIterator[target_pb2.ControlResponse]:
        running: dict[str, _Running] = {}
        refusals: list[target_pb2.Commit] = []

        async def read() -> None:
            async for request in request_iterator:
                if request.HasField("admit"):
                    self.admits.append(request.admit)
                    if self.refuse is not None:
                        refusal = target_pb2.Commit(request_id=request.admit.request_id)
                        refusal.MergeFrom(self.refuse)
                        refusals.append(refusal)
                    else:
                        running[request.admit.request_id] = _Running(request.admit)
                elif request.HasField("abort"):
                    self.aborts.append(request.abort)
                    for request_id in request.abort.request_ids:
                        if request_id in running:
                            running[request_id].abort_reason = request.abort.finish_reason

        reader = asyncio.create_task(read())
        step_id = 0
        try:
            while not reader.done():
                await asyncio.sleep(self.step_s)
                commits = [*refusals, *filter(None, map(self._advance, running.values()))]
                refusals.clear()
                for commit in commits:
                    if commit.finish_reason:
                        running.pop(commit.request_id, None)
                if commits:
                    step_id += 1
                    stats = target_pb2.StepStats(
                        batch_size=len(commits),
                        num_committed_tokens=sum(len(c.token_ids) for c in commits),
                        speculation=common_pb2.SpeculationParams(
                            num_steps=self.tokens_per_step - 1, topk=1
                        ),
                    )
                    step = target_pb2.StepReport(step_id=step_id, commits=commits, stats=stats)
                    yield target_pb2.ControlResponse(step=step)
                self.status.num_running = len(running)
                yield target_pb2.ControlResponse(status=self.status)
        finally:
            reader.cancel()

    def _advance(self, r: _Running) -> target_pb2.Commit | None:
        commit = target_pb2.Commit(request_id=r.admit.request_id)
        sampling = r.admit.sampling
        if r.abort_reason:
            commit.finish_reason = r.abort_reason  # type: ignore[assignment]
        elif self.paused:
            return None
        else:
            r.steps += 1
            prompt = r.admit.prompt_token_ids
            for _ in range(self.tokens_per_step):
                token = prompt[len(r.output) % len(prompt)]
                r.output.append(token)
                commit.token_ids.append(token)
                if sampling.logprobs:
                    commit.logprobs.append(-0.5)
                eos = token == EOS and not sampling.ignore_eos
                if token in sampling.stop_token_ids or eos:
                    commit.finish_reason = STOP
                elif len(r.output) >= sampling.max_new_tokens:
                    commit.finish_reason = LENGTH
                if commit.finish_reason:
                    break
        if commit.finish_reason:
            commit.usage.prompt_tokens = len(r.admit.prompt_token_ids)
            commit.usage.completion_tokens = len(r.output)
            commit.usage.verify_steps = r.steps
            commit.usage.draft_tokens = r.steps * (self.tokens_per_step - 1)
            commit.usage.accepted_tokens = len(r.output) - r.steps
            commit.usage.accept_length = len(r.output) / max(r.steps, 1)
        return commit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def start_target(servicer: Any, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


@dataclass
class Stack:
    target: EchoTarget
    target_server: grpc.aio.Server
    gateway: Gateway
    stub: gateway_pb2_grpc.GatewayServiceStub
    health: health_pb2_grpc.HealthStub


@asynccontextmanager
async def stack(tokenizer_dir: Path, **overrides: Any) -> AsyncIterator[Stack]:
    target_args = {k: overrides.pop(k) for k in ("tokens_per_step", "step_s") if k in overrides}
    target = EchoTarget(**target_args)
    target_server, target_port = await start_target(target)
    config = GatewayConfig(
        target_addr=f"127.0.0.1:{target_port}",
        tokenizer=tokenizer_dir,
        host="127.0.0.1",
        port=0,
        **overrides,
    )
    gateway = await start_gateway(config, tokenizer=load_tokenizer(tokenizer_dir))
    await gateway.client.wait_connected(5.0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    s = Stack(
        target,
        target_server,
        gateway,
        gateway_pb2_grpc.GatewayServiceStub(channel),
        health_pb2_grpc.HealthStub(channel),
    )
    try:
        yield s
    finally:
        await channel.close()
        await gateway.stop(0)
        await s.target_server.stop(0)  # the test may have replaced it


def run(coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 30))


async def generate(
    stub: gateway_pb2_grpc.GatewayServiceStub, request: gateway_pb2.GenerateRequest
) -> tuple[list[gateway_pb2.GenerateChunk], gateway_pb2.GenerateComplete]:
    chunks: list[gateway_pb2.GenerateChunk] = []
    async for response in stub.Generate(request):
        if response.HasField("chunk"):
            chunks.append(response.chunk)
        else:
            assert response.HasField("complete"), response
            return chunks, response.complete
    raise AssertionError("the stream ended without a completion")


def ids_request(ids: list[int], **sampling: Any) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(**sampling)
    )


def rich_status(exc: grpc.aio.AioRpcError) -> status_pb2.Status:
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    raise AssertionError(f"no rich status in {exc}")


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Word-level tokenizer: id i >= 4 is the word ``w<i>``; <s>=1 is prepended to texts."""
    path = tmp_path_factory.mktemp("words")
    write_tokenizer(path, 64)
    return path


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level BPE without merges: one token per UTF-8 byte, so characters span tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("bytes")
    vocab = {"<s>": 0, "</s>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return path


def test_streams_chunks_then_a_completion_with_usage(words: Path) -> None:
    async def body() -> None:
        async with stack(words, tokens_per_step=2) as s:
            request = ids_request([5, 6, 7, 8], max_new_tokens=6, logprobs=True)
            request.speculation.enabled = False
            chunks, complete = await generate(s.stub, request)
            assert [list(c.token_ids) for c in chunks] == [[5, 6], [7, 8], [5, 6]]
            assert "".join(c.text for c in chunks) == " w5 w6 w7 w8 w5 w6"  # continues the prompt
            assert all(list(c.logprobs) == [-0.5] * len(c.token_ids) for c in chunks)
            assert complete.finish_reason == LENGTH
            assert not complete.HasField("stop_token_id")
            usage = complete.usage
            assert (usage.prompt_tokens, usage.completion_tokens) == (4, 6)
            assert (usage.verify_steps, usage.draft_tokens, usage.accepted_tokens) == (3, 3, 3)
            assert usage.accept_length == pytest.approx(2.0)
            assert 0 < complete.queue_ns <= complete.ttft_ns <= complete.total_ns
            # The target got explicit sampling values and the per-request opt-out.
            (admit,) = s.target.admits
            assert list(admit.prompt_token_ids) == [5, 6, 7, 8]
            assert admit.sampling.HasField("temperature") and admit.sampling.temperature == 1.0
            assert admit.sampling.max_new_tokens == 6 and admit.sampling.logprobs
            assert not admit.sampling.stop_strings
            assert admit.speculation.HasField("enabled") and not admit.speculation.enabled

            # Text prompts are tokenized like `tandem generate` (with <s>); unset max_new_tokens
            # fills the context; a stop token id is reported as what matched.
            request = gateway_pb2.GenerateRequest(
                text="w9 w10 w11", sampling=common_pb2.SamplingParams(stop_token_ids=[10])
            )
            request.stream_options.continuous_usage = True
            request.stream_options.skip_special_tokens = True
            chunks, complete = await generate(s.stub, request)
            assert list(s.target.admits[1].prompt_token_ids) == [1, 9, 10, 11]
            assert s.target.admits[1].sampling.max_new_tokens == MAX_MODEL_LEN - 4
            assert s.target.admits[1].speculation.enabled
            assert [list(c.token_ids) for c in chunks] == [[1, 9], [10]]
            assert [c.text for c in chunks] == [" w9", " w10"]  # <s> skipped
            assert [c.usage.completion_tokens for c in chunks] == [2, 3]
            assert complete.finish_reason == STOP and complete.stop_token_id == 10

    run(body)


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_multibyte_text_is_never_split(byte_level: Path, tokens_per_step: int) -> None:
    text = "héllo wörld 😀 日本語 ✓"

    async def body() -> None:
        async with stack(byte_level, tokens_per_step=tokens_per_step) as s:
            prompt = load_tokenizer(byte_level)(text)["input_ids"]
            assert len(prompt) == len(text.encode())
            request = gateway_pb2.GenerateRequest(
                text=text,
                sampling=common_pb2.SamplingParams(max_new_tokens=len(prompt), ignore_eos=True),
            )
            chunks, complete = await generate(s.stub, request)
            assert [t for c in chunks for t in c.token_ids] == prompt
            assert all("\ufffd" not in c.text for c in chunks)
            assert "".join(c.text for c in chunks) == text
            if tokens_per_step == 1:  # an incomplete character holds its text back
                assert any(c.text == "" for c in chunks)
            assert complete.finish_reason == LENGTH

    run(body)


@pytest.mark.parametrize(
    ("tokens_per_step", "stop", "ids", "text"),
    [
        (1, "w7", [5, 6, 7], " w5 w6 "),
        (4, "w6 w7", [5, 6, 7], " w5 "),  # the match ends inside a commit: later ids dropped
        (1, "6 w", [5, 6, 7], " w5 w"),  # spans chunks; the client never sees part of it
    ],
)
def test_stop_strings_cut_the_text_and_abort_the_target(
    words: Path, tokens_per_step: int, stop: str, ids: list[int], text: str
) -> None:
    async def body() -> None:
        async with stack(words, tokens_per_step=tokens_per_step) as s:
            request = ids_request([5, 6, 7, 8, 9], max_new_tokens=40, stop_strings=["zzz", stop])
            request.request_id = "stopper"
            chunks, complete = await generate(s.stub, request)
            assert [t for c in chunks for t in c.token_ids] == ids
            assert "".join(c.text for c in chunks) == text
            assert complete.finish_reason == STOP and complete.stop_string == stop
            assert complete.usage.completion_tokens == len(ids)
            aborts = [(list(a.request_ids), a.finish_reason) for a in s.target.aborts]
            assert aborts == [([s.target.admits[0].request_id], STOP)]
            assert s.target.admits[0].request_id.startswith("stopper#")
            assert not s.target.admits[0].sampling.stop_strings

    run(body)


INVALID: list[tuple[gateway_pb2.GenerateRequest, str]] = [
    (gateway_pb2.GenerateRequest(), "prompt"),
    (gateway_pb2.GenerateRequest(text=""), "text"),
    (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds()), "token_ids"),
    (ids_request([5, VOCAB]), "token_ids"),
    (ids_request(list(range(4, 4 + MAX_MODEL_LEN))), "token_ids"),
    (ids_request([5], temperature=-1.0), "sampling.temperature"),
    (ids_request([5], top_p=0.0), "sampling.top_p"),
    (ids_request([5], repetition_penalty=0.0), "sampling.repetition_penalty"),
    (ids_request([5], max_new_tokens=0), "sampling.max_new_tokens"),
    (ids_request([5, 6], max_new_tokens=MAX_MODEL_LEN - 1), "sampling.max_new_tokens"),
    (ids_request([5], stop_token_ids=[VOCAB]), "sampling.stop_token_ids"),
    (ids_request([5], stop_strings=[""]), "sampling.stop_strings"),
    (ids_request([5], stop_strings=[f"s{i}" for i in range(9)]), "sampling.stop_strings"),
    (gateway_pb2.GenerateRequest(request_id="", text="w5"), "request_id"),
    (
        gateway_pb2.GenerateRequest(
            text="w5",
            speculation=common_pb2.SpeculationParams(draft_kind=common_pb2.DRAFT_KIND_EAGLE3),
        ),
        "speculation.draft_kind",
    ),
]


def test_each_invalid_field_is_named(words: Path) -> None:
    async def body() -> None:
        async with stack(words) as s:
            for request, field_path in INVALID:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await generate(s.stub, request)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field_path
                assert (info.value.details() or "").startswith(f"{field_path}:")
                (detail,) = rich_status(info.value).details
                bad_request = error_details_pb2.BadRequest()
                assert detail.Unpack(bad_request)
                assert bad_request.field_violations[0].field == field_path
            assert s.target.admits == []  # nothing reached the target

    run(body)


def test_overload_queueing_and_abort(words: Path) -> None:
    async def body() -> None:
        async with stack(words, max_running=1, max_queue=1, step_s=0.001) as s:
            s.target.paused = True
            first = s.stub.Generate(gateway_pb2.GenerateRequest(request_id="a", text="w5"))
            await wait_until(lambda: len(s.target.admits) == 1)
            second = s.stub.Generate(gateway_pb2.GenerateRequest(request_id="b", text="w6"))
            await wait_until(lambda: s.gateway.servicer.admission.num_waiting == 1)
            info = await s.stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
            assert info.num_waiting == 1 and info.lanes[0].num_requests == 1

            with pytest.raises(grpc.aio.AioRpcError) as overload:
                await generate(s.stub, gateway_pb2.GenerateRequest(text="w7"))
            assert overload.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            (detail,) = rich_status(overload.value).details
            retry = error_details_pb2.RetryInfo()
            assert detail.Unpack(retry) and retry.retry_delay.ToNanoseconds() > 0

            with pytest.raises(grpc.aio.AioRpcError) as reuse:
                await generate(s.stub, gateway_pb2.GenerateRequest(request_id="a", text="w8"))
            assert reuse.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (reuse.value.details() or "").startswith("request_id:")

            # Abort the queued request (it never reaches the target), then the running one.
            response = await s.stub.Abort(gateway_pb2.AbortRequest(request_ids=["b", "nope"]))
            assert list(response.aborted_request_ids) == ["b"]
            (message,) = [m async for m in second]
            assert message.request_id == "b" and message.complete.finish_reason == ABORT
            response = await s.stub.Abort(gateway_pb2.AbortRequest(request_ids=["a"]))
            assert list(response.aborted_request_ids) == ["a"]
            (message,) = [m async for m in first]
            assert message.complete.finish_reason == ABORT
            (admit,) = s.target.admits
            assert admit.request_id.startswith("a#")
            assert [(list(a.request_ids), a.finish_reason) for a in s.target.aborts] == [
                ([admit.request_id], ABORT)
            ]
            # The slots are free again.
            s.target.paused = False
            _, complete = await generate(s.stub, ids_request([5], max_new_tokens=2))
            assert complete.finish_reason == LENGTH

    run(body)


def test_client_cancel_aborts_at_the_target(words: Path) -> None:
    async def body() -> None:
        async with stack(words, step_s=0.005) as s:
            request = ids_request([5, 6], max_new_tokens=MAX_MODEL_LEN - 2)
            request.request_id = "gone"
            call = s.stub.Generate(request)
            first = await call.read()
            assert first.chunk.token_ids
            call.cancel()
            await wait_until(lambda: bool(s.target.aborts))
            (admit,) = s.target.admits
            assert [(list(a.request_ids), a.finish_reason) for a in s.target.aborts] == [
                ([admit.request_id], ABORT)
            ]
            admission = s.gateway.servicer.admission
            await wait_until(lambda: admission.num_running == 0)
            assert s.gateway.client.num_in_flight == 0
            assert s.gateway.client.num_connects == 1
            # The id is free again at once, though the target may still be finishing "gone".
            request.sampling.max_new_tokens = 2
            _, complete = await generate(s.stub, request)
            assert complete.finish_reason == LENGTH

    run(body)


def test_target_refusal_reaches_the_client(words: Path) -> None:
    async def body() -> None:
        async with stack(words) as s:
            s.target.refuse = target_pb2.Commit(
                finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=common_pb2.ErrorStatus(
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    message="too long for the pool",
                    field="prompt_ids",
                ),
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(s.stub, ids_request([5, 6]))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == "prompt_ids: too long for the pool"
            assert s.gateway.servicer.admission.num_running == 0

    run(body)


async def health_status(stub: health_pb2_grpc.HealthStub, service: str = "") -> int:
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return int(response.status)


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_target_death_fails_requests_quickly_and_reconnects(words: Path) -> None:
    async def body() -> None:
        async with stack(words, step_s=0.01) as s:
            assert await health_status(s.health) == SERVING
            call = s.stub.Generate(ids_request([5, 6], max_new_tokens=MAX_MODEL_LEN - 2))
            assert (await call.read()).chunk.token_ids
            s.target.paused = True
            queued = s.stub.Generate(ids_request([7], max_new_tokens=4))
            await wait_until(lambda: len(s.target.admits) == 2)
            port = int(s.gateway.client.address.rsplit(":", 1)[1])
            started = time.monotonic()
            await s.target_server.stop(0)
            # Started: the error message, then the status; not started: the status only.
            error = await call.read()
            assert error.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await queued.read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 2.0
            assert await health_status(s.health) == NOT_SERVING
            assert await health_status(s.health, SERVICE_NAME) == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(s.stub, ids_request([5]))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

            # The target comes back on the same address: the gateway reconnects.
            s.target_server, _ = await start_target(EchoTarget(), port)
            await s.gateway.client.wait_connected(10.0)
            assert await health_status(s.health) == SERVING
            _, complete = await generate(s.stub, ids_request([5], max_new_tokens=3))
            assert complete.finish_reason == LENGTH

    run(body)


def test_health_is_not_serving_until_the_target_connects(words: Path) -> None:
    async def body() -> None:
        port = free_port()
        config = GatewayConfig(
            target_addr=f"127.0.0.1:{port}", tokenizer=words, host="127.0.0.1", port=0
        )
        gateway = await start_gateway(config)
        target_server = None
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                await asyncio.sleep(0.2)
                assert await health_status(health) == NOT_SERVING
                assert await health_status(health, SERVICE_NAME) == NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await generate(stub, ids_request([5]))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE

                target_server, _ = await start_target(EchoTarget(), port)
                await gateway.client.wait_connected(10.0)
                assert await health_status(health) == SERVING
                assert await health_status(health, SERVICE_NAME) == SERVING
        finally:
            await gateway.stop(0)
            if target_server is not None:
                await target_server.stop(0)

    run(body)


def test_model_and_server_info(words: Path) -> None:
    async def body() -> None:
        async with stack(words, tokens_per_step=3) as s:
            model = await s.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
            assert (model.model_id, model.vocab_size, model.max_model_len) == (
                "echo",
                VOCAB,
                MAX_MODEL_LEN,
            )
            assert list(model.eos_token_ids) == [EOS] and model.bos_token_id == 1
            assert model.tokenizer_id == str(words)
            assert model.draft_kind == common_pb2.DRAFT_KIND_NGRAM
            await generate(s.stub, ids_request([5, 6, 7], max_new_tokens=9))
            info = await s.stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
            assert info.version and info.uptime_ns > 0
            assert info.draft_state == common_pb2.DRAFT_STATE_HEALTHY
            assert info.target_kv_usage.pages_total == 100
            assert info.target_kv_usage.pages_used == 3
            assert not info.HasField("draft_kv_usage")
            assert info.speculation.enabled
            assert info.speculation.draft_kind == common_pb2.DRAFT_KIND_NGRAM
            assert info.speculation.num_steps == 2
            (lane,) = info.lanes
            assert lane.lane_id == 0 and lane.accept_length == pytest.approx(3.0)
            assert (info.num_running, info.num_waiting) == (0, 0)

    run(body)


def test_against_the_real_target_service(tmp_path: Path) -> None:
    from tandem.config import EngineConfig
    from tandem.sampling import SamplingParams
    from tandem.serving import rpc
    from tandem.target.engine import Engine
    from tandem.testing.random_model import make_checkpoint
    from target_service.__main__ import get_info, status
    from target_service.config import TargetServiceConfig
    from target_service.engine import TargetLoop
    from target_service.server import TargetServicer

    target_dir = make_checkpoint(tmp_path / "target", "llama", seed=5)
    prompt = [1, 5, 6, 7]  # "w5 w6 w7" with <s>
    config = TargetServiceConfig(engine=EngineConfig(model=target_dir, num_pages=64))
    (expected,) = Engine(config.engine).generate(
        [prompt], SamplingParams(max_new_tokens=8, ignore_eos=True)
    )
    tokenizer = load_tokenizer(target_dir)

    async def body() -> None:
        engine = Engine(config.engine)
        loop = TargetLoop(engine, status=lambda: status(engine, None), status_interval_s=0.05)
        server = rpc.make_server()
        servicer = TargetServicer(loop, get_info(engine, config))
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        loop.start()
        gateway = await start_gateway(
            GatewayConfig(target_addr=f"127.0.0.1:{port}", tokenizer=target_dir, port=0)
        )
        try:
            await gateway.client.wait_connected(10.0)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                sampling = common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=8, ignore_eos=True
                )
                request = gateway_pb2.GenerateRequest(text="w5 w6 w7", sampling=sampling)
                chunks, complete = await generate(stub, request)
                ids = [t for c in chunks for t in c.token_ids]
                assert ids == expected.token_ids

                def continuation(n: int) -> str:
                    return tokenizer.decode(prompt + ids[:n])[len(tokenizer.decode(prompt)) :]

                assert "".join(c.text for c in chunks) == continuation(8)
                assert complete.finish_reason == LENGTH
                assert complete.usage.completion_tokens == 8 and complete.usage.verify_steps

                # A stop string on a later token: cut, and the target frees the request.
                k = next(
                    k for k in range(2, 8) if tokenizer.decode([ids[k]]) not in continuation(k)
                )
                stop = tokenizer.decode([ids[k]])
                sampling.stop_strings.append(stop)
                request = gateway_pb2.GenerateRequest(text="w5 w6 w7", sampling=sampling)
                chunks, complete = await generate(stub, request)
                assert [t for c in chunks for t in c.token_ids] == ids[: k + 1]
                text = continuation(k + 1)
                assert "".join(c.text for c in chunks) == text[: text.index(stop)]
                assert complete.finish_reason == STOP and complete.stop_string == stop
                # The target's own final commit (its usage) answered the STOP abort.
                assert complete.usage.verify_steps > 0
                alloc = engine.kv.allocator
                await wait_until(lambda: alloc.num_free_pages == alloc.num_pages)
                info = await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
                assert info.vocab_size == engine.model.config.vocab_size
                assert gateway.client.num_connects == 1  # the stop abort kept the stream up
        finally:
            await gateway.stop(0)
            loop.stop()
            await server.stop(0)

    run(body)


def test_stop_string_matcher_holds_back_only_possible_matches() -> None:
    from gateway.detokenize import StopStringMatcher

    matcher = StopStringMatcher(["aab", "xyz"])
    assert matcher.feed("cca") == "cc"  # "a" may start "aab"
    assert matcher.feed("a") == ""  # "aa" too
    assert matcher.feed("a") == "a"  # "aaa": only the last two can still match
    assert matcher.feed("bq") == "" and matcher.matched == "aab"
    assert matcher.feed("more") == "" and matcher.flush() == ""
    unmatched = StopStringMatcher(["xyz"])
    assert unmatched.feed("abx") == "ab" and unmatched.flush() == "x"
    assert unmatched.matched is None
