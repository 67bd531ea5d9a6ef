"""Cheap requests cost little, against the three services as production starts them (real
processes, telemetry set up): oversize prompts are refused before work, stalling another
client's ``GetServerInfo`` by less than 50 ms and growing the gateway's peak RSS by less than
64 MiB; Speculate frames that announce oversize tensors are refused unread and frames that
announce more than they carry cost what they carry (the draft's peak RSS grows less than
64 MiB); clients that stop reading are cut off, their slots and KV pages freed, so a normal
request on a ``--max-running 4`` gateway completes."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tandem import wire
from tandem.apps.launch import Stack
from tandem.spec.types import DraftAdmit, SpecConfig
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.helpers.stacks import cpu_stack, random_family

pytestmark = pytest.mark.e2e

MiB = 1 << 20
MAX_STALL_S = 0.050
MAX_GROWTH = 64 * MiB
SLOW_READER_TIMEOUT_S = 2.0
GENERATE = "/tandem.v1.GatewayService/Generate"


@dataclass
class Running:
    ports: dict[str, int]
    pids: dict[str, int]
    logs: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("oversize")
    target, eagle3 = random_family(root)
    running: Stack = cpu_stack(
        target,
        eagle3,
        extra_gateway_args=[
            *("--max-running", "4"),
            *("--slow-reader-timeout", str(SLOW_READER_TIMEOUT_S)),
        ],
    )
    running.start(log_dir=root / "logs")
    try:
        yield Running(
            ports={svc.name: svc.port for svc in running.services},
            pids={svc.name: svc.proc.pid for svc in running.services if svc.proc is not None},
            logs=root / "logs",
        )
    finally:
        running.stop()


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise KeyError(key)


class PeakGrowth:
    """A process's peak RSS growth over a span of time: the peak is reset at the start
    (``clear_refs``), so the growth counts what was allocated and freed meanwhile too."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> PeakGrowth:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        self.before = _status_kib(self.pid, "VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        self.bytes = _status_kib(self.pid, "VmHWM") * 1024 - self.before


async def _with_probe(port: int, call: Awaitable[grpc.StatusCode]) -> tuple[grpc.StatusCode, float]:
    """``call``'s code and the stall it caused another client: the longest a ``GetServerInfo``
    waited while it ran, less the median wait before it (this machine's own latency)."""
    running = asyncio.Event()
    done = asyncio.Event()
    before: list[float] = []
    during: list[float] = []

    async def probe() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())  # connected
            while not done.is_set():
                waits = during if running.is_set() else before
                started = time.perf_counter()
                await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=30)
                waits.append(time.perf_counter() - started)
                await asyncio.sleep(0.002)

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.3)
    running.set()
    try:
        code = await call
        await asyncio.sleep(0.1)  # a stall right after the answer counts too
    finally:
        done.set()
    await prober
    return code, max(during) - statistics.median(before)


async def _generate_raw(port: int, payload: bytes) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            async for _ in channel.unary_stream(GENERATE)(payload, timeout=30):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _refused(stack: Running, payload: bytes) -> tuple[grpc.StatusCode, float, int]:
    with PeakGrowth(stack.pids["gateway"]) as growth:
        code, stall = asyncio.run(
            _with_probe(stack.ports["gateway"], _generate_raw(stack.ports["gateway"], payload))
        )
    print(
        f"{len(payload)} bytes: {code.name}, stall {stall * 1e3:.1f} ms, "
        f"peak RSS +{growth.bytes / MiB:.1f} MiB"
    )
    return code, stall, growth.bytes


def _packed_ids(count: int, token_id: int) -> bytes:
    """A GenerateRequest of ``count`` token ids, serialized without building the message."""
    ids = wire.varint(token_id) * count
    token_ids = wire.length_tag(gateway_pb2.TokenIds, "ids") + wire.varint(len(ids)) + ids
    field = wire.length_tag(gateway_pb2.GenerateRequest, "token_ids")
    return field + wire.varint(len(token_ids)) + token_ids


