"""The layout rules of docs/design.md, checked over every import of every module (module-level,
``TYPE_CHECKING`` and function-level imports alike): who may import whom, and no import cycles.

Roles: ``kernels`` imports nothing of ours; the shared core of ``tandem/`` (its top-level
modules, ``models``, ``attention``, ``wire``, ``graphs``, ``spec``, ``serving``, ``v1``,
``smg``) imports only the core and the kernels; ``tandem/target``, ``tandem/draft`` and
``tandem/link`` each import the core and themselves, never each other; only ``tandem/apps``,
``tandem/bench`` and ``tandem/testing`` compose them; nothing in ``tandem/`` imports a service;
services never import each other, the target service never imports the draft engine nor the
draft service the target engine, and the gateway neither.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("tandem", "target_service", "draft_service", "gateway", "kernels")
CORE_PACKAGES = ("models", "attention", "wire", "graphs", "spec", "serving", "v1", "smg")

# role -> the roles it may import
ALLOWED: dict[str, set[str]] = {
    "kernels": {"kernels"},
    "core": {"core", "kernels"},
    "target": {"core", "kernels", "target"},
    "draft": {"core", "kernels", "draft"},
    "link": {"core", "kernels", "link"},
    "train": {"core", "kernels", "train", "testing"},
    "testing": {"core", "kernels", "testing", "target", "draft", "link"},
    "apps": {"core", "kernels", "apps", "target", "draft", "link", "bench", "train", "testing"},
    "bench": {"core", "kernels", "bench", "target", "draft", "link", "apps", "testing"},
    "target_service": {"core", "kernels", "target", "link", "target_service"},
    "draft_service": {"core", "kernels", "draft", "link", "draft_service"},
    "gateway": {"core", "gateway"},
}


def role(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "tandem":
        return parts[0]
    if module == "tandem.__main__":  # `python -m tandem`: the command line
        return "apps"
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    if len(parts) > 1 and parts[1] not in CORE_PACKAGES and (ROOT / "tandem" / parts[1]).is_dir():
        raise AssertionError(f"tandem/{parts[1]}/ has no role: add it to this test")
    return "core"


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top in TOP:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """Every module of ours ``module`` imports, anywhere in it, with the line."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in TOP:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if name.split(".")[0] not in TOP:
                continue
            yield name, node.lineno
            for alias in node.names:
                if f"{name}.{alias.name}" in known:
                    yield f"{name}.{alias.name}", node.lineno


def graph() -> dict[str, list[tuple[str, int]]]:
    known = modules()
    return {m: sorted(set(imports(m, p, known))) for m, p in known.items() if "_pb2" not in m}


def test_every_import_follows_the_layout_rules() -> None:
    broken = []
    for module, targets in graph().items():
        mine = role(module)
        for target, line in targets:
            theirs = role(target)
            if theirs not in ALLOWED[mine]:
                broken.append(f"{module}:{line} ({mine}) imports {target} ({theirs})")
    assert not broken, "layout rules broken:\n" + "\n".join(broken)


def test_there_are_no_import_cycles() -> None:
    edges = {m: {t for t, _ in ts if t != m} for m, ts in graph().items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize(
    ("edges", "cyclic"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ],
)
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]], cyclic: bool) -> None:
    assert bool(_cycles(edges)) == cyclic


def test_the_rules_catch_a_forbidden_import() -> None:
    assert role("tandem.target.engine") == "target"
    assert role("tandem.draft.drafter") == "draft"
    assert "draft" not in ALLOWED[role("tandem.target.engine")]
    assert "target_service" not in ALLOWED[role("tandem.kv")]
    assert "core" not in ALLOWED["kernels"]
