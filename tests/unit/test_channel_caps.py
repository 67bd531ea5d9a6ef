"""Every gRPC channel the services, apps and benchmarks open has finite message caps: each call
of ``insecure_channel``/``secure_channel`` (grpc or grpc.aio) in the shipped code passes
``options`` (``tandem.serving.rpc.channel_options`` or the security module's own), so no
client takes an unbounded message from a peer. An AST pass, like the layout test's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tandem", "gateway", "target_service", "draft_service", "bench")
FACTORIES = {"insecure_channel", "secure_channel"}


def channels_without_options(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "v1" in path.relative_to(root).parts:
                continue  # generated stubs: they only take a channel
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in FACTORIES and not any(k.arg == "options" for k in node.keywords):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_channel_has_finite_caps() -> None:
    assert channels_without_options() == []


def test_the_check_sees_a_channel_without_caps(tmp_path: Path) -> None:
    """The pass finds the calls it looks for (a check that could not fail proves nothing)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        'import grpc\nc = grpc.aio.insecure_channel("x")\n'
        'd = grpc.secure_channel("x", creds, options=o)\n'
    )
    assert channels_without_options(tmp_path, ("pkg",)) == ["pkg/m.py:2"]
