"""``tandem serve``: the three services as three local processes, started in dependency order
(draft, target, gateway), each awaited until its gRPC health says SERVING; Ctrl-C or SIGTERM
stops all three (SIGTERM first, so each drains; SIGKILL after the grace period)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.serving.rpc import channel_options


def resolve_gateway_host(given: str | None = None) -> str:
    """The gateway's address under ``tandem serve``: ``given`` (``--gateway-host``), else
    ``TANDEM_GATEWAY_HOST``, else loopback: a laptop's stack is not a public server."""
    return given or os.environ.get("TANDEM_GATEWAY_HOST") or "127.0.0.1"


@dataclass
class Service:
    name: str
    module: str
    args: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # over service_env()


@dataclass
class Stack:
    services: list[Service] = field(default_factory=list)
    scratch: Path | None = None  # a private directory (the draft's local socket); removed at stop

    def start(
        self,
        *,
        ready_timeout_s: float = 300.0,
        log_dir: Path | None = None,
        on_ready: Callable[[Service], None] | None = None,
    ) -> None:
        for svc in self.services:
            self.launch(svc, log_dir)
            wait_serving(svc, ready_timeout_s)
            if on_ready is not None:
                on_ready(svc)

    def launch(self, svc: Service, log_dir: Path | None) -> None:
        """Starts one service's process (again, for a restart: its log is appended to)."""
        out = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            svc.log = log_dir / f"{svc.name}.log"
            mode = "wb" if svc.proc is None else "ab"  # a restart appends
            out = open(svc.log, mode)  # noqa: SIM115 (the child holds its own copy)
        try:
            svc.proc = subprocess.Popen(
                [sys.executable, "-m", svc.module, *svc.args],
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                env={**service_env(), **svc.env},
            )
        finally:
            if out is not None:
                out.close()

    def stop(self, grace_s: float = 10.0) -> None:
        for svc in reversed(self.services):  # gateway first: clients drain before the target
            if svc.proc is not None and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for svc in self.services:
            if svc.proc is None:
                continue
            try:
                svc.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def dead(self) -> list[Service]:
        return [s for s in self.services if s.proc is not None and s.proc.poll() is not None]


def service_env() -> dict[str, str]:
    """The services' environment: ours, unbuffered, and traces off unless an exporter or an
    OTLP endpoint is configured (a laptop has no collector; docs/operations.md)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    otlp = (
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    )
    if not any(env.get(name) for name in otlp):
        env["OTEL_TRACES_EXPORTER"] = "none"
    return env


def wait_serving(svc: Service, timeout_s: float) -> None:
    """Polls the service's health until SERVING; fails early if the process exits."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{svc.port}", options=channel_options()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert svc.proc is not None
            if svc.proc.poll() is not None:
                reason = failure_reason(svc.log) if svc.log else None
                raise RuntimeError(
                    f"{svc.name} exited with {svc.proc.returncode} before it was ready"
                    + (f": {reason}" if reason else "")
                    + (f" (log: {svc.log})" if svc.log else "")
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{svc.name} was not SERVING on port {svc.port} after {timeout_s:.0f} s")


def failure_reason(log: Path) -> str | None:
    """The last error a service wrote before it exited, as one line: the exception of a
    traceback (the services log a traceback on one line, its frames joined by " | "), or a
    usage error, or the last line logged at ERROR."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return None
    for line in reversed(lines):
        last = line.split(" | ")[-1].strip()
        if found := _EXCEPTION.match(last):
            return last[found.start("name") :]  # without the exception's module
        if (usage := line.partition(": error: ")[2]) or (usage := _logged_error(line)):
            return usage.strip()
    return None


_EXCEPTION = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*(?P<name>\w*(Error|Exception|Exit|Interrupt))(: .*)?$"
)


def _logged_error(line: str) -> str:
    """The message of a line logged at ERROR or CRITICAL (``... ERROR name: message``)."""
    found = re.search(r" (ERROR|CRITICAL) [\w.]+: (.*)", line)
    return found[2] if found else ""


def build_stack(
    *,
    target: Path,
    draft: Path | None,
    draft_kind: str | None,
    mtp_mode: str,
    spec_args: Sequence[str],
    page_size: int,
    device: str,
    dtype: str,
    gateway_port: int,
    target_port: int,
    draft_port: int,
    draft_deadline_s: float = 1.0,
    two_lane_batch: int = 16,
    gateway_host: str | None = None,
    extra_target_args: Sequence[str] = (),
    extra_gateway_args: Sequence[str] = (),
    gateway_env: Mapping[str, str] | None = None,
    local_stream: bool = False,
) -> Stack:
    """The three services on loopback ports. With ``local_stream`` the draft also serves a
    Unix socket in a private directory (``Stack.scratch``), which the target then takes for
    its Speculate stream (``tandem.link.local``; the benchmark's stacks do). Off by default:
    ``tandem serve`` runs what compose's cpu profile runs, where the services share no
    directory. Every service, the gateway included, listens (and serves its metrics, when
    ``TANDEM_*_METRICS_PORT`` asks for them) on loopback: the gateway's address is
    ``gateway_host``, else ``TANDEM_GATEWAY_HOST``, else 127.0.0.1, given in its environment
    so that its command line stays the one compose's cpu profile runs (a container's
    published port needs every interface); ``gateway_env`` adds to that environment."""
    common = ["--device", device, "--dtype", dtype, "--page-size", str(page_size)]
    launch_host = resolve_gateway_host(gateway_host)
    services = []
    scratch = None
    speculate = draft is not None or draft_kind is not None
    if speculate:
        kind = draft_kind or "eagle3"
        draft_args = ["--target", str(target), "--draft-kind", kind, "--mtp-mode", mtp_mode]
        if local_stream:
            scratch = Path(tempfile.mkdtemp(prefix="tandem-"))  # mode 0700
            draft_args += ["--local-socket", str(scratch / "draft.sock")]
        if draft is not None:
            draft_args += ["--draft", str(draft)]
        services.append(
            Service(
                "draft",
                "draft_service",
                [*draft_args, *common, "--port", str(draft_port)],
                draft_port,
            )
        )
    target_args = ["--target", str(target), *common, "--port", str(target_port)]
    if speculate:
        target_args += [
            "--draft-addr",
            f"127.0.0.1:{draft_port}",
            "--draft-kind",
            draft_kind or "eagle3",
            "--draft-deadline",
            str(draft_deadline_s),
            *spec_args,
        ]
    services.append(
        Service("target", "target_service", [*target_args, *extra_target_args], target_port)
    )
    services.append(
        Service(
            "gateway",
            "gateway",
            [
                "--target-addr",
                f"127.0.0.1:{target_port}",
                "--tokenizer",
                str(target),
                "--port",
                str(gateway_port),
                "--two-lane-batch",
                str(two_lane_batch),
                *extra_gateway_args,
            ],
            gateway_port,
            env={"TANDEM_GATEWAY_HOST": launch_host, **(gateway_env or {})},
        )
    )
    return Stack(services, scratch)
