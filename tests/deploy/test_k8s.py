"""deploy/k8s, checked without a cluster: every object of the GPU kustomization and of its CPU
overlay against the Kubernetes API schemas (kubernetes-validate, strict: an unknown field
fails), every command line against its service's parser, and the wiring between them (probes
on the ports the services listen on, the router on every replica, Services on real ports)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from tests.helpers.commands import parse_command
from tests.helpers.k8s import build, containers

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = "1.33.0"  # the oldest release the manifests promise to run on (gRPC probes: 1.24)
BUILDS = {"gpu": ROOT / "deploy/k8s", "cpu": ROOT / "deploy/k8s/cpu"}
IMAGES = {"tandem:gpu": "Dockerfile.gpu", "tandem:cpu": "Dockerfile.cpu"}
IMAGES["tandem:router"] = "Dockerfile.router"


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def by_name(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in containers(objects)}


@pytest.fixture(params=sorted(BUILDS), scope="module")
def built(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, build(BUILDS[request.param])


def test_every_object_is_valid_kubernetes(built: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = built
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [*["Deployment", "PersistentVolumeClaim"], *["Service"] * 3, "StatefulSet"]
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)  # raises on any error
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tandem"


def test_a_broken_object_is_refused() -> None:
    obj = named(build(BUILDS["gpu"]), "StatefulSet", "tandem")
    obj["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_images_are_built_here(built: tuple[str, list[dict[str, Any]]]) -> None:
    kind, objects = built
    for container in containers(objects):
        assert container["image"] in IMAGES, container["name"]
        assert (ROOT / "docker" / IMAGES[container["image"]]).is_file()
    models = {c["image"] for name, c in by_name(objects).items() if name in ("draft", "target")}
    assert models == {f"tandem:{kind}"}
    gpus = [c["resources"].get("limits", {}).get("nvidia.com/gpu") for c in containers(objects)]
    assert sorted(map(str, gpus)) == (["1", "1", "None", "None"] if kind == "gpu" else ["None"] * 4)


def test_commands_are_accepted_by_their_services(built: tuple[str, list[dict[str, Any]]]) -> None:
    kind, objects = built
    services = by_name(objects)
    names = ("draft", "target", "gateway")
    args = {name: parse_command(services[name]["command"])[1] for name in names}
    assert args["draft"].device == args["target"].device == ("cuda" if kind == "gpu" else "cpu")
    assert args["draft"].host == args["target"].host == "127.0.0.1"  # off the network
    assert args["target"].draft_addr == f"127.0.0.1:{args['draft'].port}"
    assert args["gateway"].target_addr == f"127.0.0.1:{args['target'].port}"
    for name in ("draft", "target"):  # every checkpoint a command names ships here
        for path in re.findall(r"checkpoints/[\w./-]+", " ".join(services[name]["command"])):
            assert (ROOT / path).is_dir(), path


def test_probes_ask_the_ports_the_services_listen_on(
    built: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objects = built
    services = by_name(objects)
    for name in ("draft", "target"):
        port = parse_command(services[name]["command"])[1].port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            module, args = parse_command(services[name][probe]["exec"]["command"])
            assert (module, args.address) == ("tandem.serving.health_probe", f"127.0.0.1:{port}")
    gateway = services["gateway"]
    port = parse_command(gateway["command"])[1].port
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]}["grpc"] == port
    assert gateway["readinessProbe"]["grpc"]["port"] == port
    assert gateway["livenessProbe"]["tcpSocket"]["port"] == port
    metrics = next(e["value"] for e in gateway["env"] if e["name"] == "TANDEM_GATEWAY_METRICS_PORT")
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]}["metrics"] == int(metrics)


def test_the_router_reaches_every_replica(built: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = built
    replicas = named(objects, "StatefulSet", "tandem")["spec"]
    headless = named(objects, "Service", replicas["serviceName"])["spec"]
    assert headless["clusterIP"] == "None"
    gateway = by_name(objects)["gateway"]
    port = parse_command(gateway["command"])[1].smg_port
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]}["smg"] == port
    command = by_name(objects)["router"]["command"]
    assert command[:2] == ["smg", "launch"]
    urls = command[command.index("--worker-urls") + 1 :]
    assert urls == [
        f"grpc://tandem-{i}.{replicas['serviceName']}:{port}" for i in range(replicas["replicas"])
    ]
    smg = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    assert smg, "smg (a dev dependency) is not installed"
    help_text = subprocess.run([smg, "launch", "--help"], capture_output=True, text=True).stdout
    for arg in command[2:]:
        assert not arg.startswith("--") or re.search(rf"\[{arg}[ \]]", help_text), arg


def test_services_select_pods_and_their_ports(built: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = built
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    for workload in workloads:
        spec = workload["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        for volume in spec["template"]["spec"]["volumes"]:
            assert volume["persistentVolumeClaim"]["claimName"] in claims
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        (pod,) = [
            w["spec"]["template"]
            for w in workloads
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, (service["metadata"]["name"], port)
