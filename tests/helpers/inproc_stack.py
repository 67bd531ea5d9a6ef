"""The three services in the test process, each a real gRPC server on loopback, wired as
``tandem serve`` wires them (draft <- target's RemoteDrafter, target <- gateway's Control
stream) with tiny random models: the draft on its own event loop thread (``ServerThread``), the
target and the gateway on another, so the tests' clients (sync gRPC) never share a loop with a
server. Faster to start than processes, for the fuzz and storm tests (tests/chaos/)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from draft_service.config import DraftServiceConfig
from gateway.__main__ import Gateway, start_gateway
from gateway.config import GatewayConfig
from tandem.config import DraftConfig, EngineConfig
from tandem.link.remote import RemoteDrafter
from tandem.models.config import ModelConfig
from tandem.serving import rpc
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tandem.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from target_service.__main__ import get_info, status, warm_up
from target_service.config import TargetServiceConfig
from target_service.engine import TargetLoop
from target_service.server import TargetServicer
from tests.helpers.draft_service import ServerThread

T = TypeVar("T")
VOCAB = 512
MAX_MODEL_LEN = 128


@dataclass(frozen=True)
class Checkpoints:
    target: Path
    draft: Path


def make_checkpoints(root: Path) -> Checkpoints:
    """A 2-layer llama target (its word-level tokenizer beside it) and an EAGLE-3 head."""
    target = make_checkpoint(
        root / "target",
        "llama",
        seed=12,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_MODEL_LEN,
    )
    draft = make_eagle3_checkpoint(root / "eagle3", target, draft_vocab_size=256, seed=2)
    return Checkpoints(target=target, draft=draft)


class InProcessStack:
    """Draft, target and gateway servers on loopback; ``gateway``, ``target`` and ``draft``
    are sync stubs for the tests (``channel(...)`` gives more)."""

    def __init__(self, ckpts: Checkpoints, **gateway: Any) -> None:
        draft_config = DraftConfig(
            kind="eagle3", path=ckpts.draft, target=ckpts.target, num_pages=512
        )
        self.draft_server = ServerThread(DraftServiceConfig(draft=draft_config, port=0))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.config = TargetServiceConfig(
            engine=EngineConfig(model=ckpts.target, num_pages=512),
            draft_addr=self.draft_server.address,
            draft_kind="eagle3",
            spec=SpecConfig(num_steps=3, topk=2, num_draft_tokens=6),
            draft_deadline_s=2.0,
        )
        self.drafter = RemoteDrafter(
            self.draft_server.address,
            num_target_layers=ModelConfig.from_pretrained(ckpts.target).num_layers,
            deadline_s=self.config.draft_deadline_s,
            local_stream=False,
        )
        self.engine = Engine(self.config.engine, drafter=self.drafter, spec=self.config.spec)
        warm_up(self.engine)
        self.target_loop = TargetLoop(
            self.engine, status=lambda: status(self.engine, self.drafter), status_interval_s=0.05
        )
        self.target_server, self.target_port = self.run(self._start_target())
        self.target_loop.start()
        gateway_config = GatewayConfig(
            target_addr=f"127.0.0.1:{self.target_port}",
            tokenizer=ckpts.target,
            host="127.0.0.1",
            port=0,
            **gateway,
        )
        self.gateway_server: Gateway = self.run(start_gateway(gateway_config))
        self.run(self.gateway_server.client.wait_connected(30.0))
        self._channels = [
            grpc.insecure_channel(f"127.0.0.1:{port}")
            for port in (self.gateway_server.port, self.target_port, self.draft_server.server.port)
        ]
        self.gateway = gateway_pb2_grpc.GatewayServiceStub(self._channels[0])
        self.target = target_pb2_grpc.TargetServiceStub(self._channels[1])
        self.draft = draft_pb2_grpc.DraftServiceStub(self._channels[2])

    @property
    def addresses(self) -> dict[str, str]:
        ports = (self.gateway_server.port, self.target_port, self.draft_server.server.port)
        return {
            n: f"127.0.0.1:{p}" for n, p in zip(("gateway", "target", "draft"), ports, strict=True)
        }

    def channel(self, service: str) -> grpc.Channel:
        return self._channels[("gateway", "target", "draft").index(service)]

    async def _start_target(self) -> tuple[grpc.aio.Server, int]:
        server = rpc.make_server(max_message_bytes=self.config.max_message_bytes)
        info = get_info(self.engine, self.config)
        target_pb2_grpc.add_TargetServiceServicer_to_server(
            TargetServicer(self.target_loop, info), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def idle(self) -> dict[str, int]:
        """What each pool and service holds now, as the services report it: the target's KV
        pages in use (in the status it streams to the gateway, GetServerInfo, and in its own
        GetInfo) and its requests, the draft's pages in use (its GetInfo) and the requests it
        tracks, and the gateway's admission slots taken."""
        server = self.gateway.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=10)
        draft = self.draft.GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=10)
        target = self.target.GetInfo(target_pb2.TargetServiceGetInfoRequest(), timeout=10)
        return {
            "target_pages": server.target_kv_usage.pages_used,
            "target_pages_now": target.status.kv_usage.pages_used,  # its GetInfo
            "target_requests": server.num_running + server.num_waiting,
            "draft_pages": draft.kv_usage.pages_used,
            "draft_requests": self.draft_server.num_tracked(),
            "gateway_slots": self.gateway_server.servicer.admission.num_running,
        }

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, int]:
        """``idle()`` once every count is 0, or the last counts after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.idle()
            if not any(counts.values()) or time.monotonic() > deadline:
                return counts
            time.sleep(0.05)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self.run(self.gateway_server.stop(0))
        self.run(self.target_server.stop(0))
        self.target_loop.stop()
        self.drafter.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.draft_server.stop()
