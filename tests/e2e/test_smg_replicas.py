"""Two Tandem stacks behind one SGLang Model Gateway router (issue 34, item 2): the router
spreads requests over both, and when one stack is killed mid-run the other serves every new
request. Each stack's gateway log says which requests it finished."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tandem.apps.demo import free_port
from tests.helpers.serve import Serve, start_serve
from tests.helpers.smg import Router, client, start_router

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def finished(serve: Serve) -> int:
    """Requests the stack's gateway completed (the router's ids start with cmpl-)."""
    log = (serve.log_dir / "gateway.log").read_text(errors="replace")
    return len(re.findall(r"request cmpl-\S+: FINISH_REASON_LENGTH", log))


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Serve], Router]]:
    stacks: list[Serve] = []
    ports = [free_port(), free_port()]
    router: Router | None = None
    try:
        for n, port in enumerate(ports):
            root = tmp_path_factory.mktemp(f"replica{n}")
            stacks.append(start_serve(root, "--smg-port", str(port)))
        router = start_router(Path(tmp_path_factory.mktemp("router")), ports)
        yield stacks, router
    finally:
        if router is not None:
            router.stop()
        for serve in stacks:
            serve.stop()


def test_load_spreads_and_the_survivor_takes_over(replicas: tuple[list[Serve], Router]) -> None:
    (first, second), router = replicas
    api = client(router)
    model = api.models.list().data[0].id

    def complete(n: int) -> openai.types.Completion:
        prompt = f"def f{n}(x):\n"
        return api.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(complete, range(8)))
    assert all(a.usage is not None and a.usage.completion_tokens == 8 for a in answers)
    assert finished(first) >= 2 and finished(second) >= 2  # round robin: both served
    assert finished(first) + finished(second) == 8

    # Kill one stack (SIGKILL: its supervisor, then its three services) while requests are in
    # flight; every request sent afterwards succeeds on the other (the router retries a
    # request the dead worker cannot take, and stops routing to it once its checks fail).
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(complete, n) for n in range(100, 104)]
        services = [first.service_pid(m) for m in ("gateway", "target_service", "draft_service")]
        for pid in (first.proc.pid, *services):
            os.kill(pid, signal.SIGKILL)
        first.proc.wait(30)
        for future in running:  # served before the kill, retried on the other, or failed
            with contextlib.suppress(openai.APIError):
                future.result(timeout=300)
    before = finished(second)
    answers = [complete(n) for n in range(200, 206)]
    assert all(a.usage is not None and a.usage.completion_tokens == 8 for a in answers)
    assert finished(second) == before + 6
