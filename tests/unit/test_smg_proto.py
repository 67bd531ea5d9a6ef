"""The vendored SMG worker protocol (``protos/tandem/smg``): the release's files unchanged
below our header (but for the package-qualified import), its stubs importable, its wire names
the router's."""

from __future__ import annotations

import importlib
from importlib import metadata, resources
from pathlib import Path

import pytest

PROTO_DIR = Path(__file__).resolve().parents[2] / "protos" / "tandem" / "smg"
RELEASE = "0.4.28"
HEADER_LINES = 4


@pytest.mark.parametrize("name", ["common", "sglang_scheduler"])
def test_vendored_file_is_the_release(name: str) -> None:
    assert metadata.version("smg-grpc-proto") == RELEASE  # the pin in pyproject's dev extras
    lines = (PROTO_DIR / f"{name}.proto").read_text().splitlines(keepends=True)
    assert f"smg-grpc-proto {RELEASE}" in lines[0]
    ours = "".join(lines[HEADER_LINES:])
    release = (resources.files("smg_grpc_proto") / "proto" / f"{name}.proto").read_text()
    assert ours == release.replace('import "common.proto";', 'import "tandem/smg/common.proto";')


@pytest.mark.parametrize(
    "module", ["common_pb2", "common_pb2_grpc", "sglang_scheduler_pb2", "sglang_scheduler_pb2_grpc"]
)
def test_stubs_import(module: str) -> None:
    assert importlib.import_module(f"tandem.smg.{module}") is not None


def test_wire_names_are_the_routers() -> None:
    from tandem.smg import sglang_scheduler_pb2

    service = sglang_scheduler_pb2.DESCRIPTOR.services_by_name["SglangScheduler"]
    assert service.full_name == "sglang.grpc.scheduler.SglangScheduler"
    methods = set(service.methods_by_name)
    assert {"Generate", "Abort", "HealthCheck", "GetModelInfo", "GetServerInfo"} <= methods
    assert {"GetLoads", "GetTokenizer", "SubscribeKvEvents"} <= methods
