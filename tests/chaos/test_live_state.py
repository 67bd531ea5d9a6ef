"""Live state after outages, against the three services as production starts them (real
processes, ``tandem.apps.launch.build_stack``, a 1 s draft deadline as ``tandem serve`` sets):
a stopped draft (SIGSTOP) is reported UNHEALTHY, idle or under load, in ``GetServerInfo``, the
target's health and its metrics, and HEALTHY again after SIGCONT; after a draft restart
``GetServerInfo`` shows the draft's pool as the draft reports it; with the target down it shows
no numbers from before the outage."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.apps.demo import free_port
from tandem.apps.launch import Service, Stack, service_env, wait_serving
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.helpers.stacks import cpu_stack, random_family

pytestmark = pytest.mark.e2e

HEALTHY, UNHEALTHY = common_pb2.DRAFT_STATE_HEALTHY, common_pb2.DRAFT_STATE_UNHEALTHY
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STOPPED_S = 5.0  # the draft's stall; its deadline is 1 s


@dataclass
class Running:
    stack: Stack
    logs: Path
    target_metrics: int

    def service(self, name: str) -> Service:
        return next(s for s in self.stack.services if s.name == name)


@contextmanager
def _stack(root: Path, *, local_stream: bool = False) -> Iterator[Running]:
    target, eagle3 = random_family(root, max_position_embeddings=4096)
    metrics = free_port()
    stack = cpu_stack(
        target,
        eagle3,
        draft_deadline_s=1.0,
        extra_target_args=["--metrics-port", str(metrics)],
        local_stream=local_stream,
    )
    try:
        stack.start(log_dir=root / "logs")
        yield Running(stack, root / "logs", metrics)
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with _stack(tmp_path_factory.mktemp("live")) as started:
        yield started


@asynccontextmanager
async def _gateway(running: Running) -> AsyncIterator[gateway_pb2_grpc.GatewayServiceStub]:
    port = running.service("gateway").port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


async def _info(stub: gateway_pb2_grpc.GatewayServiceStub) -> gateway_pb2.GetServerInfoResponse:
    response: gateway_pb2.GetServerInfoResponse = await stub.GetServerInfo(
        gateway_pb2.GetServerInfoRequest(), timeout=10
    )
    return response


Info = gateway_pb2.GetServerInfoResponse


async def _until(
    stub: gateway_pb2_grpc.GatewayServiceStub, check: Callable[[Info], bool], timeout_s: float
) -> Info:
    """GetServerInfo, polled until ``check`` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await _info(stub)
        if check(info):
            return info
        assert time.monotonic() < deadline, f"not there after {timeout_s} s: {info}"
        await asyncio.sleep(0.2)


async def _start_load(stub: gateway_pb2_grpc.GatewayServiceStub, n: int) -> list[asyncio.Task]:
    """``n`` long requests, running (their first tokens are out) when this returns."""
    started = [asyncio.Event() for _ in range(n)]

    async def one(i: int) -> int:
        request = gateway_pb2.GenerateRequest(
            request_id=f"load-{i}",
            token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7, 8 + i]),
            sampling=common_pb2.SamplingParams(max_new_tokens=4000, ignore_eos=True),
        )
        try:
            async for response in stub.Generate(request, timeout=120):
                started[i].set()
                if response.WhichOneof("payload") == "complete":
                    return int(response.complete.finish_reason)
        except grpc.aio.AioRpcError as exc:
            return -exc.code().value[0]
        return 0

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    return tasks


async def _eventually(check: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"not so after {timeout_s} s"
        await asyncio.sleep(0.1)


def _draft_health(running: Running) -> int:
    """The target's health of the name ``tandem.v1.DraftService``."""
    port = running.service("target").port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service="tandem.v1.DraftService")
        return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status)


def _draft_state_metric(running: Running) -> str:
    """The state the target's ``tandem_target_draft_state`` gauge marks with 1."""
    url = f"http://127.0.0.1:{running.target_metrics}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    marked = [
        line.split('state="')[1].split('"')[0]
        for line in lines
        if line.startswith("tandem_target_draft_state") and line.endswith(" 1.0")
    ]
    assert len(marked) == 1, lines
    return marked[0]


def _restart(running: Running, name: str) -> None:
    """Starts the (killed) service again as the stack started it."""
    svc = running.service(name)
    log = open(running.logs / f"{name}-restarted.log", "wb")  # noqa: SIM115 (the process's)
    svc.proc = subprocess.Popen(
        [sys.executable, "-m", svc.module, *svc.args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**service_env(), **svc.env},
    )
    wait_serving(svc, 120)


