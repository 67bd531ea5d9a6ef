"""``tandem train-draft`` on a tiny random target: every kind trains (its held-out loss against
the target falls), saves in the format its kind's loader reads, and speculates losslessly
(greedy output == target-only == transformers); the command as a real subprocess; and the
training-time-test unroll computes what the runtime computes when it drafts a chain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.attention import AttentionMetadata, TorchAttention
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import ForwardContext
from tandem.models.draft import DraftModule
from tandem.models.draft_loader import load_eagle3, load_mtp
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.testing.random_drafts import make_eagle3_checkpoint, make_mtp_checkpoint
from tandem.train.blocks import TokenData
from tandem.train.draft import DraftSettings, train_draft
from tandem.train.features import FrozenTarget, generate_sequences
from tandem.train.loop import LoopSettings
from tandem.train.standalone import StandaloneShape
from tandem.train.ttt import unroll
from tests.checkpoints import hf_greedy, make_checkpoint

VOCAB = 1999
LAYERS = 4
NEW_TOKENS = 24
PROMPTS = [[1, 17, 400, 33, 9], [1, 1500], [1, *range(100, 130)]]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train_target")
    return make_checkpoint(
        root / "target", "llama", seed=11, vocab_size=VOCAB, num_hidden_layers=LAYERS
    )


@pytest.fixture(scope="module")
def reference(target: Path) -> list[list[int]]:
    """Target-only greedy output, checked against transformers once."""
    engine = Engine(EngineConfig(model=target))
    ours = [r.token_ids for r in engine.generate(PROMPTS, greedy())]
    assert ours == hf_greedy(target, PROMPTS, NEW_TOKENS)
    return ours


@pytest.fixture(scope="module")
def data(target: Path) -> TokenData:
    gen = torch.Generator().manual_seed(0)
    train = torch.randint(3, VOCAB, (32, 40), generator=gen)
    heldout = torch.randint(3, VOCAB, (4, 40), generator=gen)
    generated = generate_sequences(
        FrozenTarget(target, torch.device("cpu")), train, 4, 8, batch_size=4, seed=0, log=print
    )
    assert torch.equal(generated[:, :8], train[generated_rows(train, generated)][:, :8])
    return TokenData(train, heldout, generated)


def generated_rows(train: torch.Tensor, generated: torch.Tensor) -> list[int]:
    """The training block each generated sequence's prompt was cut from."""
    return [
        next(i for i in range(train.shape[0]) if torch.equal(train[i, :8], g[:8]))
        for g in generated
    ]


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


def speculate(target: Path, draft: Path, kind: str, k: int, s: int, n: int) -> list[list[int]]:
    config = DraftConfig(kind=kind, path=draft, target=target, mtp_mode="chain", num_pages=256)
    spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
    engine = Engine(EngineConfig(model=target), drafter=build_drafter(config, LAYERS), spec=spec)
    results = engine.generate(PROMPTS, greedy())
    assert sum(r.stats.draft_tokens for r in results) > 0
    return [r.token_ids for r in results]


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp", "model"])
def test_train_draft_learns_loads_and_is_lossless(
    target: Path, reference: list[list[int]], data: TokenData, tmp_path: Path, kind: str
) -> None:
    settings = DraftSettings(
        kind=kind,
        loop=LoopSettings(steps=12, lr=5e-3, warmup_steps=2, log_every=6),
        batch_size=4,
        ttt_steps=3,
        draft_vocab_size=512,
        model_shape=StandaloneShape(num_layers=1),
        eval_blocks=4,
    )
    lines: list[str] = []
    record = train_draft(
        target, tmp_path / kind, data, settings, torch.device("cpu"), log=lines.append
    )
    assert record["steps"] == 12 and record["data"]["generated_sequences"] == 4
    assert record["heldout"]["loss"] < record["heldout_before"]["loss"], record
    assert json.loads((tmp_path / kind / "training.json").read_text()) == json.loads(
        json.dumps(record)
    )
    assert any(f"[{kind}] step 12/12" in line and "tok/s" in line for line in lines), lines
    assert any("held-out" in line for line in lines)
    assert speculate(target, tmp_path / kind, kind, 2, 3, 6) == reference
    if kind == "eagle3":
        head = load_eagle3(tmp_path / kind, target)
        assert int(head.t2d.sum()) == 512 and head.aux_layer_ids == (1, 2, 4)
        used = torch.arange(512) + head.d2t
        assert bool((used[1:] > used[:-1]).all()) and bool(head.t2d[used].all())