def test_a_4_mib_text_prompt_is_refused_before_it_is_tokenized(stack: Running) -> None:
    text = " ".join(f"w{4 + i % 5000}" for i in range(800_000))[: 4 * MiB]
    payload = gateway_pb2.GenerateRequest(text=text).SerializeToString()
    code, stall, growth = _refused(stack, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert stall < MAX_STALL_S, f"GetServerInfo waited {stall * 1e3:.1f} ms"
    assert growth < MAX_GROWTH, f"the gateway's peak RSS grew {growth / MiB:.1f} MiB"


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        # 16 Mi ids are 16 MiB on the wire: past the receive cap, refused before parsing.
        (16 * MiB, grpc.StatusCode.RESOURCE_EXHAUSTED),
        # Within the cap, counted before they are copied: far more than the context holds.
        (4 * MiB, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_millions_of_token_ids_are_refused_before_they_are_scanned(
    stack: Running, count: int, expected: grpc.StatusCode
) -> None:
    code, stall, growth = _refused(stack, _packed_ids(count, 5))
    assert code == expected
    assert stall < MAX_STALL_S, f"GetServerInfo waited {stall * 1e3:.1f} ms"
    assert growth < MAX_GROWTH, f"the gateway's peak RSS grew {growth / MiB:.1f} MiB"


def _admits(
    count: int,
    tokens: int,
    rows: int,
    dtype: common_pb2.Dtype,
    info: draft_pb2.DraftServiceGetInfoResponse,
) -> draft_pb2.SpeculateRequest:
    """``count`` admits of ``tokens`` prompt tokens, each with a first frame of two that
    announces ``rows`` rows of features of ``dtype`` and carries 64 bytes."""
    feature_size = len(info.target_layer_ids) * info.hidden_size
    itemsize = wire.torch_dtype(dtype).itemsize
    request = draft_pb2.SpeculateRequest(step_id=1)
    for n in range(count):
        admit = DraftAdmit(
            request_id=f"r{n}-{rows}-{dtype}",
            token_ids=[4 + i % 200 for i in range(tokens + 1)],
            features=None,
            spec=SpecConfig(num_steps=2, topk=2),
        )
        msg, _ = wire.admit_to_proto(admit)
        request.new_requests.append(msg)
        frames = request.prompt_frames.add(request_id=admit.request_id)
        frames.frames.add(
            name=wire.HIDDEN_STATES,
            chunk_index=0,
            num_chunks=2,
            byte_offset=0,
            total_bytes=rows * feature_size * itemsize,
            dtype=dtype,
            shape=[rows, feature_size],
            data=bytes(64),
        )
    return request


def test_frames_announcing_big_tensors_cost_what_they_carry(stack: Running) -> None:
    async def speculate() -> tuple[draft_pb2.DraftServiceGetInfoResponse, list[list[str]]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports['draft']}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            info = await stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())
            tokens = 500
            messages = [
                # 256 times the negotiated rows, then float64 where it negotiated float32:
                # refused by their headers, nothing copied.
                _admits(64, tokens, tokens * 256, info.hidden_dtype, info),
                _admits(64, tokens, tokens, common_pb2.DTYPE_FLOAT64, info),
                # The negotiated header, 64 bytes carried of each tensor: pending, cheap.
                _admits(512, tokens, tokens, info.hidden_dtype, info),
            ]
            messages[0].hello.protocol_version = wire.PROTOCOL_VERSION
            call = stub.Speculate(iter(messages), timeout=60)
            return info, [list(r.dropped_request_ids) async for r in call]

    with PeakGrowth(stack.pids["draft"]) as growth:
        info, dropped = asyncio.run(speculate())
    print(f"draft peak RSS +{growth.bytes / MiB:.1f} MiB")
    assert info.hidden_dtype == common_pb2.DTYPE_FLOAT32
    assert len(dropped[0]) == len(dropped[1]) == 64, "oversize headers must be refused"
    assert dropped[2] == [], "the negotiated header waits for the rest of its tensor"
    assert growth.bytes < MAX_GROWTH, f"the draft's peak RSS grew {growth.bytes / MiB:.1f} MiB"
    log = (stack.logs / "draft.log").read_text()
    size = len(info.target_layer_ids) * info.hidden_size
    assert f"prompt_frames[r0-128000-1].shape: [128000, {size}], expected [500, {size}]" in log
    assert "prompt_frames[r0-500-7].dtype: torch.float64, the stream negotiated" in log


def test_clients_that_stop_reading_lose_their_slots(stack: Running) -> None:
    port = stack.ports["gateway"]

    def request(max_new_tokens: int) -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=common_pb2.SamplingParams(
                temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True
            ),
        )

    async def run() -> tuple[int, float, list[grpc.StatusCode], int]:
        # A one-byte HTTP/2 window and no window probing: the gateway can send these
        # clients nothing until they read, and they do not read.
        still = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=still) for _ in "abcd"]
        calls = [gateway_pb2_grpc.GatewayServiceStub(c).Generate(request(400)) for c in channels]
        for call in calls:
            await call.initial_metadata()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            started = time.monotonic()
            tokens = 0
            async for response in stub.Generate(request(8), timeout=30):
                tokens += len(response.chunk.token_ids)
            waited = time.monotonic() - started
            for _ in range(100):  # the aborts reach the target
                info = await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
                if info.target_kv_usage.pages_used == 0 and info.num_running == 0:
                    break
                await asyncio.sleep(0.1)
        codes = []
        for call in calls:  # reading again: what was written, then the cut-off
            try:
                async for _ in call:
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        for c in channels:
            await c.close()
        return tokens, waited, codes, info.target_kv_usage.pages_used

    tokens, waited, codes, pages = asyncio.run(run())
    print(f"normal request: {tokens} tokens after {waited:.2f} s; slow readers: {codes}")
    assert tokens == 8
    assert waited < SLOW_READER_TIMEOUT_S + 10, f"the normal request waited {waited:.1f} s"
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4
    assert pages == 0, "the cut-off requests' pages must be freed at the target"
    assert (stack.logs / "gateway.log").read_text().count("cut off: the client read") == 4
