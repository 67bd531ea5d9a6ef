"""The shipped reference family (``checkpoints/tandem-code-ref``, checked in): sizes,
loading in transformers and in Tandem, Tandem's greedy output == transformers' on the held-out
prompts, and lossless speculation with each shipped draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.models.config import ModelConfig
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.train.prompts import read_prompts
from tests.checkpoints import hf_greedy

FAMILY = Path(__file__).resolve().parents[2] / "checkpoints" / "tandem-code-ref"
NUM_PROMPTS = 16  # the first held-out prompts (bench/accept_table.py checks 64 x 128 tokens)
NEW_TOKENS = 32


def test_family_is_complete_and_small() -> None:
    family = json.loads((FAMILY / "family.json").read_text())
    assert family["recipe"] == "full"
    total = sum(f.stat().st_size for f in FAMILY.rglob("*") if f.is_file())
    assert total < 40e6, total
    assert 5e6 <= family["target"]["parameters"] <= 15e6
    for kind in ("target", "eagle3", "mtp", "model"):
        assert (FAMILY / kind / "config.json").is_file()
        assert (FAMILY / kind / "training.json").is_file()
    assert json.loads((FAMILY / "mtp" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    assert len(read_prompts(FAMILY / "prompts" / "heldout.jsonl")) >= 200


def test_greedy_equals_transformers_and_drafts_are_lossless() -> None:
    from transformers import AutoTokenizer

    target = FAMILY / "target"
    tokenizer = AutoTokenizer.from_pretrained(target)
    records = read_prompts(FAMILY / "prompts" / "heldout.jsonl")[:NUM_PROMPTS]
    prompts = [tokenizer(r["text"])["input_ids"] for r in records]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    config = EngineConfig(model=target, max_num_seqs=NUM_PROMPTS)
    ours = [r.token_ids for r in Engine(config).generate(prompts, params)]
    assert ours == hf_greedy(target, prompts, NEW_TOKENS)
    layers = ModelConfig.from_pretrained(target).num_layers
    for kind in ("eagle3", "mtp", "model"):
        draft = DraftConfig(kind=kind, path=FAMILY / kind, target=target)
        spec = SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
        engine = Engine(config, drafter=build_drafter(draft, layers), spec=spec)
        results = engine.generate(prompts, params)
        assert [r.token_ids for r in results] == ours, kind
        assert sum(r.stats.accepted_tokens for r in results) > 0, kind


@pytest.mark.e2e
def test_generate_defaults_to_the_embedded_family() -> None:
    """No --target: `tandem generate` serves the shipped target with its EAGLE-3 head, and the
    output equals the target alone."""
    import subprocess
    import sys

    def run(*extra: str) -> dict[str, object]:
        proc = subprocess.run(
            [sys.executable, "-m", "tandem", "generate", "--json", "--max-new-tokens", "24",
             "--ignore-eos", *extra, "def add(a, b):"],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        assert "embedded reference model" in proc.stderr or extra
        line: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
        return line

    default = run()
    alone = run("--target", str(FAMILY / "target"))
    assert default["token_ids"] == alone["token_ids"]
    assert int(default["draft_tokens"]) > 0 and int(default["accepted_tokens"]) > 0  # type: ignore[call-overload]
    assert alone["draft_tokens"] == 0
