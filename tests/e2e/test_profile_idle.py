"""``tandem bench --profile-idle``'s profiled rounds through the real services (the bench's own
``tandem.bench.services`` helpers): the draft's window follows the target's, which counts
steps. With K=0 throughout the target sends the draft service nothing, so the draft runs no
step in the round: its window must still be written, covering the target's, and the round's
idle figure must come out (it waited 60 s for a draft file that never came); speculating, the
draft's steps are in its window, which covers the target's however many they are."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.bench import idle, services
from tandem.bench.inprocess import Workload, pages_needed
from tandem.bench.probe import plan_probe
from tandem.models.config import ModelConfig
from tandem.spec.types import SpecConfig
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

S = 3
BATCH = 2
TREE = SpecConfig(num_steps=S, topk=1).tree_size


@pytest.mark.parametrize("policy", ["k0", "fixed"])
def test_profiled_rounds_give_both_windows_and_an_idle_figure(tmp_path: Path, policy: str) -> None:
    target = make_checkpoint(tmp_path / "target", "llama", seed=12, num_hidden_layers=2)
    draft = make_eagle3_checkpoint(tmp_path / "eagle3", target, draft_vocab_size=256, seed=2)
    vocab = ModelConfig.from_pretrained(target).vocab_size
    w = Workload(prompt_len=12, new_tokens=24, warmup_tokens=0, rounds=1)
    # 20 s: a missing window shows as a note, not a hang (the bench waits 60 s).
    probe = replace(plan_probe(tmp_path / "profiles", w, BATCH, S), timeout_s=20.0)
    stack = services.start_stack(
        target,
        draft,
        spec=SpecConfig(num_steps=S),
        device="cpu",
        dtype="float32",
        page_size=16,
        num_pages=pages_needed(BATCH, replace(w, new_tokens=probe.new_tokens), TREE, 16),
        max_batch=BATCH,
        two_lane_batch=16,
        simulate_accept_length=None,
        log_dir=tmp_path / "logs",
        spec_policy=policy,  # k0: every step K=0, the draft service gets no work in a round
        probe=probe,
    )
    try:
        control = services.through_control(
            services.port_of(stack, "target"), vocab, BATCH, w, S, probe
        )
        gateway = services.through_gateway(
            services.port_of(stack, "gateway"), vocab, BATCH, w, probe
        )
    finally:
        stack.stop()
    for row, label in ((control, "services-control"), (gateway, "services")):
        assert row.note == "", (label, row.note)
        report = row.gpu_idle
        assert report is not None and report["timeline"] == "cpu_ops"
        assert sorted(p.split("-")[0] for p in report["processes"]) == ["draft", "target"]
        (cpu,) = report["devices"]
        draft_busy = next(f for p, f in cpu["busy_by_process"].items() if p.startswith("draft"))
        assert 0.0 < 1.0 - cpu["idle_fraction"] <= 1.0
        out_dir = tmp_path / "profiles" / f"bs{BATCH}-{label}"
        windows = {
            f.name.split("-")[0]: json.loads(f.read_text())["window"]
            for f in idle.profile_files([out_dir])
        }
        # The draft's window covers the target's: the common window is the target's own.
        assert windows["draft"]["start_ns"] <= windows["target"]["start_ns"]
        assert windows["draft"]["end_ns"] >= windows["target"]["end_ns"]
        assert (windows["target"]["closed"], windows["draft"]["closed"]) == ("steps", "follow")
        if policy == "k0":
            assert row.accept_length == pytest.approx(1.0), label
            assert windows["draft"]["num_steps"] == 0 and draft_busy == 0.0, label
        else:
            assert row.accept_length is not None and row.accept_length >= 1.0, label
            assert windows["draft"]["num_steps"] > 0 and draft_busy > 0.0, label
