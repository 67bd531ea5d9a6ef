"""Abort and cancel storms against the services in process (real gRPC servers on loopback,
tests/helpers/inproc_stack.py): rounds of 48 concurrent streams, half cancelled by their
clients mid-stream, a quarter aborted by id, the rest completing; afterwards both KV pools hold
no page and no service tracks a request, and the stack still serves."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.v1 import common_pb2, gateway_pb2
from tests.helpers.inproc_stack import InProcessStack, make_checkpoints

pytestmark = pytest.mark.slow

STREAMS, ROUNDS = 48, 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessStack]:
    running = InProcessStack(make_checkpoints(tmp_path_factory.mktemp("storms")))
    yield running
    running.close()


def _request(name: str, n: int) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(
        request_id=name, token_ids=gateway_pb2.TokenIds(ids=[5 + n % 40, 6, 7, 8])
    )
    request.sampling.max_new_tokens = 40
    request.sampling.ignore_eos = True
    request.sampling.temperature = 0.0 if n % 2 else 0.8
    return request


def _stream(stack: InProcessStack, name: str, n: int, fate: str) -> str:
    """One client: reads a few chunks, then cancels, asks for an abort, or reads to the end;
    returns how its stream ended."""
    call = stack.gateway.Generate(_request(name, n), timeout=120)
    chunks = 0
    try:
        for response in call:
            if response.HasField("complete"):
                return common_pb2.FinishReason.Name(response.complete.finish_reason)
            chunks += 1
            if chunks == 1 + n % 3 and fate == "cancel":
                call.cancel()
            elif chunks == 1 + n % 3 and fate == "abort":
                threading.Thread(
                    target=stack.gateway.Abort,
                    args=(gateway_pb2.AbortRequest(request_ids=[name, f"unknown-{n}"]),),
                ).start()
    except grpc.RpcError as exc:
        return exc.code().name  # type: ignore[attr-defined]
    return "no completion"


def test_abort_and_cancel_storms_leave_nothing_behind(stack: InProcessStack) -> None:
    rng = random.Random(7)
    with ThreadPoolExecutor(STREAMS) as pool:
        for round_ in range(ROUNDS):
            fates = ["cancel"] * (STREAMS // 2) + ["abort"] * (STREAMS // 4)
            fates += ["complete"] * (STREAMS - len(fates))
            rng.shuffle(fates)
            names = [f"s{round_}-{n}" for n in range(STREAMS)]
            ends = list(
                pool.map(
                    lambda a: _stream(stack, *a), zip(names, range(STREAMS), fates, strict=True)
                )
            )
            for fate, end in zip(fates, ends, strict=True):
                expected = {
                    "cancel": {"CANCELLED", "FINISH_REASON_LENGTH"},
                    "abort": {"FINISH_REASON_ABORT", "FINISH_REASON_LENGTH"},
                    "complete": {"FINISH_REASON_LENGTH"},
                }[fate]
                assert end in expected, (fate, end)
            assert ends.count("CANCELLED") >= STREAMS // 4
            assert ends.count("FINISH_REASON_ABORT") >= STREAMS // 8
            idle = stack.wait_idle()
            assert idle == dict.fromkeys(idle, 0), (round_, idle)
    request = _request("after", 1)
    request.sampling.max_new_tokens = 4
    tokens = [t for r in stack.gateway.Generate(request, timeout=60) for t in r.chunk.token_ids]
    assert len(tokens) == 4
