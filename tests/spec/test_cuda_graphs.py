"""Target decode/verify through CUDA graphs against eager steps, on a CUDA device.

Requests arrive and finish over more than 200 steps, so batches move between buckets and pad.
Every replay is checked against the same step run eagerly on the same KV (logits, features, KV
writes) and against the capture-free run of its bucket; greedy outputs equal eager decoding and
target-only decoding, for plain decoding and for verification of EAGLE-3 chains (K=1, S=5) and
trees, and of trees a draft equal to the target fills (all drafts accepted, KV compacted).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.spec.types import SpecConfig, Tree
from tandem.target.engine import Engine
from tandem.target.graphs import Bucket, TargetGraphRunner
from tests.driving import Shadow, arrivals, drive
from tests.spec.conftest import LAYERS, VOCAB, Checkpoints

pytestmark = pytest.mark.gpu

PLAN = arrivals(40, VOCAB, every=5, new_tokens=(16, 80), seed=11)
ATOL = 1e-4  # fp32 logits of a replay against the eager step (another attention launch shape)
# name -> (draft kind, K, S, N)
SPECS = {
    "plain": None,
    "eagle3-chain": ("eagle3", 1, 5, 6),
    "eagle3-tree": ("eagle3", 4, 5, 16),
    "model-tree": ("model", 3, 4, 10),
}


def cuda_engine(
    ckpts: Checkpoints, name: str, page_size: int, *, graphs: bool, batch_invariant: bool = False
) -> Engine:
    config = EngineConfig(
        model=ckpts.target,
        device="cuda",
        page_size=page_size,
        num_pages=8192 // page_size,  # small: the shadow copies the pool every step
        cuda_graphs=graphs,
        batch_invariant=batch_invariant,
        device_chain=False,  # the ordinary steps' graphs (device-chain runs: test_device_chain)
    )
    shape = SPECS[name]
    if shape is None:
        return Engine(config)
    kind, k, s, n = shape
    drafter = build_drafter(
        DraftConfig(
            kind=kind,
            path=ckpts.target if kind == "model" else ckpts.drafts[kind],
            target=ckpts.target,
            device="cuda",
            page_size=page_size,
            num_pages=8192 // page_size,
        ),
        LAYERS,
    )
    return Engine(config, drafter=drafter, spec=SpecConfig(num_steps=s, topk=k, num_draft_tokens=n))


@pytest.fixture(scope="module")
def target_only(ckpts: Checkpoints) -> list[list[int]]:
    outputs, steps = drive(cuda_engine(ckpts, "plain", 16, graphs=False), PLAN)
    assert steps >= 200
    return outputs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", list(SPECS))
def test_graph_steps_equal_eager_steps(
    ckpts: Checkpoints, target_only: list[list[int]], name: str, page_size: int
) -> None:
    engine = cuda_engine(ckpts, name, page_size, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.captured
    twin = TargetGraphRunner(
        engine.model,
        engine.kv,
        batch_sizes=graphs.batch_sizes,
        widths=graphs.widths,
        max_model_len=engine.max_model_len,
        attention=graphs.attention,
        capture=False,
    )
    twin.capture(graphs.layers)
    shadow = Shadow(engine, atol=ATOL, twin=twin)
    outputs, steps = drive(engine, PLAN)
    assert outputs == target_only
    if name != "model-tree":  # all of that draft is accepted: far fewer steps
        assert steps >= 200
    assert shadow.missed == 0
    assert sum(graphs.replays.values()) == len(shadow.seen) > steps // 2
    assert len({b.batch_size for b in graphs.replays}) >= 4, graphs.replays
    assert any(s.batch_size < s.bucket.batch_size for s in shadow.seen)
    # Plain decoding decodes ahead (tandem/target/ahead.py): replays fed by the last step's choices.
    assert any(s.ahead for s in shadow.seen) == (SPECS[name] is None)
    if SPECS[name] is not None:
        eager = cuda_engine(ckpts, name, page_size, graphs=False)
        assert drive(eager, PLAN)[0] == target_only
        n = engine.spec.tree_size  # type: ignore[union-attr]
        assert any(b.width == n for b in graphs.replays)


def test_decoding_ahead_equals_synchronous_steps(
    ckpts: Checkpoints, target_only: list[list[int]]
) -> None:
    """Graph replays launched before the last step is read (no shadow: nothing syncs between
    them) give the outputs of synchronous eager decoding."""
    engine = cuda_engine(ckpts, "plain", 16, graphs=True)
    outputs, _ = drive(engine, PLAN)
    assert outputs == target_only
    assert engine.ahead.launches > 100, engine.ahead.launches
    config = EngineConfig(model=ckpts.target, device="cuda", num_pages=512, overlap=False)
    sync = Engine(config)
    assert drive(sync, PLAN)[0] == target_only and sync.ahead.launches == 0


def test_capture_reports_and_follows_new_layers(
    ckpts: Checkpoints, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tandem.target.graphs"):
        engine = cuda_engine(ckpts, "plain", 16, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.layers == () and graphs.num_captures == 1
    count = len(graphs.buckets)
    assert count == 9  # plain decoding: width 1 at the nine default batch sizes
    assert sum(f"CUDA graph {k}/{count}:" in caplog.text for k in range(1, count + 1)) == count
    assert f"captured {count} CUDA graphs" in caplog.text and "MiB" in caplog.text
    kv = engine.kv
    kv.allocator.allocate("a", 8)
    kv.allocator.allocate("b", 8)
    trees = [Tree(tokens=(5,), parents=(-1,)), Tree(tokens=(7,), parents=(-1,))]
    batch = graphs.plan(["a", "b"], [7, 7], trees)
    assert batch is not None and batch.bucket == Bucket(2, 1)
    logits, features = graphs.run(batch)
    assert features is None and logits.shape == (2, VOCAB)
    logits_again, features = graphs.run(batch, (2, LAYERS))  # a draft announced its layers
    assert graphs.num_captures == 2 and graphs.captured and graphs.layers == (2, LAYERS)
    assert features is not None and features.shape == (2, 2 * engine.model.config.hidden_size)
    torch.testing.assert_close(logits_again, logits, atol=1e-6, rtol=0)


def test_cuda_graphs_flag_reaches_the_engine(ckpts: Checkpoints) -> None:
    assert Engine(EngineConfig(model=ckpts.target, device="cuda", num_pages=64)).runner.graphs
    off = EngineConfig(model=ckpts.target, device="cuda", num_pages=64, cuda_graphs=False)
    assert Engine(off).runner.graphs is None


@pytest.mark.parametrize(
    ("name", "invariant"), [("plain", False), ("eagle3-chain", False), ("plain", True)]
)
def test_lone_prompts_replay_prefill_graphs(
    ckpts: Checkpoints, name: str, invariant: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Prompts that arrive alone replay the prefill graphs (``tandem.target.prefill_graphs``): each
    chunk matches its eager step on the same KV (last row's logits, features, KV writes), bit
    for bit with batch-invariant kernels, and greedy outputs equal eager decoding."""
    plan = arrivals(6, VOCAB, every=100, new_tokens=(8, 40), seed=3)  # each alone in its step
    eager, _ = drive(cuda_engine(ckpts, name, 16, graphs=False, batch_invariant=invariant), plan)
    with caplog.at_level(logging.INFO, logger="tandem.target.prefill_graphs"):
        engine = cuda_engine(ckpts, name, 16, graphs=True, batch_invariant=invariant)
    runner = engine.runner.prefill_graphs
    assert runner is not None and runner.captured and runner.widths == [16, 32, 64, 128, 256, 512]
    assert "captured 6 prefill CUDA graphs" in caplog.text
    shadow = Shadow(engine, atol=0.0 if invariant else ATOL)
    outputs, _ = drive(engine, plan)
    assert outputs == eager
    assert len(shadow.prefills) == len(plan) and all(last for _, _, last in shadow.prefills)
    assert sum(runner.replays.values()) == len(plan)
