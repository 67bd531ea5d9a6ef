"""``tandem serve`` as the chaos tests run it: the command in a child process (as a user starts
it, its supervision included), its services found among its children for a SIGKILL, and
concurrent greedy streams through its gateway with a hook that runs once every stream is
under way."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.apps.demo import free_port
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


@dataclass
class Serve:
    """A running ``tandem serve``: its process, its gateway's port, its stderr and logs."""

    proc: subprocess.Popen[bytes]
    port: int
    stderr: Path
    log_dir: Path

    def said(self) -> str:
        return self.stderr.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float) -> None:
        """Until ``text`` is in its stderr; fails early if it exits."""
        deadline = time.monotonic() + timeout_s
        while text not in self.said():
            assert self.proc.poll() is None, f"tandem serve exited:\n{self.said()}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{self.said()}"
            time.sleep(0.2)

    def service_pid(self, module: str) -> int:
        """The pid of the child that runs ``python -m module``."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        for pid in children.split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[1:3] == [b"-m", module.encode()]:
                return int(pid)
        raise AssertionError(f"no {module} among the children of tandem serve")

    def kill(self, module: str) -> None:
        os.kill(self.service_pid(module), signal.SIGKILL)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def start_serve(root: Path, *args: str, ready_timeout_s: float = 240.0) -> Serve:
    """``tandem serve ARGS`` on free ports, on CPU in float32, its logs under ``root``; returns
    once it says it is serving."""
    port = free_port()
    ports = ["--gateway-port", str(port), "--target-port", str(free_port())]
    ports += ["--draft-port", str(free_port())]
    where = ["--log-dir", str(root / "logs"), "--device", "cpu", "--dtype", "float32"]
    stderr = root / "serve.err"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem", "serve", *ports, *where, *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "COLUMNS": "250"},
        )
    serve = Serve(proc, port, stderr, root / "logs")
    try:
        serve.wait_for("serving on", ready_timeout_s)
    except BaseException:
        serve.stop()
        raise
    return serve


@dataclass
class Stream:
    """What one client received."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    complete: gateway_pb2.GenerateComplete | None = None
    at_hook: int = -1  # tokens received when the hook ran


async def streams(
    port: int,
    prompts: list[str],
    new_tokens: int,
    *,
    hook: Callable[[], Awaitable[None]] | None = None,
    after_tokens: int = 4,
) -> list[Stream]:
    """Greedy streams of ``new_tokens`` (logprobs on), all at once; ``hook`` runs once every
    stream has received ``after_tokens`` tokens."""
    out = [Stream() for _ in prompts]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def one(text: str, stream: Stream) -> None:
            sampling = common_pb2.SamplingParams(
                temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=True
            )
            request = gateway_pb2.GenerateRequest(text=text, sampling=sampling)
            async for response in stub.Generate(request, timeout=300):
                if response.HasField("chunk"):
                    stream.tokens += response.chunk.token_ids
                    stream.text += response.chunk.text
                    stream.logprobs += response.chunk.logprobs
                elif response.HasField("complete"):
                    stream.complete = response.complete

        runs = [asyncio.create_task(one(p, s)) for p, s in zip(prompts, out, strict=True)]
        if hook is not None:
            while min(len(s.tokens) for s in out) < after_tokens:
                assert not any(r.done() for r in runs), [r.exception() for r in runs if r.done()]
                await asyncio.sleep(0.01)
            for s in out:
                s.at_hook = len(s.tokens)
            await hook()
        await asyncio.gather(*runs)
    return out


async def server_info(port: int) -> gateway_pb2.GetServerInfoResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        return await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=10)