@pytest.mark.e2e
def test_train_draft_command(target: Path, reference: list[list[int]], tmp_path: Path) -> None:
    words = torch.randint(3, VOCAB, (24, 50), generator=torch.Generator().manual_seed(3))
    lines = [json.dumps({"text": " ".join(f"w{i}" for i in row.tolist())}) for row in words]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "mtp"
    args = [
        *("--target", str(target), "--kind", "mtp", "--out", str(out)),
        *("--data", str(tmp_path / "data.jsonl"), "--steps", "6", "--batch-size", "2"),
        *("--seq-len", "24", "--device", "cpu", "--log-every", "3", "--generate", "2"),
        *(
            "--num-heads",
            "2",
            "--ttt-steps",
            "3",
            "--heldout-fraction",
            "0.3",
            "--dtype",
            "bfloat16",
        ),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "tandem", "train-draft", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[mtp] step 6/6" in proc.stdout and "tok/s" in proc.stdout, proc.stdout
    record = json.loads((out / "training.json").read_text())
    assert record["settings"]["save_dtype"] == "bfloat16" and record["data"]["heldout_blocks"] > 0
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    assert len(load_mtp(out, target)) == 2
    assert speculate(target, out, "mtp", 1, 3, 4) == reference
    from typer.testing import CliRunner

    from tandem.apps.cli import app

    bad = CliRunner().invoke(app, ["train-draft", *args[:2], "--kind", "medusa", "--out", "x"])
    assert bad.exit_code == 2 and "medusa" in bad.output


# --- the training-time test unrolls what the runtime drafts ------------------------------------


def run_pairs(
    module: DraftModule,
    kv: KVCache,
    tokens: list[int],
    hidden: torch.Tensor,  # [n, H]
    positions: list[int],
) -> torch.Tensor:  # [n, H]
    """Appends pairs to request "r"'s KV, causally: how a chain's drafted pairs attend."""
    alloc = kv.allocator
    if "r" not in alloc:
        alloc.allocate("r", 0)
    start = alloc.num_tokens("r")
    alloc.extend("r", len(tokens))
    end = start + len(tokens)
    meta = AttentionMetadata.build(
        page_size=alloc.page_size,
        query_lens=[len(tokens)],
        seq_lens=[end],
        page_table=alloc.page_table(["r"]),
        slot_mapping=kv.slot_mapping_tensor(["r"], [start], [end]),
    )
    ctx = ForwardContext(kv=kv, meta=meta, backend=TorchAttention())
    return module(torch.tensor(tokens), hidden, torch.tensor(positions), ctx)


@pytest.mark.parametrize("kind", ["eagle3", "mtp-head-1"])
def test_unroll_equals_runtime_chain_drafting(target: Path, tmp_path: Path, kind: str) -> None:
    if kind == "eagle3":
        module: DraftModule = load_eagle3(make_eagle3_checkpoint(tmp_path / "d", target), target)
    else:
        module = load_mtp(make_mtp_checkpoint(tmp_path / "d", target, num_heads=2), target)[1]
    gen = torch.Generator().manual_seed(1)
    n, steps, s = 12, 3, module.shift
    tokens = torch.randint(3, VOCAB, (2, n), generator=gen)
    hidden0 = torch.randn(2, n, module.hidden_size, generator=gen)
    with torch.no_grad():
        outs = unroll(module, hidden0, tokens, steps)
        for b in range(2):
            for i in (0, 4, n - 1 - s - steps):
                kv = KVCache(
                    KVCacheSpec(
                        num_layers=1,
                        num_kv_heads=module.num_kv_heads,
                        head_dim=module.head_dim,
                        page_size=4,
                        dtype=torch.float32,
                    ),
                    16,
                )
                # Committed pairs 0..i (step 0), then the chain: step k at position i + k.
                seq = tokens[b].tolist()
                out = run_pairs(
                    module, kv, seq[s : s + i + 1], hidden0[b, : i + 1], list(range(i + 1))
                )
                torch.testing.assert_close(out, outs[0][b, : i + 1], rtol=1e-5, atol=1e-5)
                last = out[-1:]
                for k in range(1, steps):
                    last = run_pairs(module, kv, [seq[i + s + k]], last, [i + k])
                    torch.testing.assert_close(last[0], outs[k][b, i], rtol=1e-5, atol=1e-5)


def test_training_is_deterministic(target: Path, data: TokenData, tmp_path: Path) -> None:
    from tandem.train.target import TargetSettings, train_target

    settings = DraftSettings(
        kind="eagle3",
        loop=LoopSettings(steps=3, lr=5e-3, warmup_steps=1),
        batch_size=2,
        ttt_steps=2,
        draft_vocab_size=300,
        eval_blocks=1,
    )
    for name in ("a", "b"):
        train_draft(target, tmp_path / name, data, settings, torch.device("cpu"), log=print)
    first, second = ((tmp_path / n / "model.safetensors").read_bytes() for n in ("a", "b"))
    assert first == second
    tiny = TargetSettings(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        batch_size=2,
        loop=LoopSettings(steps=3, lr=1e-2, warmup_steps=1),
        eval_blocks=1,
    )
    runs = [train_target(data, tiny, torch.device("cpu"), log=print) for _ in range(2)]
    assert runs[0].heldout_loss == runs[1].heldout_loss
    for (name, a), b in zip(
        runs[0].model.state_dict().items(), runs[1].model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
