"""Calls the end-to-end tests make on a running stack: greedy generations through the gateway,
its server info, and a killed draft service started again."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import grpc

from tandem.apps.launch import Service, wait_serving
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

NEW_TOKENS = 24  # each generation's length


async def generate(
    port: int,
    prompt_ids: list[list[int]],
    *,
    speculate: bool = True,
    first_chunk: asyncio.Event | None = None,
) -> list[dict[str, Any]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def one(ids: list[int]) -> dict[str, Any]:
            request = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=ids),
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True
                ),
            )
            if not speculate:
                request.speculation.enabled = False
            tokens: list[int] = []
            done: Any = None
            async for response in stub.Generate(request):
                if response.WhichOneof("payload") == "chunk":
                    tokens += response.chunk.token_ids
                    if first_chunk is not None:
                        first_chunk.set()
                elif response.WhichOneof("payload") == "complete":
                    done = response.complete
            return {"tokens": tokens, "complete": done}

        return list(await asyncio.gather(*(one(p) for p in prompt_ids)))


async def server_info(port: int) -> gateway_pb2.GetServerInfoResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        return await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())


def restart_draft(draft: Service, gateway: int) -> None:
    """Starts a killed draft service again (same flags, same port) and waits until the
    gateway reports the target re-attached."""
    draft.proc = subprocess.Popen(
        [sys.executable, "-m", draft.module, *draft.args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_serving(draft, 120)
    deadline = time.monotonic() + 30
    while asyncio.run(server_info(gateway)).draft_state != common_pb2.DRAFT_STATE_HEALTHY:
        assert time.monotonic() < deadline, "the target never re-attached to the draft"
        time.sleep(0.2)
