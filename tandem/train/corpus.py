"""Training documents and their deterministic train / held-out split.

The default corpus is every ``*.py`` file under the running interpreter's standard library and
installed packages (``sysconfig`` paths ``stdlib``, ``purelib``, ``platlib``). Directories
named ``test``/``tests``/``testing`` are skipped (the stdlib's test suite is a third of it and
full of deliberately odd source), as are ``__pycache__``, hidden directories and, inside the
stdlib, a nested ``site-packages``/``dist-packages`` (those belong to another root or to
another interpreter). Files must decode as UTF-8, hold more than whitespace and stay under
``max_file_bytes`` (generated tables are skipped). Identical contents are kept once, at their
first source in root order, so no text is both trained on and held out.

A document's ``source`` is ``<root label>/<path relative to the root>``; the split hashes it
(sha256), so a file lands on the same side on every machine whatever else is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

SKIP_DIRS = frozenset({"test", "tests", "testing", "__pycache__"})
NESTED_ROOTS = frozenset({"site-packages", "dist-packages"})
MAX_FILE_BYTES = 1 << 20
TEXT_SUFFIXES = (".py", ".txt")


@dataclass(frozen=True, kw_only=True)
class Document:
    """One training document: text, or already tokenized ids (a ``.jsonl`` with token_ids)."""

    source: str  # what the split hashes: "<root label>/<relative path>", "file", "file:line"
    text: str = ""
    token_ids: tuple[int, ...] | None = None

    @cached_property
    def sha256(self) -> str:
        data = self.text.encode() if self.token_ids is None else json.dumps(self.token_ids).encode()
        return hashlib.sha256(data).hexdigest()


def path_fraction(source: str) -> float:
    """Where ``source`` falls in [0, 1): the first 8 bytes of its sha256."""
    digest = hashlib.sha256(source.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split(
    docs: Sequence[Document], heldout_fraction: float
) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by path hash. With two or more documents neither side is empty: the
    document with the smallest hash is held out if none is, the largest trained on."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction: must be in [0, 1), got {heldout_fraction}")
    train = [d for d in docs if path_fraction(d.source) >= heldout_fraction]
    heldout = [d for d in docs if path_fraction(d.source) < heldout_fraction]
    if len(docs) >= 2 and heldout_fraction > 0 and not heldout:
        first = min(train, key=lambda d: path_fraction(d.source))
        train.remove(first)
        heldout.append(first)
    if len(docs) >= 2 and not train:
        last = max(heldout, key=lambda d: path_fraction(d.source))
        heldout.remove(last)
        train.append(last)
    return train, heldout


def python_roots() -> dict[str, Path]:
    """This interpreter's source roots, labelled by their sysconfig key (duplicates dropped)."""
    paths = sysconfig.get_paths()
    roots: dict[str, Path] = {}
    for key in ("stdlib", "purelib", "platlib"):
        path = Path(paths[key]).resolve()
        if path.is_dir() and path not in roots.values():
            roots[key] = path
    return roots


def collect_python_sources(
    roots: Mapping[str, Path] | None = None, *, max_file_bytes: int = MAX_FILE_BYTES
) -> list[Document]:
    """Every usable ``*.py`` under ``roots`` (default :func:`python_roots`), in root order then
    sorted path order, duplicates of content dropped."""
    roots = python_roots() if roots is None else roots
    docs: list[Document] = []
    seen: set[str] = set()
    for label, root in roots.items():
        for path in _walk(Path(root), (".py",), skip_tests=True):
            text = _read_text(path, max_file_bytes)
            if text is None:
                continue
            doc = Document(source=f"{label}/{path.relative_to(root).as_posix()}", text=text)
            if doc.sha256 not in seen:
                seen.add(doc.sha256)
                docs.append(doc)
    return docs


def read_documents(
    paths: Sequence[Path], *, max_file_bytes: int = MAX_FILE_BYTES
) -> list[Document]:
    """Documents from ``--data``: ``.py``/``.txt`` files, directories of them (walked, sorted),
    or ``.jsonl`` files whose lines are ``{"text": ...}`` or ``{"token_ids": [...]}``."""
    docs: list[Document] = []
    for path in paths:
        if path.is_dir():
            for file in _walk(path, TEXT_SUFFIXES, skip_tests=False):
                text = _read_text(file, max_file_bytes)
                if text is not None:
                    docs.append(Document(source=file.as_posix(), text=text))
        elif path.suffix == ".jsonl":
            docs.extend(_read_jsonl(path))
        elif path.is_file():
            text = _read_text(path, max_file_bytes=None)
            if text is not None:
                docs.append(Document(source=path.as_posix(), text=text))
        else:
            raise ValueError(f"data: {path} is not a file or directory")
    return docs


def manifest(docs: Sequence[Document], heldout: Sequence[Document]) -> dict[str, Any]:
    """What the corpus was: interpreter, counts and one sha256 over every (source, content)."""
    digest = hashlib.sha256()
    for doc in sorted(docs, key=lambda d: d.source):
        digest.update(f"{doc.source}\t{doc.sha256}\n".encode())
    held = {d.source for d in heldout}
    return {
        "python": sys.version.split()[0],
        "implementation": sys.implementation.name,
        "files": len(docs),
        "bytes": sum(len(d.text.encode()) for d in docs),
        "heldout_files": sum(d.source in held for d in docs),
        "sha256": digest.hexdigest(),
    }


def _walk(root: Path, suffixes: tuple[str, ...], *, skip_tests: bool) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".")
            and d != "__pycache__"
            and not (skip_tests and d in SKIP_DIRS)
            and not (skip_tests and d in NESTED_ROOTS)
        )
        for name in sorted(filenames):
            if name.endswith(suffixes):
                yield here / name


def _read_text(path: Path, max_file_bytes: int | None) -> str | None:
    """The file's text, or None when it is too big, empty, not UTF-8 or unreadable."""
    try:
        if not path.is_file() or (
            max_file_bytes is not None and path.stat().st_size > max_file_bytes
        ):
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path.as_posix()}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"data: {where}: {exc}") from exc
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                docs.append(Document(source=where, text=record["text"]))
            elif isinstance(record, dict) and isinstance(record.get("token_ids"), list):
                ids = tuple(int(i) for i in record["token_ids"])
                docs.append(Document(source=where, token_ids=ids))
            else:
                raise ValueError(
                    f'data: {where}: expected {{"text": str}} or {{"token_ids": [int]}}'
                )
    return docs
