"""``tandem bench`` with trees and real acceptance, on CPU at tiny sizes: ``--spec-topk`` and
``--spec-tokens`` reach every target; trees run in process and through the services with
simulated acceptance (a random tiny pair) and real acceptance (the reference family on its
held-out prompts); every speculating row says which fraction of its decode steps verified a
tree and why the others did not; without ``--preset`` or ``--target`` the command line
benchmarks the reference family on its held-out prompts."""

from __future__ import annotations

import json
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tandem.apps.embedded import family_dir
from tandem.bench import run
from tandem.bench.inprocess import Workload, real_prompts
from tandem.bench.report import Row, table, to_json
from tandem.bench.run import BenchConfig, run_bench
from tandem.spec.types import SpecConfig
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint

FAMILY = family_dir()
TREE = {"spec_steps": 3, "spec_topk": 4, "spec_tokens": 8}  # S=3, K=4, N=8
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    target = make_checkpoint(root / "target", "llama", seed=12, num_hidden_layers=2)
    draft = make_eagle3_checkpoint(root / "eagle3", target, draft_vocab_size=256, seed=2)
    return target, draft


def family_config(modes: tuple[str, ...], **extra: Any) -> BenchConfig:
    prompt_len = 48
    heldout = FAMILY / "prompts" / "heldout.jsonl"
    w = Workload(
        prompt_len=prompt_len,
        new_tokens=NEW_TOKENS,
        warmup_tokens=0,
        rounds=1,
        token_ids=real_prompts(heldout, FAMILY / "target", prompt_len),
    )
    return BenchConfig(
        target=FAMILY / "target",
        draft=FAMILY / "eagle3",
        assistant=None,
        modes=modes,
        batch_sizes=(2,),
        workload=w,
        prompts_from="heldout",
        **{**TREE, **extra},
    )


def tiny_config(tiny: tuple[Path, Path], modes: tuple[str, ...]) -> BenchConfig:
    return BenchConfig(
        target=tiny[0],
        draft=tiny[1],
        assistant=None,
        modes=modes,
        batch_sizes=(2,),
        workload=Workload(prompt_len=10, new_tokens=NEW_TOKENS, warmup_tokens=0, rounds=1),
        simulate_accept_length=3.0,
        **TREE,
    )


def check_speculating(row: Row, *, simulated: bool) -> None:
    assert row.output_tokens == 2 * NEW_TOKENS, row
    assert row.accept_length is not None and row.accept_length > 1.5, row
    assert row.simulated_accept_length == (3.0 if simulated else None)
    assert len(row.acceptance_per_position) == TREE["spec_steps"]
    assert row.tree_fraction is not None and 0.0 < row.tree_fraction <= 1.0, row
    # A step without a tree is counted by its cause; none went uncounted.
    assert (row.tree_fraction < 1.0) == bool(row.without_tree), row


def test_trees_in_process_with_simulated_and_real_acceptance(tiny: tuple[Path, Path]) -> None:
    header, rows = run_bench(tiny_config(tiny, ("spec",)))
    assert header["Speculation S / K / N"] == "S=3 K=4 N=8 (a tree)"
    (row,) = rows
    check_speculating(row, simulated=True)
    assert row.tree_fraction == 1.0  # in process, every decode step drafts (fixed policy)
    header, rows = run_bench(family_config(("spec", "spec-chain")))
    assert header["Prompts"].startswith("heldout: 256,") and "greedy" in header["Prompts"]
    real, chain = rows
    check_speculating(real, simulated=False)
    # The trained pair accepts far more than one draft a step; a random pair would not.
    assert real.accept_length is not None and real.accept_length > 2.5, real
    assert (chain.batch_size, chain.note) == (0, "skipped: needs CUDA graphs")


def test_sampled_requests_through_every_mode(tiny: tuple[Path, Path]) -> None:
    """``--temperature``: every request samples, in process and through the services (chains:
    device-chain runs where they can run); transformers' rows say they are greedy."""
    config = tiny_config(tiny, ("target-only", "spec", "services", "hf"))
    w = replace(config.workload, temperature=0.8)
    config = replace(config, workload=w, spec_steps=3, spec_topk=1, spec_tokens=None)
    header, rows = run_bench(config)
    assert header["Temperature"] == "0.8 (sampled, seeded per request)"
    by_mode = {row.mode: row for row in rows}
    for mode in ("target-only", "spec", "services", "services-control"):
        assert by_mode[mode].output_tokens == 2 * NEW_TOKENS, by_mode[mode]
    assert by_mode["spec"].accept_length is not None and by_mode["spec"].accept_length > 1.5
    assert by_mode["hf-generate"].note == "skipped: transformers' rows are greedy (--temperature 0)"


