"""``tandem generate`` with a draft: the same ids as without, plus speculation statistics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tests.helpers.cli import run_cli

pytestmark = pytest.mark.e2e  # every test runs the command line in a subprocess

PROMPTS = ["w10 w20 w30 w10 w20", "w4000 w17"]


def generate(target: Path, *extra: str) -> list[dict[str, object]]:
    proc = run_cli(
        "generate",
        "--target",
        str(target),
        "--max-new-tokens",
        "20",
        "--ignore-eos",
        "--json",
        *extra,
        *PROMPTS,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_generate_with_drafts(tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "t", "llama", seed=6, num_hidden_layers=4)
    eagle3 = make_eagle3_checkpoint(tmp_path / "e3", target, draft_vocab_size=1024)
    plain = generate(target)
    assert all(rec["draft_tokens"] == 0 and rec["verify_steps"] == 19 for rec in plain)
    runs = {
        "eagle3": generate(
            target,
            "--draft",
            str(eagle3),
            "--draft-kind",
            "eagle3",
            "--spec-steps",
            "3",
            "--spec-topk",
            "2",
            "--spec-tokens",
            "6",
        ),
        "ngram": generate(target, "--draft-kind", "ngram", "--spec-steps", "2"),
        "perfect": generate(
            target, "--draft", str(target), "--draft-kind", "model", "--spec-steps", "4"
        ),
    }
    for name, recs in runs.items():
        assert [r["token_ids"] for r in recs] == [r["token_ids"] for r in plain], name
        for rec in recs:
            assert {"accept_length", "draft_tokens", "accepted_tokens", "verify_steps"} <= set(rec)
            assert rec["draft_tokens"] > 0, name
    for rec in runs["perfect"]:
        assert rec["accepted_tokens"] == rec["draft_tokens"]
        assert rec["accept_length"] >= 4.0


def test_bad_spec_flags_name_the_field(tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "t", "llama", seed=6)
    proc = run_cli(
        "generate",
        "--target",
        str(target),
        "--draft-kind",
        "ngram",
        "--spec-topk",
        "1",
        "--spec-tokens",
        "9",
        "w5",
    )
    assert proc.returncode == 2 and "num_draft_tokens" in proc.stderr
    proc = run_cli("generate", "--target", str(target), "--draft-kind", "eagle3", "w5")
    assert proc.returncode == 2 and "path" in proc.stderr
