"""The target's graph runner without capture ("eager static"): the same static buffers, buckets
and padding a CUDA-graph replay uses, run directly. Without CUDA the Triton kernels run in the
interpreter on CPU tensors; on a CUDA host the same tests run them compiled.

Every step that fits a bucket is rerun through the eager path on the same KV (``Shadow``): the
logits, target features and KV writes must agree, while requests arrive and finish (batch sizes
change, padded requests and padded tree rows), for plain decoding and for verification of
chains and trees, at page sizes 1 and 16; greedy outputs equal target-only decoding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.attention import _tree_attention_kernel
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.spec.types import SpecConfig, Tree
from tandem.target.engine import Engine
from tandem.target.graphs import Bucket, TargetGraphRunner, graph_widths
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tests.driving import Shadow, arrivals, drive

check_mode(_tree_attention_kernel)

VOCAB = 999
LAYERS = 4
ATOL = 1e-4  # fp32 logits: Triton (static buffers) against the eager path's attention
POOL_TOKENS = 2048  # KV pools stay small: the shadow copies them every step
PLAN = arrivals(8, VOCAB, every=1, new_tokens=(4, 20), seed=7)
# kind -> (draft kind, K, S, N); "model" drafts with the target itself, so every draft is
# accepted and verified trees are compacted.
SPECS = {
    "plain": None,
    "eagle3-chain": ("eagle3", 1, 5, 6),
    "model-tree": ("model", 3, 3, 7),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graphs")
    # Qwen2 has q/k/v biases: a padding row's K/V is not zero, so a stray KV write shows.
    target = make_checkpoint(
        root / "target", "qwen2", seed=5, vocab_size=VOCAB, num_hidden_layers=LAYERS
    )
    eagle3 = make_eagle3_checkpoint(root / "eagle3", target, draft_vocab_size=256, seed=1)
    return {"target": target, "eagle3": eagle3, "model": target}


@pytest.fixture(scope="module")
def reference(ckpts: dict[str, Path]) -> list[list[int]]:
    """Target-only greedy outputs, all steps eager."""
    config = EngineConfig(
        model=ckpts["target"], device=str(DEVICE), num_pages=POOL_TOKENS // 16, cuda_graphs=False
    )
    outputs, _ = drive(Engine(config), PLAN)
    return outputs


def static_engine(ckpts: dict[str, Path], kind: str, page_size: int) -> Engine:
    """An engine whose decode/verify steps run in eager-static buckets."""
    config = EngineConfig(
        model=ckpts["target"],
        device=str(DEVICE),
        page_size=page_size,
        num_pages=POOL_TOKENS // page_size,
        cuda_graphs=False,
    )
    drafter = spec = None
    shape = SPECS[kind]
    if shape is not None:
        draft_kind, k, s, n = shape
        spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
        drafter = build_drafter(
            DraftConfig(
                kind=draft_kind,
                path=ckpts[draft_kind],
                target=ckpts["target"],
                device=str(DEVICE),
                page_size=page_size,
                num_pages=POOL_TOKENS // page_size,
            ),
            LAYERS,
        )
    engine = Engine(config, drafter=drafter, spec=spec)
    engine.runner.enable_graphs(
        batch_sizes=(1, 2, 4, 8),
        widths=graph_widths(spec.tree_size if spec is not None else None),
        max_model_len=engine.max_model_len,
        capture_layers=drafter.target_layer_ids if drafter is not None else (),
        capture=False,
    )
    return engine


@pytest.mark.slow  # whole models, captured and eager, in Triton's interpreter on CPU
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", list(SPECS))
def test_static_buckets_match_eager_steps(
    ckpts: dict[str, Path], reference: list[list[int]], kind: str, page_size: int
) -> None:
    engine = static_engine(ckpts, kind, page_size)
    shadow = Shadow(engine, atol=ATOL)
    outputs, _ = drive(engine, PLAN)
    assert outputs == reference
    seen = shadow.seen
    assert shadow.missed == 0 and len(seen) >= 5, "every decode/verify step fits a bucket"
    assert any(s.batch_size < s.bucket.batch_size for s in seen), "no padded request"
    assert len({s.bucket.batch_size for s in seen}) >= 3, "batch sizes did not change"
    # Plain decoding between arrivals decodes ahead (tandem/target/ahead.py), in its buckets too.
    assert any(s.ahead for s in seen) == (SPECS[kind] is None)
    if SPECS[kind] is not None:
        n = engine.spec.tree_size  # type: ignore[union-attr]
        assert n in {s.bucket.width for s in seen} <= {1, n}
        assert any(min(s.tree_sizes) < n == s.bucket.width for s in seen), "no padded tree"
        assert any(max(s.tree_sizes) == n for s in seen), "no full tree verified"
        assert engine.drafter is not None and engine.drafter.num_tracked() == 0


def small_runner(ckpts: dict[str, Path], widths: tuple[int, ...]) -> TargetGraphRunner:
    config = EngineConfig(
        model=ckpts["target"], device=str(DEVICE), page_size=4, num_pages=64, cuda_graphs=False
    )
    engine = Engine(config)
    return engine.runner.enable_graphs(
        batch_sizes=(1, 2, 4), widths=widths, max_model_len=64, capture=False
    )


def test_plan_pads_rows_and_requests(ckpts: dict[str, Path]) -> None:
    runner = small_runner(ckpts, (1, 6))
    alloc = runner.kv.allocator
    trees = [
        Tree(tokens=(5, 6, 7, 8), parents=(-1, 0, 0, 1)),
        Tree(tokens=(9,), parents=(-1,)),
        Tree(tokens=(10, 11), parents=(-1, 0)),
    ]
    starts = [9, 0, 3]
    for i, (start, tree) in enumerate(zip(starts, trees, strict=True)):
        alloc.allocate(f"r{i}", start + len(tree))
    batch = runner.plan(["r0", "r1", "r2"], starts, trees)
    assert batch is not None and batch.bucket == Bucket(4, 6)
    assert batch.input_ids[:6] == [5, 6, 7, 8, 0, 0] and batch.input_ids[18:] == [0] * 6
    assert batch.positions[:6] == [9, 10, 10, 11, 0, 0]  # start + depth
    assert batch.slot_mapping[:6] == [*alloc.slot_mapping("r0", 9, 13), -1, -1]
    assert batch.slot_mapping[18:] == [-1] * 6
    assert batch.tree_mask[:6] == [0b1, 0b11, 0b101, 0b1011, 0, 0]
    assert batch.seq_lens == [13, 1, 5, 0] and batch.prefix_lens == [9, 0, 3, 0]
    assert batch.rows == [0, 1, 2, 3, 6, 12, 13]  # the eager batch's flat order
    assert runner.bucket_for(3, 1) == Bucket(4, 1)
    assert runner.bucket_for(5, 1) is None and runner.bucket_for(1, 7) is None
    # 64 nodes: the last row of a chain sets all 64 bits of its word (-1 as int64).
    wide = small_runner(ckpts, (1, 64))
    chain = Tree(tokens=tuple(range(64)), parents=tuple(range(-1, 63)))
    wide.kv.allocator.allocate("c", 64)
    planned = wide.plan(["c"], [0], [chain])
    assert planned is not None and planned.tree_mask[63] == -1 and planned.tree_mask[62] > 0


def test_a_bucket_run_changes_nothing_it_reads(ckpts: dict[str, Path]) -> None:
    """SGLang #25015: a captured region that mutates its inputs gives a different result on
    the next replay. Running a step twice must give the same logits, features and KV."""
    runner = small_runner(ckpts, (1, 3))
    kv = runner.kv
    trees = [Tree(tokens=(5, 6, 7), parents=(-1, 0, 1)), Tree(tokens=(9, 4), parents=(-1, 0))]
    for i, tree in enumerate(trees):
        kv.allocator.allocate(f"r{i}", 10 + len(tree))
    for cache in [*kv.k_caches, *kv.v_caches]:
        cache[kv.spec.page_size :].normal_(generator=torch.Generator(DEVICE).manual_seed(0))
    batch = runner.plan(["r0", "r1"], [10, 10], trees)
    assert batch is not None
    first = runner.run(batch, (1, LAYERS))
    caches = [c.clone() for c in [*kv.k_caches, *kv.v_caches]]
    second = runner.run(batch, (1, LAYERS))
    assert torch.equal(first[0], second[0]) and first[0].shape == (5, VOCAB)
    assert first[1] is not None and second[1] is not None and torch.equal(first[1], second[1])
    assert all(map(torch.equal, caches, [*kv.k_caches, *kv.v_caches]))
    assert runner.replays == {Bucket(2, 3): 2}


def test_config_switch_and_buckets() -> None:
    cpu = EngineConfig(model=Path("m"))
    assert not cpu.use_cuda_graphs
    assert EngineConfig(model=Path("m"), device="cuda").use_cuda_graphs
    assert not EngineConfig(model=Path("m"), device="cuda", cuda_graphs=False).use_cuda_graphs
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(model=Path("m"), cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        EngineConfig(model=Path("m"), cuda_graph_batch_sizes=(4, 2))
    assert EngineConfig(model=Path("m"), max_num_seqs=20).graph_batch_sizes == (
        1, 2, 4, 8, 16, 24,
    )  # fmt: skip
    assert EngineConfig(model=Path("m"), max_num_seqs=100).graph_batch_sizes[-1] == 64