@pytest.mark.slow
@pytest.mark.e2e
def test_trees_through_the_services_with_simulated_and_real_acceptance(
    tiny: tuple[Path, Path],
) -> None:
    _, rows = run_bench(tiny_config(tiny, ("services",)))
    assert [r.mode for r in rows] == ["services", "services-control"]
    for row in rows:
        check_speculating(row, simulated=True)
    _, rows = run_bench(family_config(("services",)))
    assert [r.mode for r in rows] == ["services", "services-control"]
    for row in rows:  # (tests/e2e/test_acceptance.py holds it to in process's acceptance)
        check_speculating(row, simulated=False)
        assert row.accept_length is not None and row.accept_length > 2.5, row


def test_tree_column_and_causes_in_the_table_and_json() -> None:
    rows = [
        Row(mode="services", batch_size=4, accept_length=3.5, tree_fraction=0.75,
            without_tree={"late": 3, "stale": 1}, simulated_accept_length=3.0),
        Row(mode="spec", batch_size=4, accept_length=3.9, tree_fraction=1.0, note="x"),
        Row(mode="target-only", batch_size=4),
    ]  # fmt: skip
    text = table(rows, {"Speculation S / K / N": "S=5 K=4 N=16 (a tree)"})
    lines = text.splitlines()
    head = next(line for line in lines if line.strip().startswith("mode"))
    assert head.split()[:7] == ["mode", "bs", "tok/s", "accept", "sim", "tree", "acc/pos"]
    services = next(line for line in lines if line.strip().startswith("services"))
    assert " 0.75 " in services and services.endswith("no tree: late 3, stale 1")
    assert next(line for line in lines if line.strip().startswith("spec")).endswith(" x")
    assert "S=5 K=4 N=16" in text
    out = json.loads(json.dumps(to_json(rows, {})))
    assert out["rows"][0]["without_tree"] == {"late": 3, "stale": 1}
    assert out["rows"][0]["tree_fraction"] == 0.75
    # Without simulated acceptance the table has no "sim" column.
    assert " sim " not in table(rows[1:], {})


def test_config_checks_the_tree_shape() -> None:
    w = Workload(prompt_len=8, new_tokens=8, warmup_tokens=0, rounds=1)
    base: dict[str, Any] = {"target": Path("t"), "draft": None, "assistant": None, "workload": w}
    assert BenchConfig(**base, **TREE).spec == SpecConfig(num_steps=3, topk=4, num_draft_tokens=8)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        BenchConfig(**base, spec_steps=3, spec_topk=1, spec_tokens=8)  # a chain has N = S+1
    with pytest.raises(ValueError, match="simulate_accept_length"):
        BenchConfig(**base, **TREE, simulate_accept_length=4.5)
    assert not BenchConfig(**base, **TREE).chain and BenchConfig(**base).chain


def invoke(argv: list[str]) -> Any:
    from typer.testing import CliRunner

    from tandem.apps.cli import app

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return CliRunner().invoke(app, argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class Caught(Exception):
    """Raised in place of the benchmark, once the command line built its config."""


def test_command_line_trees_and_the_reference_family_by_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[BenchConfig] = []

    def record(config: BenchConfig, say: Any) -> None:
        seen.append(config)
        raise Caught

    monkeypatch.setattr(run, "run_bench", record)
    flags = ["--spec-steps", "3", "--spec-steps", "5", "--spec-topk", "4", "--spec-tokens", "16"]
    result = invoke(["bench", "--prompt-len", "32", *flags])  # a repeated flag: the last wins
    assert isinstance(result.exception, Caught), result.output
    config = seen.pop()
    assert config.spec == SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
    assert (config.target, config.draft) == (FAMILY / "target", FAMILY / "eagle3")
    assert config.assistant == FAMILY / "model" and config.dtype == "float32"
    assert config.simulate_accept_length is None  # real acceptance
    prompts = config.workload.token_ids
    assert len(prompts) == 256 and max(len(p) for p in prompts) == 32
    assert config.workload.batch(8192, 2, salt=1) == [list(prompts[2]), list(prompts[3])]
    # Any pair with its own prompts file; none: synthetic ids.
    texts = tmp_path / "p.jsonl"
    texts.write_text(json.dumps({"text": "def f(x):\n    return x"}) + "\n")
    target = FAMILY / "target"
    result = invoke(["bench", "--target", str(target), "--prompts", str(texts)])
    assert isinstance(result.exception, Caught), result.output
    config = seen.pop()
    assert config.draft is None and len(config.workload.token_ids) == 1
    assert config.prompts_from == str(texts)
    result = invoke(["bench", "--target", str(target)])
    assert isinstance(result.exception, Caught), result.output
    assert seen.pop().workload.token_ids == ()
    bad = invoke(["bench", "--spec-topk", "1", "--spec-tokens", "16"])
    assert bad.exit_code == 2 and "num_draft_tokens" in bad.output
