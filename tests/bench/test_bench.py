"""``tandem bench`` at tiny sizes on CPU: every mode runs, the JSON parses, the plots are PNGs,
simulated acceptance reaches the engine in process and through the services, ``--profile-idle``
gives the services rows an idle fraction (of CPU ops on CPU) from both services; the preset
writer's checkpoints load in Tandem and transformers; the speed-of-light byte count matches
the real model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.bench.models import PRESETS, llama_config, llama_tensors, write_llama, write_preset
from tandem.bench.presets import specforge_aux_layers
from tandem.bench.report import Row, ratios, table
from tandem.bench.sol import weight_bytes
from tandem.models import load_model
from tandem.models.config import ModelConfig

S = 3


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_smoke(tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    cmd = [
        sys.executable, "-m", "tandem", "bench", "--preset", "tiny",
        "--models-dir", str(tmp_path / "models"), "--batch-sizes", "1,2",
        "--prompt-len", "12", "--new-tokens", "12", "--warmup-tokens", "3",
        "--modes", "target-only,spec,services,services-plain,hf",
        "--spec-steps", str(S), "--simulate-accept-length", "3.0",
        "--json", "--plot", str(plots), "--profile-idle", "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert "Tandem Benchmark Result" in done.stderr  # the table goes to stderr with --json
    rows = {(r["mode"], r["batch_size"]): r for r in result["rows"]}
    measured = [
        "target-only", "spec", "services", "services-control", "services-plain", "hf-generate"
    ]  # fmt: skip
    for mode in measured:
        for bs in (1, 2):
            row = rows[(mode, bs)]
            assert row["tokens_per_s"] > 0 and row["output_tokens"] == 12 * bs, row
            assert row["tpot_p50_ms"] > 0 and row["t_verify_min_ms"] > 0
    assert rows[("hf-assisted", 1)]["tokens_per_s"] > 0
    assert "bs=1 only" in rows[("hf-assisted", 2)]["note"]
    for mode in ("spec", "services", "services-control"):
        for bs in (1, 2):
            # A random head alone accepts ~nothing; the simulated mean is 3.
            assert rows[(mode, bs)]["accept_length"] > 1.5, (mode, bs)
    for mode in ("spec", "services", "services-control"):  # services: the target's step log
        row = rows[(mode, 1)]
        assert len(row["acceptance_per_position"]) == S
        assert row["cycle_ms"] >= row["verify_ms"] > 0 and row["draft_ms"] > 0
        assert row["wire_host_ms"] > 0
    for bs in (1, 2):
        steps = (tmp_path / "logs" / f"steps-bs{bs}-gateway.jsonl").read_text().splitlines()
        # The measured round's steps only (not the warm-up's 3 tokens a request): 12 tokens a
        # request, the first from its prefill (a step of its own unless it joined a decode).
        committed = sum(json.loads(line)["numCommittedTokens"] for line in steps)
        assert 11 * bs <= committed <= 12 * bs, steps
    for bs in (1, 2):  # requests that opted out of speculation: no draft work
        assert rows[("services-plain", bs)]["accept_length"] == 1.0
        assert rows[("services-plain", bs)]["draft_ms"] == 0.0
        assert rows[("services-plain", bs)]["tree_fraction"] == 0.0
        assert set(rows[("services-plain", bs)]["without_tree"]) == {"opted_out"}
        for mode in ("spec", "services", "services-control"):
            assert 0.0 < rows[(mode, bs)]["tree_fraction"] <= 1.0, (mode, bs)
    # The draft's own step log: every step it answered, with where its time went.
    drafted = [json.loads(line) for line in (tmp_path / "logs" / "draft-steps.jsonl").open()]
    drafted = [s for s in drafted if s["requests"]]  # (the hello's step drafts nothing)
    assert drafted and all(s["totalNs"] >= s["stepNs"] >= s["modelNs"] > 0 for s in drafted)
    assert sum(s["outcomes"] for s in drafted) > 0 and sum(s["admits"] for s in drafted) > 0
    assert rows[("target-only", 1)]["draft_ms"] is None
    assert "perf only" in result["settings"]["Simulated accept length"]
    for mode in ("services", "services-control"):
        for bs in (1, 2):
            row = rows[(mode, bs)]
            (fraction,) = row["idle_per_device"]  # one device: the CPU
            assert 0.0 <= fraction < 1.0 and row["gpu_idle"]["timeline"] == "cpu_ops", row
            assert {p.split("-")[0] for p in row["gpu_idle"]["processes"]} == {"target", "draft"}
            assert (
                len(list((tmp_path / "logs" / "profiles" / f"bs{bs}-{mode}").glob("*.json"))) == 2
            )
    assert rows[("spec", 1)]["idle_per_device"] == []
    assert "steps" in result["settings"]["GPU idle profile"]
    for name in ("throughput.png", "acceptance.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_preset_checkpoints_load(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    paths = write_preset(PRESETS["tiny"], tmp_path / "tiny")
    ours = load_model(paths.target)
    hf = AutoModelForCausalLM.from_pretrained(paths.target)
    ids = torch.tensor([[5, 17, 300, 999]])
    with torch.no_grad():
        expected = hf(ids).logits[0, -1]
    assert torch.isfinite(expected).all()
    assert ours.config.vocab_size == 1000 and ours.config.num_layers == 4
    assert AutoModelForCausalLM.from_pretrained(paths.assistant).config.vocab_size == 1000
    raw = json.loads((paths.draft / "config.json").read_text())
    assert raw["draft_vocab_size"] == 256
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    # A second call reuses what is there.
    stamp = (paths.target / "config.json").stat().st_mtime_ns
    write_preset(PRESETS["tiny"], tmp_path / "tiny")
    assert (paths.target / "config.json").stat().st_mtime_ns == stamp


def test_sharded_bf16_writer_and_weight_bytes(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = llama_config(PRESETS["tiny"].target, "bfloat16")
    path = write_llama(tmp_path / "t", config, shard_bytes=200_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = load_model(path, dtype=torch.bfloat16)
    assert model.config.hidden_size == 64
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    read = sum(
        p.numel() * p.element_size() for n, p in hf.named_parameters() if "embed_tokens" not in n
    )
    assert weight_bytes(ModelConfig.from_pretrained(path), torch.bfloat16) == read


def test_8b_preset_shape() -> None:
    preset = PRESETS["llama-3.1-8b"]
    config = llama_config(preset.target, preset.dtype)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert preset.aux_layer_ids == specforge_aux_layers(32) == (1, 15, 28)
    assert preset.draft_vocab_size == 32000
    params = sum(torch.Size(shape).numel() for _, shape in llama_tensors(config))
    assert 8.0e9 < params < 8.1e9  # Llama-3.1-8B has 8.03 B parameters


def test_table_is_fixed_width() -> None:
    rows = [
        Row(mode="spec", batch_size=1, tokens_per_s=123.4, accept_length=2.5,
            acceptance_per_position=[0.9, 0.5, 0.1]),
        Row(mode="hf-assisted", batch_size=8, note="skipped: transformers assists at bs=1 only"),
    ]  # fmt: skip
    text = table(rows, {"Device": "cpu"})
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("mode"))
    assert lines[head + 1].index("spec") + 4 == lines[head + 2].index("hf-assisted") + 11
    assert "0.90/0.50/0.10" in text and "Device:" in text


def test_ratios_over_target_only_and_in_process() -> None:
    """Under the table: each mode over target-only per batch size, each services mode over
    in-process speculation; a mode without a batch size's row shows '-'."""
    rows = [
        Row(mode="target-only", batch_size=1, tokens_per_s=200.0),
        Row(mode="target-only", batch_size=8, tokens_per_s=1600.0),
        Row(mode="spec", batch_size=1, tokens_per_s=480.0),
        Row(mode="spec", batch_size=8, tokens_per_s=3200.0),
        Row(mode="services", batch_size=1, tokens_per_s=432.0),
    ]
    lines = ratios(rows)
    assert lines[0].split() == ["tok/s", "over", "target-only", "bs", "1", "bs", "8"]
    assert lines[1].split() == ["spec", "2.400x", "2.000x"]
    assert lines[2].split() == ["services", "2.160x", "-"]
    assert lines[3].split() == ["services", "/", "spec", "0.900x", "-"]
    assert "services / spec" in table(rows, {})
    assert ratios([Row(mode="spec", batch_size=1, tokens_per_s=1.0)]) == []
