"""The SGLang Model Gateway router (``smg launch``) as a test process in front of Tandem's
worker ports (``--smg-port``), and the ``openai`` client on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai

from tandem.apps.demo import free_port

TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "tandem-code-ref" / "target"
SMG = Path(sys.executable).with_name("smg")


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def said(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_router(root: Path, worker_ports: list[int], timeout_s: float = 120.0) -> Router:
    """``smg launch`` on free ports with the local checkpoint as model and tokenizer; returns
    once every worker answers a completion through it."""
    port = free_port()
    argv = [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", *(f"grpc://127.0.0.1:{p}" for p in worker_ports)]
    argv += ["--model-path", str(TARGET), "--prometheus-port", str(free_port())]
    argv += ["--policy", "round_robin", "--log-level", "info"]
    log = root / f"smg-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    router = Router(proc, port, log)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"smg exited:\n{router.said()}"
        try:
            models = client.models.list().data
            if models and _workers_ready(port, len(worker_ports)):
                return router
        except openai.APIError:
            pass
        if time.monotonic() > deadline:
            router.stop()
            raise AssertionError(f"smg not ready after {timeout_s} s:\n{router.said()}")
        time.sleep(0.5)


def _workers_ready(port: int, count: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=5) as answer:
        workers = json.loads(answer.read()).get("workers", [])
    return len(workers) == count and all(w.get("is_healthy", False) for w in workers)


def client(router: Router) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.port}/v1", api_key="none", max_retries=0, timeout=300
    )
