"""The gateway tests' target and stack: `EchoTarget`, a small, deterministic TargetService
that speaks the Control contract (admit, abort, commits, status) and echoes each prompt
cyclically, so every expectation is known in advance; the gateway in front of it on loopback
ports (`stack`); and the calls the tests make through them."""

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
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.__main__ import Gateway, start_gateway
from gateway.config import GatewayConfig
from tandem.models.tokenizer import load_tokenizer
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
        self.controls = 0  # control streams that reached this target
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
        self.controls += 1
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


async def health_status(stub: health_pb2_grpc.HealthStub, service: str = "") -> int:
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return int(response.status)


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
