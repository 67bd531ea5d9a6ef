"""The wire contract itself: stubs import, proto conventions hold, checked-in stubs are fresh."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import EnumDescriptor, FileDescriptor

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_NAMES = ["common", "gateway", "target", "draft"]
PROTO_FILES = [f"tandem/v1/{name}.proto" for name in PROTO_NAMES]
GRPC_GENERATED_VERSION = "1.84.0"

# FileDescriptorProto / DescriptorProto / EnumDescriptorProto / ServiceDescriptorProto field
# numbers, the vocabulary of SourceCodeInfo.Location.path.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM, _MSG_ONEOF = 2, 3, 4, 8
_ENUM_VALUE, _SERVICE_METHOD = 2, 2


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"tandem.v1.{name}")


@pytest.mark.parametrize(
    "name", [f"{n}_pb2" for n in PROTO_NAMES] + [f"{n}_pb2_grpc" for n in PROTO_NAMES]
)
def test_stubs_import(name: str) -> None:
    assert _module(name) is not None


def test_files_share_the_package() -> None:
    for name in PROTO_NAMES:
        descriptor: FileDescriptor = _module(f"{name}_pb2").DESCRIPTOR
        assert descriptor.package == "tandem.v1"
        assert descriptor.name == f"tandem/v1/{name}.proto"


def _enums(file: FileDescriptor) -> Iterator[EnumDescriptor]:
    yield from file.enum_types_by_name.values()
    pending = list(file.message_types_by_name.values())
    while pending:
        message = pending.pop()
        yield from message.enum_types
        pending.extend(message.nested_types)


def _upper_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()


def test_enum_zero_values_are_unspecified_and_values_prefixed() -> None:
    enums = [e for n in PROTO_NAMES for e in _enums(_module(f"{n}_pb2").DESCRIPTOR)]
    assert len(enums) >= 5
    for enum in enums:
        prefix = _upper_snake(enum.name) + "_"
        assert enum.values_by_number[0].name == prefix + "UNSPECIFIED", enum.full_name
        for value in enum.values:
            assert value.name.startswith(prefix), value.name


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    out = tmp_path / "descriptors.pb"
    argv = ["protoc", f"-I{PROTO_ROOT}", f"--descriptor_set_out={out}", "--include_source_info"]
    assert protoc.main([*argv, *PROTO_FILES]) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _documentable(
    message: descriptor_pb2.DescriptorProto, path: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], str]]:
    yield path, message.name
    for i, field in enumerate(message.field):
        yield (*path, _MSG_FIELD, i), f"{message.name}.{field.name}"
    for i, oneof in enumerate(message.oneof_decl):
        if not any(f.proto3_optional and f.oneof_index == i for f in message.field):
            yield (*path, _MSG_ONEOF, i), f"{message.name}.{oneof.name}"
    for i, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:  # synthesized for map<,> fields; has no source
            yield from _documentable(nested, (*path, _MSG_NESTED, i))
    for i, enum in enumerate(message.enum_type):
        yield from _documentable_enum(enum, (*path, _MSG_ENUM, i))


def _documentable_enum(
    enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], str]]:
    yield path, enum.name
    for i, value in enumerate(enum.value):
        yield (*path, _ENUM_VALUE, i), value.name


def test_every_element_has_a_leading_comment(tmp_path: Path) -> None:
    files = _descriptor_set(tmp_path).file
    assert sorted(f.name for f in files) == sorted(PROTO_FILES)
    missing: list[str] = []
    checked = 0
    for file in files:
        locations = file.source_code_info.location
        comments = {tuple(loc.path): loc.leading_comments for loc in locations}
        elements: list[tuple[tuple[int, ...], str]] = []
        for i, message in enumerate(file.message_type):
            elements.extend(_documentable(message, (_FILE_MESSAGE, i)))
        for i, enum in enumerate(file.enum_type):
            elements.extend(_documentable_enum(enum, (_FILE_ENUM, i)))
        for i, service in enumerate(file.service):
            elements.append(((_FILE_SERVICE, i), service.name))
            for j, method in enumerate(service.method):
                elements.append(((_FILE_SERVICE, i, _SERVICE_METHOD, j), method.name))
        for path, name in elements:
            checked += 1
            if not comments.get(path, "").strip():
                missing.append(f"{file.name}: {name}")
    assert checked > 200
    assert not missing, "elements without a leading comment:\n" + "\n".join(missing)


def test_services_have_the_designed_shape() -> None:
    expected = {
        ("gateway_pb2", "GatewayService"): {
            "Generate": (False, True),
            "Abort": (False, False),
            "GetModelInfo": (False, False),
            "GetServerInfo": (False, False),
        },
        ("target_pb2", "TargetService"): {"Control": (True, True), "GetInfo": (False, False)},
        ("draft_pb2", "DraftService"): {"Speculate": (True, True), "GetInfo": (False, False)},
    }
    for (module, service_name), methods in expected.items():
        service = _module(module).DESCRIPTOR.services_by_name[service_name]
        shapes = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
        assert shapes == methods, service_name


@pytest.mark.parametrize("name", PROTO_NAMES)
def test_grpc_stubs_carry_the_generator_version(name: str) -> None:
    module = _module(f"{name}_pb2_grpc")
    assert module.GRPC_GENERATED_VERSION == GRPC_GENERATED_VERSION
    source = (REPO_ROOT / "tandem" / "v1" / f"{name}_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{GRPC_GENERATED_VERSION}'" in source


@pytest.mark.e2e
def test_checked_in_stubs_match_the_protos() -> None:
    result = subprocess.run(
        [sys.executable, str(PROTO_ROOT / "generate.py"), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _generate_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("protos_generate", PROTO_ROOT / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_refuses_another_grpcio_tools(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _generate_script()
    monkeypatch.setattr(script.metadata, "version", lambda name: "1.85.1")
    assert script.main(["--check"]) == 2
    assert "grpcio-tools==1.84.0 is required" in capsys.readouterr().err


def test_generate_check_lists_changed_missing_and_stale_stubs(tmp_path: Path) -> None:
    script = _generate_script()
    fresh, checked_in = tmp_path / "fresh", tmp_path / "checked_in"
    fresh.mkdir()
    checked_in.mkdir()
    for name in ("a_pb2.py", "b_pb2.pyi", "c_pb2_grpc.py"):
        (fresh / name).write_text(name)
    (checked_in / "a_pb2.py").write_text("a_pb2.py")  # same
    (checked_in / "b_pb2.pyi").write_text("edited")  # differs; c_pb2_grpc.py is missing
    (checked_in / "old_pb2.py").write_text("")  # stale
    (checked_in / "__init__.py").write_text("")  # not a stub: ignored
    assert script.diff_stubs(fresh, checked_in) == ["b_pb2.pyi", "c_pb2_grpc.py", "old_pb2.py"]


@pytest.mark.e2e
def test_buf_lint_is_clean() -> None:
    buf = shutil.which("buf") or shutil.which("buf", path=str(Path(sys.executable).parent))
    assert buf is not None, "buf is not installed: the dev extra brings it (buf-bin)"
    result = subprocess.run(
        [buf, "lint", "protos"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
