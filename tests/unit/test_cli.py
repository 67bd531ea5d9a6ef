"""``tandem generate`` as a user runs it: a real subprocess on a checkpoint written by
transformers, compared with transformers' greedy generate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoints import load_hf, make_checkpoint
from tests.helpers.cli import run_cli

pytestmark = pytest.mark.e2e  # every test runs the command line in a subprocess


# Past EOS by ignoring it, or by min_tokens (transformers' min_new_tokens, as the reference).
@pytest.mark.parametrize("past_eos", [["--ignore-eos"], ["--min-tokens", "24"]])
def test_generate_json_equals_transformers_greedy(tmp_path: Path, past_eos: list[str]) -> None:
    from transformers import AutoTokenizer

    path = make_checkpoint(tmp_path / "ckpt", "qwen3", seed=4)
    prompts = ["w10 w20 w30", "w4000 w17", "w5", "w123 w456 w789 w1011 w1213 w1415 w1617"]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts[1:]))
    proc = run_cli(
        "generate",
        "--target",
        str(path),
        "--max-new-tokens",
        "24",
        *past_eos,
        "--page-size",
        "16",
        "--json",
        prompts[0],
        f"@{tmp_path / 'prompts.json'}",
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [rec["prompt"] for rec in lines] == prompts

    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = load_hf(path)
    for rec in lines:
        ids = tokenizer(rec["prompt"], return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=24,
                min_new_tokens=24,
                pad_token_id=0,
            )
        expected = out[0, ids.shape[1] :].tolist()
        assert rec["token_ids"] == expected
        assert rec["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert rec["finish_reason"] == "length"
        assert rec["completion_tokens"] == 24


def test_generate_reports_bad_input_clearly(tmp_path: Path) -> None:
    missing = run_cli("generate", "--target", str(tmp_path / "nope"), "hello")
    assert missing.returncode != 0
    assert "config.json" in missing.stderr
    bad_file = tmp_path / "p.json"
    bad_file.write_text('{"not": "a list"}')
    proc = run_cli("generate", "--target", str(tmp_path), f"@{bad_file}")
    assert proc.returncode != 0
    assert "JSON list of strings" in proc.stderr
    path = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=True)
    proc = run_cli("generate", "--target", str(path), "--temperature", "-1", "w5")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr
    proc = run_cli("generate", "--target", str(path), "--presence-penalty", "3", "w5")
    assert proc.returncode == 2
    assert "presence_penalty" in proc.stderr
