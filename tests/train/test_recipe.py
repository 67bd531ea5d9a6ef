"""``bench/train_reference.py --quick`` end to end on a tiny corpus: the family it writes loads
in transformers and in Tandem, Tandem's greedy output equals transformers' on its held-out
prompts, every draft speculates losslessly, and the provenance matches the files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.train.corpus import path_fraction
from tandem.train.prompts import read_prompts
from tests.checkpoints import hf_greedy

pytestmark = pytest.mark.e2e  # the fixture runs bench/train_reference.py as a process

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import email
    import json as json_module

    root = tmp_path_factory.mktemp("recipe")
    for package in (json_module, email):
        assert package.__file__ is not None
        source = Path(package.__file__).parent
        shutil.copytree(
            source, root / "corpus" / source.name, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = root / "family"
    args = ["--quick", "--device", "cpu", "--out", str(out)]
    args += ["--source", str(root / "corpus" / "json"), "--source", str(root / "corpus" / "email")]
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "train_reference.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for expected in ("[corpus]", "[target] step 30/30", "tok/s", "[eagle3] done", "| target |"):
        assert expected in proc.stdout, proc.stdout
    return out


def test_target_loads_in_transformers_and_tandem_greedy_matches(family: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = family / "target"
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    records = read_prompts(family / "prompts" / "heldout.jsonl")
    assert 8 <= len(records) <= 16  # the quick recipe asks for 16; a tiny corpus may hold fewer
    prompts = [tokenizer(p["text"])["input_ids"] for p in records[:8]]
    assert all(p[0] == tokenizer.bos_token_id for p in prompts)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [r.token_ids for r in Engine(EngineConfig(model=target)).generate(prompts, params)]
    assert ours == hf_greedy(target, prompts, NEW_TOKENS)
    for kind, (k, s, n) in {"eagle3": (4, 5, 16), "mtp": (1, 3, 4), "model": (2, 3, 6)}.items():
        config = DraftConfig(kind=kind, path=family / kind, target=target)
        spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
        engine = Engine(EngineConfig(model=target), drafter=build_drafter(config, 4), spec=spec)
        assert [r.token_ids for r in engine.generate(prompts, params)] == ours, kind


def test_provenance_matches_the_files(family: Path) -> None:
    record = json.loads((family / "family.json").read_text())
    corpus = family.parent / "corpus"
    assert record["corpus"]["files"] > 10 and record["corpus"]["heldout_files"] >= 1
    assert set(record["drafts"]) == {"eagle3", "mtp", "model"}
    assert record["target"]["steps"] == 30 and record["target"]["heldout_loss"] > 0
    assert "--target-steps 30" in record["reproduce"]
    for prompt in read_prompts(family / "prompts" / "heldout.jsonl"):
        text = (corpus / prompt["source"]).read_text()
        assert text[prompt["start"] : prompt["end"]] == prompt["text"]
        assert path_fraction(prompt["source"]) < 0.2  # the quick recipe's held-out fraction
    readme = (family / "README.md").read_text()
    assert record["corpus"]["sha256"] in readme and record["reproduce"] in readme
    for kind in ("target", "eagle3", "mtp", "model"):
        assert (family / kind / "training.json").is_file()
    assert record["sizes_mb"]["total"] < 40
