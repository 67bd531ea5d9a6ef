"""Training data: corpus collection and its path-hash split, the BPE tokenizer, packing into
blocks, seeded batches, held-out prompts and the learning-rate schedule."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tandem.train.blocks import Batches, TokenData, encode, pack, token_data
from tandem.train.corpus import (
    Document,
    collect_python_sources,
    path_fraction,
    read_documents,
    split,
)
from tandem.train.loop import LoopSettings, run
from tandem.train.prompts import cut_prompts
from tandem.train.tokenizer import BOS_ID, CHAT_TEMPLATE, EOS_ID, PAD_ID, train_tokenizer

CODE = '''def add(a, b):
    """Adds."""
    return a + b


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x = x
        self.y = y

    def norm(self) -> float:
        return (self.x ** 2 + self.y ** 2) ** 0.5
'''


def write_tree(root: Path) -> None:
    """A small source tree with everything the collector must skip."""
    files = {
        "pkg/__init__.py": "",  # whitespace only: skipped
        "pkg/core.py": CODE,
        "pkg/util.py": CODE.replace("add", "sub").replace("+", "-"),
        "pkg/z_copy.py": CODE,  # same content: kept once, at its first path
        "pkg/tests/test_core.py": "def test(): pass\n",
        "pkg/__pycache__/core.cpython-311.py": "x = 1\n",
        "pkg/.hidden/secret.py": "x = 2\n",
        "pkg/site-packages/other.py": "x = 3\n",
        "pkg/notes.txt": "not python\n",
        "big.py": "x = 1\n" * 400,
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))


def test_collect_python_sources_skips_and_dedupes(tmp_path: Path) -> None:
    write_tree(tmp_path)
    docs = collect_python_sources({"src": tmp_path}, max_file_bytes=1000)
    assert [d.source for d in docs] == ["src/pkg/core.py", "src/pkg/util.py"]
    assert docs == collect_python_sources({"src": tmp_path}, max_file_bytes=1000)
    assert docs[0].text == CODE
    bigger = collect_python_sources({"src": tmp_path}, max_file_bytes=10_000)
    assert "src/big.py" in [d.source for d in bigger]


def test_split_is_by_path_hash_only() -> None:
    docs = [Document(source=f"root/m{i}.py", text=f"x = {i}\n") for i in range(400)]
    train, heldout = split(docs, 0.1)
    assert len(train) + len(heldout) == 400 and 20 <= len(heldout) <= 60
    assert all(path_fraction(d.source) < 0.1 for d in heldout)
    # A file's side never depends on what else is in the corpus or on its content.
    changed = [Document(source=d.source, text="changed") for d in docs[:50]]
    _, alone = split(changed, 0.1)
    assert {d.source for d in alone} == {d.source for d in heldout} & {d.source for d in changed}
    # Two documents: neither side is empty.
    tr, ho = split(docs[:2], 0.001)
    assert len(tr) == len(ho) == 1


def test_read_documents_files_dirs_and_jsonl(tmp_path: Path) -> None:
    write_tree(tmp_path / "tree")
    lines = [{"text": "print(1)\n"}, {"token_ids": [5, 6, 7]}]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    docs = read_documents([tmp_path / "tree" / "pkg", tmp_path / "data.jsonl"])
    sources = [Path(d.source).name for d in docs]
    assert "notes.txt" in sources and "core.py" in sources and "test_core.py" in sources
    assert docs[-2].text == "print(1)\n" and docs[-1].token_ids == (5, 6, 7)
    (tmp_path / "bad.jsonl").write_text('{"words": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_documents([tmp_path / "bad.jsonl"])
    with pytest.raises(ValueError, match="not a file"):
        read_documents([tmp_path / "missing"])


def corpus_texts() -> list[str]:
    return [CODE.replace("add", f"add{i}").replace("Point", f"P{i}") for i in range(30)]


def test_tokenizer_is_deterministic_and_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    first = train_tokenizer(corpus_texts(), vocab_size=400)
    second = train_tokenizer(corpus_texts(), vocab_size=400)
    first.save_pretrained(tmp_path / "a")
    second.save_pretrained(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_text()
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tok.is_fast and 259 < len(tok) <= 400  # at most the requested size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    for text in (CODE, "x  =  'é ☃'\n\t\n", " leading space"):
        ids = tok(text)["input_ids"]
        assert ids[0] == BOS_ID
        assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: exact
    assert len(tok(CODE)["input_ids"]) < len(CODE) / 2  # merges learned from the corpus
    # The chat template travels as chat_template.jinja, as shipped with the reference family.
    assert (tmp_path / "a" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    shipped = Path(__file__).resolve().parents[2] / "checkpoints" / "tandem-code-ref"
    for kind in ("target", "model"):
        assert (shipped / kind / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "def f():"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<s>### user\ndef f():\n### assistant\n"


def test_encode_and_pack_blocks() -> None:
    tok = train_tokenizer(corpus_texts(), vocab_size=400)
    docs = [Document(source=f"d{i}", text=t) for i, t in enumerate(corpus_texts()[:6])]
    docs.append(Document(source="ids", token_ids=(9, 10, 11)))
    ids = encode(docs, tok)
    assert ids[-1].tolist() == [BOS_ID, 9, 10, 11, EOS_ID]
    assert all(t[0] == BOS_ID and t[-1] == EOS_ID for t in ids)
    blocks = pack(docs, ids, 16)
    total = sum(t.numel() for t in ids)
    assert blocks.shape == (total // 16, 16)
    order = sorted(range(len(docs)), key=lambda i: path_fraction(docs[i].source))
    assert torch.equal(blocks.flatten(), torch.cat([ids[i] for i in order])[: blocks.numel()])
    data = token_data(docs[:5], docs[5:], tok, 16)
    assert data.seq_len == 16 and data.heldout.shape[0] >= 1
    assert data.with_seq_len(8).train.shape == (2 * data.train.shape[0], 8)
    assert data.with_seq_len(5).train.shape == (data.train.shape[0], 5)
    with pytest.raises(ValueError, match="train"):
        TokenData(torch.zeros(0, 16, dtype=torch.int64), data.heldout)


def test_batches_cover_each_epoch_once_and_are_seeded() -> None:
    batches = Batches([10, 3], [4, 2], seed=7)
    firsts, seconds = [], []
    for _ in range(5):
        a, b = batches.next()
        assert a.numel() == 4 and b.numel() == 2
        firsts += a.tolist()
        seconds += b.tolist()
    assert sorted(firsts[:10]) == list(range(10)) and sorted(firsts[10:20]) == list(range(10))
    assert sorted(seconds[:3]) == [0, 1, 2] and sorted(seconds[3:6]) == [0, 1, 2]
    again = Batches([10, 3], [4, 2], seed=7)
    assert [t.tolist() for t in again.next()] == [firsts[:4], seconds[:2]]
    assert Batches([10, 3], [4, 2], seed=8).next()[0].tolist() != firsts[:4]


def test_prompts_are_whole_lines_of_their_files() -> None:
    tok = train_tokenizer(corpus_texts(), vocab_size=400)
    docs = [Document(source=f"src/m{i}.py", text=t * 3) for i, t in enumerate(corpus_texts())]
    prompts = cut_prompts(docs, tok, 40, seed=1, chars=(100, 200), max_tokens=200)
    assert len(prompts) == 40
    assert prompts == cut_prompts(docs, tok, 40, seed=1, chars=(100, 200), max_tokens=200)
    by_source = {d.source: d for d in docs}
    spans: dict[str, list[tuple[int, int]]] = {}
    for i, p in enumerate(prompts):
        doc = by_source[p["source"]]
        assert p["id"] == i and p["file_sha256"] == doc.sha256
        assert doc.text[p["start"] : p["end"]] == p["text"] and len(p["text"]) >= 50
        assert p["start"] == 0 or doc.text[p["start"] - 1] == "\n"
        assert p["num_tokens"] == len(tok(p["text"])["input_ids"])
        for a, b in spans.get(p["source"], []):
            assert p["end"] <= a or p["start"] >= b
        spans.setdefault(p["source"], []).append((p["start"], p["end"]))


def test_learning_rate_schedule() -> None:
    s = LoopSettings(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert s.lr_at(0, s.progress(0)) == pytest.approx(0.1)
    assert s.lr_at(9, s.progress(9)) == pytest.approx(1.0)
    assert s.lr_at(10, s.progress(10)) == pytest.approx(1.0)
    assert s.lr_at(55, s.progress(55)) == pytest.approx(0.55)
    assert s.lr_at(100, s.progress(100)) == pytest.approx(0.1)
    assert s.lr_at(50, 2.0) == pytest.approx(0.1)  # a budgeted run past its time
    with pytest.raises(ValueError, match="steps"):
        LoopSettings(steps=0, lr=1.0)


def test_time_budget_stops_the_loop() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    lines: list[str] = []

    def step() -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        time.sleep(0.02)
        return (weight**2).sum(), 3, {"norm": weight.detach().norm()}

    budget = LoopSettings(steps=10_000, lr=0.1, warmup_steps=2, max_seconds=0.5, log_every=5)
    result = run("toy", [weight], step, budget, log=lines.append)
    assert 5 <= result.steps <= 30 and result.seconds < 1.0
    assert result.tokens == 3 * result.steps and result.final_loss < 3.0
    assert "norm" in result.metrics and any("left" in line for line in lines)
    fixed = run("toy", [weight], step, LoopSettings(steps=7, lr=0.1, log_every=5), log=lines.append)
    assert fixed.steps == 7 and "[toy] step 7/7" in lines[-1]
