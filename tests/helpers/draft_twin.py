"""The twin drafter of the draft-graph tests (``tests/spec/test_draft_graphs.py``,
``tests/spec/test_draft_tree_graphs.py``): every step through a drafter with draft graphs and
one without, whose trees, carried state and KV counts must agree; the engine that drives it,
the plans it runs and the checks on what ran."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tests.kernels._interpret import DEVICE  # sets Triton's mode: import first

# isort: split
from tandem.config import EngineConfig
from tandem.draft.drafter import ModelDrafter
from tandem.spec.base import Drafter
from tandem.spec.types import DraftAdmit, SpecConfig, Tree, VerifyOutcome
from tandem.target.engine import Engine
from tests.driving import Arrival, arrivals, drive
from tests.spec.conftest import VOCAB, Checkpoints, make_drafter

# A one-token prompt: the admission carries two committed tokens, the least a chain needs.
PLAN = [
    Arrival(step=0, prompt=[5], max_new_tokens=12),
    *arrivals(8, VOCAB, every=2, new_tokens=(4, 24), seed=7),
]
GPU_PLAN = arrivals(40, VOCAB, every=5, new_tokens=(16, 80), seed=11)
BATCH_SIZES = (1, 2, 4, 8)
ATOL = 1e-4  # carried hidden states: Triton attention on static buffers against the host path


class Twin(Drafter):
    """Steps a graph drafter and a host-path drafter alike; their answers must be equal."""

    def __init__(self, graph: ModelDrafter, eager: ModelDrafter) -> None:
        self.graph, self.eager = graph, eager
        self.target_layer_ids = graph.target_layer_ids
        self.steps = 0
        self.trees = 0

    def step(
        self,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> dict[str, Tree]:
        expected = self.eager.step(admits, outcomes, released)
        trees = self.graph.step(admits, outcomes, released)
        assert trees == expected, f"step {self.steps}"
        assert self.graph.seqs.keys() == self.eager.seqs.keys()
        for request_id, seq in self.graph.seqs.items():
            twin = self.eager.seqs[request_id]
            assert seq.tokens == twin.tokens
            for ours, theirs in zip(seq.last_out, twin.last_out, strict=True):
                assert (ours is None) == (theirs is None)
                if ours is not None and theirs is not None:
                    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
            for kv, twin_kv in zip(self.graph.kvs, self.eager.kvs, strict=True):
                count = kv.allocator.num_tokens(request_id)
                assert count == twin_kv.allocator.num_tokens(request_id)
        self.steps += 1
        self.trees += len(trees)
        return trees

    def take_dropped(self) -> list[str]:
        dropped = self.graph.take_dropped()
        assert dropped == self.eager.take_dropped()
        return dropped

    def num_tracked(self) -> int:
        return self.graph.num_tracked()


def twin_engine(
    ckpts: Checkpoints,
    kind: str,
    num_steps: int,
    *,
    capture: bool,
    page_size: int = 4,
    topk: int = 1,
    tree_size: int | None = None,
) -> tuple[Engine, Twin]:
    spec = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=tree_size)
    graph = make_drafter(ckpts, kind, str(DEVICE), page_size, 2048 // page_size)
    eager = make_drafter(ckpts, kind, str(DEVICE), page_size, 2048 // page_size)
    graph.use_graphs(
        batch_sizes=BATCH_SIZES,
        max_model_len=256,
        num_steps=(num_steps,),
        trees=(spec,),
        capture=capture,
    )
    twin = Twin(graph, eager)
    config = EngineConfig(
        model=ckpts.target,
        device=str(DEVICE),
        page_size=page_size,
        num_pages=4096 // page_size,
        cuda_graphs=False,
    )
    engine = Engine(config, drafter=twin, spec=spec)
    return engine, twin


def target_only(ckpts: Checkpoints, plan: Sequence[Arrival]) -> list[list[int]]:
    config = EngineConfig(model=ckpts.target, device=str(DEVICE), num_pages=256, cuda_graphs=False)
    return drive(Engine(config), plan)[0]


@pytest.fixture(scope="module")
def reference(ckpts: Checkpoints) -> list[list[int]]:
    return target_only(ckpts, PLAN)


def check_run(twin: Twin, min_buckets: int, loop: str = "loop") -> None:
    runner = twin.graph.graphs
    assert runner is not None
    loops = {b for kind, b in runner.replays if kind == loop}
    extends = {b for kind, b in runner.replays if kind == "extend"}
    assert len({b.batch_size for b in loops}) >= min_buckets, runner.replays
    assert extends, "no extend ran in a bucket"
    assert twin.trees > 0 and twin.num_tracked() == 0
    for drafter in (twin.graph, twin.eager):
        for kv in drafter.kvs:
            assert kv.allocator.num_free_pages == kv.allocator.num_pages, "draft KV leaked"
