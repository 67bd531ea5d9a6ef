"""The batch client through ``tandem serve`` (the embedded model) whose gateway is SIGKILLed
mid-batch: the streams in flight end with UNAVAILABLE, the client retries them while the
supervisor restarts the gateway, and every prompt comes back once with the tokens and text of
an undisturbed one-at-a-time run: nothing lost, nothing repeated."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tandem.apps.client import RetryPolicy, generate_remote
from tests.helpers.serve import Serve, start_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW_TOKENS = 32
PROMPTS = [f"def g{i}(y):\n    return" + " y" * (i % 4) for i in range(12)]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    running = start_serve(tmp_path_factory.mktemp("serve"), "--draft-deadline", "10")
    try:
        yield running
    finally:
        running.stop()


def batch(serve: Serve, **options: Any) -> list[dict[str, Any]]:
    return generate_remote(
        f"127.0.0.1:{serve.port}",
        PROMPTS,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        seed=None,
        max_new_tokens=NEW_TOKENS,
        ignore_eos=True,
        **options,
    )


def test_a_batch_outlives_a_dead_gateway(serve: Serve) -> None:
    undisturbed = batch(serve, max_in_flight=1)
    done: list[dict[str, Any]] = []
    retried: list[grpc.StatusCode] = []
    out: list[list[dict[str, Any]]] = []
    runner = threading.Thread(
        target=lambda: out.append(
            batch(
                serve,
                max_in_flight=4,
                retry=RetryPolicy(attempts=40, max_backoff_s=2.0),
                on_done=lambda _, record: done.append(record),
                on_retry=lambda code, _: retried.append(code),
            )
        )
    )
    runner.start()
    deadline = time.monotonic() + 120
    while not done:  # some finished, the next ones are streaming
        assert runner.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    serve.kill("gateway")
    runner.join(300)
    assert not runner.is_alive() and out, "the batch did not finish"
    assert retried and set(retried) == {grpc.StatusCode.UNAVAILABLE}
    serve.wait_for("gateway restarted (restart 1)", 60)
    records = out[0]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["token_ids"] for r in records] == [r["token_ids"] for r in undisturbed]
    assert [r["text"] for r in records] == [r["text"] for r in undisturbed]
    assert all(r["completion_tokens"] == NEW_TOKENS for r in records)
