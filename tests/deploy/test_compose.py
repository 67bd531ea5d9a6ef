"""The compose contract, checked without a Docker engine: compose.yaml and the Dockerfiles are
parsed, and every command they run is checked against the argument parser of the service it
starts. The cpu profile must run exactly the processes ``tandem serve`` starts (whose command
lines the e2e tests run for real)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from tests.helpers.commands import parse_command, parsers

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
# compose service -> (module, profile); the cpu services are the `tandem serve` processes
TANDEM = {
    "draft": ("draft_service", "gpu"),
    "target": ("target_service", "gpu"),
    "gateway": ("gateway", "gpu"),
    "draft-cpu": ("draft_service", "cpu"),
    "target-cpu": ("target_service", "cpu"),
    "gateway-cpu": ("gateway", "cpu"),
}
OTLP = "http://otel-collector:4317"
_VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(:-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with the variable unset: the default."""
    return _VARIABLE.sub(lambda m: m.group(3) or "", value)


def check_command(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """``parse_command`` with compose's ``${VAR:-default}`` variables unset."""
    return parse_command([*argv[:3], *(interpolate(a) for a in argv[3:])])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def env_of(name: str) -> dict[str, Any]:
    env = SERVICES[name].get("environment", {})
    assert isinstance(env, dict), f"{name}: use the map form of environment"
    return env


def test_services_and_profiles() -> None:
    assert set(SERVICES) == {*TANDEM, "cpu-pod", "otel-collector", "jaeger"}
    for name, (_, profile) in TANDEM.items():
        assert SERVICES[name]["profiles"] == [profile], name
    assert SERVICES["cpu-pod"]["profiles"] == ["cpu"]
    for name in ("otel-collector", "jaeger"):  # telemetry runs with either profile
        assert "profiles" not in SERVICES[name]


def test_images_and_builds() -> None:
    for name, (module, profile) in TANDEM.items():
        service = SERVICES[name]
        gpu = profile == "gpu" and module != "gateway"  # the gateway holds no model
        dockerfile = "docker/Dockerfile.gpu" if gpu else "docker/Dockerfile.cpu"
        build = {"context": ".", "dockerfile": dockerfile}
        if not gpu:  # the CPU image's base: made from Debian's packages by default
            build["args"] = {"BASE_IMAGE": "${TANDEM_BASE_IMAGE:-tandem-base:bookworm}"}
        assert service["build"] == build, name
        assert service["image"] == ("tandem:gpu" if gpu else "tandem:cpu"), name
        assert (ROOT / dockerfile).is_file()
        assert "./checkpoints:/app/checkpoints:ro" in service["volumes"]
    assert SERVICES["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")
    collector = SERVICES["otel-collector"]
    assert collector["image"].startswith("otel/opentelemetry-collector-contrib:")
    source, mounted = collector["volumes"][0].split(":")[:2]
    assert (ROOT / source).is_file()
    assert f"--config={mounted}" in collector["command"]


def test_every_command_is_accepted_by_its_service() -> None:
    for name, (module, profile) in TANDEM.items():
        argv = SERVICES[name]["command"]
        parsed_module, args = check_command(argv)
        assert parsed_module == module, name
        if module != "gateway":
            assert args.device == ("cuda" if profile == "gpu" else "cpu"), name
    for var in _VARIABLE.finditer((ROOT / "compose.yaml").read_text()):
        assert var.group(2), f"${{{var.group(1)}}} needs a default: `up` must work without .env"


def test_health_checks_run_the_probe_on_the_service_port() -> None:
    assert importlib.util.find_spec("tandem.serving.health_probe") is not None
    for name in TANDEM:
        service = SERVICES[name]
        check = service["healthcheck"]
        assert check["test"][0] == "CMD", name  # exec form: no shell in the way
        module, args = check_command(check["test"][1:])
        assert module == "tandem.serving.health_probe"
        assert args.address == f"127.0.0.1:{flag(service['command'], '--port')}", name
        for key in ("interval", "timeout", "retries", "start_period"):
            assert key in check, f"{name}: healthcheck.{key}"


def test_depends_on_waits_for_healthy_services() -> None:
    order = [("target", "draft"), ("gateway", "target")]
    order += [("target-cpu", "draft-cpu"), ("gateway-cpu", "target-cpu")]
    for dependent, dependency in order:
        assert SERVICES[dependent]["depends_on"][dependency] == {"condition": "service_healthy"}
    for name, service in SERVICES.items():
        profiles = set(service.get("profiles", []))
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in SERVICES, f"{name} depends on unknown {dependency}"
            other = set(SERVICES[dependency].get("profiles", []))
            assert not other or other & profiles, f"{name} depends on {dependency} of {other}"
            healthy = spec["condition"] == "service_healthy"
            assert not healthy or "healthcheck" in SERVICES[dependency], dependency
    for name in TANDEM:
        assert SERVICES[name]["depends_on"]["otel-collector"]["condition"] == "service_started"


def test_ports_publish_only_the_public_faces() -> None:
    published = "${TANDEM_GATEWAY_PORT:-50051}"
    gateway_port = flag(SERVICES["gateway"]["command"], "--port")
    assert SERVICES["gateway"]["ports"] == [f"{published}:{gateway_port}"]
    gateway_cpu_port = flag(SERVICES["gateway-cpu"]["command"], "--port")
    assert SERVICES["cpu-pod"]["ports"] == [f"{published}:{gateway_cpu_port}"]
    for name in ("draft", "target", "draft-cpu", "target-cpu", "gateway-cpu"):
        assert "ports" not in SERVICES[name], f"{name} must not be published"
    for name in ("draft", "target"):
        assert SERVICES[name]["expose"] == [flag(SERVICES[name]["command"], "--port")]
        assert flag(SERVICES[name]["command"], "--host") == "0.0.0.0"  # reachable by peers
    assert "16686:16686" in SERVICES["jaeger"]["ports"]


def test_gpu_reservations_only_where_a_model_runs_on_gpu() -> None:
    for name in ("draft", "target"):
        devices = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia"
        assert devices[0]["capabilities"] == ["gpu"]
        assert "count" in devices[0] or "device_ids" in devices[0]
    for name in ("gateway", "cpu-pod", "draft-cpu", "target-cpu", "gateway-cpu"):
        assert "deploy" not in SERVICES[name], name


def test_environment_exports_telemetry_and_only_known_tandem_variables() -> None:
    names = {}
    for name, (module, _) in TANDEM.items():
        env = env_of(name)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == OTLP
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
        names[name] = env["OTEL_SERVICE_NAME"]
        assert names[name] == f"tandem-{module.removesuffix('_service')}"
        variables = [v for v in env if v.startswith("TANDEM_")]
        for variable in variables:
            read = parser_variables(module, variables)
            assert variable in read, f"{name}: {variable} is read by nobody"
    assert len(set(names.values())) == 3
    collector = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    jaeger_exporter = collector["exporters"]["otlp/jaeger"]
    assert jaeger_exporter["endpoint"] == "jaeger:4317"
    pipelines = collector["service"]["pipelines"]
    assert pipelines["traces"]["exporters"] == ["otlp/jaeger"]
    assert "otlp" in pipelines["traces"]["receivers"]
    assert "otlp" in pipelines["metrics"]["receivers"]
    assert "receivers.otlp.protocols.grpc.endpoint=0.0.0.0:4317" in SERVICES["jaeger"]["command"]


def parser_variables(module: str, candidates: list[str]) -> set[str]:
    """The TANDEM_* variables among ``candidates`` that ``module``'s parser reads: each is set to
    a marker, and it counts when a flag's default then is that marker (a text flag) or when the
    parser refuses the marker naming the variable (a typed flag)."""
    found = set()
    with pytest.MonkeyPatch.context() as mp:
        for variable in sorted(candidates):
            marker = f"marker-{variable.lower()}-0123456789"
            mp.setenv(variable, marker)
            try:
                defaults = {str(a.default) for a in parsers()[module]()._actions}
            except ValueError as exc:
                defaults = {marker} if variable in str(exc) else set()
            if marker in defaults:
                found.add(variable)
            mp.delenv(variable)
    return found


@pytest.fixture
def serve_commands(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[str]]]:
    """The processes `tandem serve` starts for the embedded model, captured from the real CLI:
    only ``Stack.start`` (which would spawn them) is replaced, by a recorder."""
    from typer.testing import CliRunner

    from tandem.apps import launch
    from tandem.apps.cli import app

    stacks: list[launch.Stack] = []

    def record(self: launch.Stack, **_: object) -> None:
        stacks.append(self)
        raise RuntimeError("recorded")  # serve reports it and stops the (unstarted) stack

    for variable in ("TANDEM_TARGET", "TANDEM_DEVICE", "TANDEM_DTYPE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(launch.Stack, "start", record)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        argv = ["serve", "--target", "checkpoints/tandem-code-ref/target"]
        argv += ["--draft", "checkpoints/tandem-code-ref/eagle3", "--draft-kind", "eagle3"]
        result = CliRunner().invoke(app, argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert len(stacks) == 1, result.output
    yield {svc.name: ["python", "-m", svc.module, *svc.args] for svc in stacks[0].services}


def test_cpu_profile_runs_exactly_what_tandem_serve_starts(
    serve_commands: dict[str, list[str]],
) -> None:
    assert set(serve_commands) == {"draft", "target", "gateway"}
    for name, argv in serve_commands.items():
        assert SERVICES[f"{name}-cpu"]["command"] == argv, shlex.join(argv)
        # `tandem serve` wires them over 127.0.0.1: one network namespace, the pod's.
        assert SERVICES[f"{name}-cpu"]["network_mode"] == "service:cpu-pod"
    pod = SERVICES["cpu-pod"]
    assert pod["entrypoint"] == ["sleep", "infinity"] and pod["init"] is True


def test_the_override_without_telemetry_leaves_out_only_the_collector_and_jaeger() -> None:
    """docker/compose.no-telemetry.yaml, for hosts without those images: both move to a
    profile neither cpu nor gpu turns on, nothing waits for the collector, nothing exports."""
    override = yaml.safe_load((ROOT / "docker/compose.no-telemetry.yaml").read_text())
    assert override["name"] == COMPOSE["name"]
    services = override["services"]
    assert set(services) == {*TANDEM, "otel-collector", "jaeger"}
    for name in ("otel-collector", "jaeger"):
        assert services[name] == {"profiles": ["telemetry"]}
    for name in TANDEM:
        assert services[name]["depends_on"] == {
            "otel-collector": {"condition": "service_started", "required": False}
        }
        assert services[name]["environment"] == {
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "none",
        }


# ---- Dockerfiles ----


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["gpu", "cpu"])
def test_dockerfile_commands_are_accepted_by_the_cli(name: str) -> None:
    steps = instructions(ROOT / f"docker/Dockerfile.{name}")
    keywords = [k for k, _ in steps]
    assert "ENTRYPOINT" not in keywords  # compose's `command` is the whole argv
    assert keywords.count("CMD") == 1
    # Exec form (JSON): SIGTERM reaches Python, which drains.
    cmd = json.loads(next(rest for k, rest in steps if k == "CMD"))
    module, _ = check_command(cmd)
    assert module == ("target_service" if name == "gpu" else "gateway")
    assert ("WORKDIR", "/app") in steps  # relative checkpoint paths resolve under the mount
    assert any(k == "USER" and rest != "root" for k, rest in steps)
    copied = [rest.split()[0] for k, rest in steps if k == "COPY"]
    ignore = (ROOT / ".dockerignore").read_text().split()
    for source in copied:
        assert (ROOT / source).exists(), source
        assert f"!{source}" in ignore, f".dockerignore leaves {source} out of the context"
    assert {"tandem", "gateway", "target_service", "draft_service", "kernels"} <= set(copied)
    args = {rest.partition("=")[0]: rest.partition("=")[2] for k, rest in steps if k == "ARG"}
    if name == "cpu":
        # Any base with python3 and venv; docker/base-image.sh makes the default locally.
        assert ("FROM", "${BASE_IMAGE}") in steps
        assert args["BASE_IMAGE"] == "tandem-base:bookworm"
        assert "tandem-base:bookworm" in (ROOT / "docker/base-image.sh").read_text()
        assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    else:
        assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
        assert ("FROM", "${CUDA_IMAGE}") in steps
        assert "/whl/cu" in args["TORCH_INDEX"]
        assert any(k == "RUN" and '"/src[gpu]"' in rest for k, rest in steps)  # triton