def test_a_stopped_draft_is_reported_unhealthy_and_recovers(running: Running) -> None:
    draft = running.service("draft").proc
    assert draft is not None

    async def stall(stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
        await _until(stub, lambda info: info.draft_state == HEALTHY, 30)
        os.kill(draft.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            await _until(stub, lambda info: info.draft_state == UNHEALTHY, STOPPED_S - 1)
            # The health entry and the gauge follow within a status interval.
            await _eventually(lambda: _draft_health(running) == NOT_SERVING)
            await _eventually(lambda: _draft_state_metric(running) == "unhealthy")
            await asyncio.sleep(max(0.0, STOPPED_S - (time.monotonic() - stopped)))
        finally:
            os.kill(draft.pid, signal.SIGCONT)
        await _until(stub, lambda info: info.draft_state == HEALTHY, 10)
        await _eventually(lambda: _draft_health(running) == SERVING)
        await _eventually(lambda: _draft_state_metric(running) == "healthy")

    async def run() -> None:
        async with _gateway(running) as stub:
            await stall(stub)  # idle: no step deadline to miss
            load = await _start_load(stub, 2)
            await stall(stub)  # under load: the steps' deadlines
            await _until(stub, lambda info: info.num_running == 2, 10)
            await stub.Abort(gateway_pb2.AbortRequest(request_ids=["load-0", "load-1"]))
            assert await asyncio.gather(*load) == [common_pb2.FINISH_REASON_ABORT] * 2

    asyncio.run(run())


def test_an_idle_stopped_draft_on_the_local_stream_stays_unhealthy(tmp_path: Path) -> None:
    """On the local socket an idle target reads the link every status interval and, with no
    late answer outstanding, would call the draft healthy again: the probe's verdict holds
    until the draft answers."""
    with _stack(tmp_path, local_stream=True) as running:
        assert "local socket" in (running.logs / "target.log").read_text()
        draft = running.service("draft").proc
        assert draft is not None

        async def run() -> None:
            await _eventually(lambda: _draft_health(running) == SERVING, 30)
            os.kill(draft.pid, signal.SIGSTOP)
            try:
                await _eventually(lambda: _draft_health(running) == NOT_SERVING, 4)
                for _ in range(10):  # and it stays so while the draft is stopped
                    await asyncio.sleep(0.2)
                    assert _draft_health(running) == NOT_SERVING
            finally:
                os.kill(draft.pid, signal.SIGCONT)
            await _eventually(lambda: _draft_health(running) == SERVING, 10)

        asyncio.run(run())


def _draft_pool(running: Running) -> common_pb2.KvUsage:
    port = running.service("draft").port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        return stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=10).kv_usage


def test_server_info_after_a_draft_restart_shows_the_drafts_pool(running: Running) -> None:
    async def run() -> None:
        async with _gateway(running) as stub:
            load = await _start_load(stub, 2)
            before = await _until(stub, lambda info: info.draft_kv_usage.pages_used > 0, 10)
            draft = running.service("draft").proc
            assert draft is not None
            draft.kill()
            draft.wait()
            down = await _until(stub, lambda info: info.draft_state == UNHEALTHY, 10)
            await asyncio.sleep(0.5)  # a status interval or two: nothing old comes back
            down = await _info(stub)
            assert not down.HasField("draft_kv_usage"), down  # unknown, not the old pool
            await asyncio.to_thread(_restart, running, "draft")
            await _until(stub, lambda info: info.draft_state == HEALTHY, 30)
            await stub.Abort(gateway_pb2.AbortRequest(request_ids=["load-0", "load-1"]))
            await asyncio.gather(*load)
            await asyncio.sleep(1.0)  # the target's status interval and the draft's releases
            info, pool = await _info(stub), _draft_pool(running)
            assert info.draft_kv_usage.pages_total == pool.pages_total
            assert info.draft_kv_usage.pages_used == pool.pages_used, (before, info, pool)

    asyncio.run(run())


def test_server_info_with_the_target_down_shows_no_old_numbers(running: Running) -> None:
    async def run() -> None:
        async with _gateway(running) as stub:
            load = await _start_load(stub, 2)
            up = await _until(
                stub, lambda info: info.num_running == 2 and info.target_connected, 10
            )
            assert up.target_kv_usage.pages_used > 0
            target = running.service("target").proc
            assert target is not None
            target.kill()
            target.wait()
            await asyncio.gather(*load)  # they fail: the target is gone
            info = await _until(stub, lambda info: not info.target_connected, 10)
            assert info.num_running == 0, info
            assert info.draft_state == common_pb2.DRAFT_STATE_UNSPECIFIED, info
            assert not info.HasField("target_kv_usage"), info
            assert not info.HasField("draft_kv_usage"), info

    asyncio.run(run())
