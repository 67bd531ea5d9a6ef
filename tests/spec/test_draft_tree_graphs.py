"""The draft's tree loop (``tandem/draft/tree_graphs.py``) against the host loop
(``tandem/draft/trees.py``): a twin drafter (``tests/helpers/draft_twin.py``) drafts every
step's trees (K > 1) through the tree loop's buckets (eager static here: the same buffers,
padding and buckets, not captured; Triton interpreted on CPU) and through the host loop; the
trees must be identical at every step while requests arrive and finish, for EAGLE-3, EAGLE and
a standalone draft model, page sizes 1, 4 and 16, S=1, and rows with NaN logits. Greedy output
stays the target-only output and both pools end empty. The ``gpu`` test captures for real.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.attention import _tree_attention_kernel
from tandem.spec.types import Tree
from tests.driving import drive
from tests.helpers.draft_twin import (  # noqa: F401 (reference: a fixture)
    GPU_PLAN,
    PLAN,
    check_run,
    reference,
    target_only,
    twin_engine,
)
from tests.spec.conftest import Checkpoints

check_mode(_tree_attention_kernel)


@pytest.mark.parametrize(
    ("kind", "topk", "num_steps", "tree_size", "page_size"),
    [
        ("eagle3", 4, 5, 16, 4),
        ("eagle", 2, 3, 6, 1),
        ("model", 2, 4, 7, 4),
        ("eagle3", 3, 1, 3, 16),
    ],
)
def test_graph_trees_of_several_candidates_equal_host_trees(
    ckpts: Checkpoints,
    reference: list[list[int]],  # noqa: F811
    kind: str,
    topk: int,
    num_steps: int,
    tree_size: int,
    page_size: int,
) -> None:
    """Trees (K > 1) through the tree loop's buckets (EAGLE-2 selection on the device) equal
    the host path's at every step while the batch moves between buckets; the trees branch."""
    engine, twin = twin_engine(
        ckpts,
        kind,
        num_steps,
        capture=False,
        page_size=page_size,
        topk=topk,
        tree_size=tree_size,
    )
    shapes = twin.graph.graphs.tree_shapes if twin.graph.graphs else []
    assert [(s.topk, s.num_steps, s.tree_size) for s in shapes] == [(topk, num_steps, tree_size)]
    branched = []
    original = twin.graph.step

    def step(*args: Any) -> dict[str, Tree]:
        trees = original(*args)
        branched.extend(len(set(t.parents[1:])) < len(t.parents) - 1 for t in trees.values())
        return trees

    twin.graph.step = step  # type: ignore[method-assign]
    outputs, _ = drive(engine, PLAN)
    assert outputs == reference
    check_run(twin, min_buckets=3, loop="tree")
    assert any(branched) and len(branched) == twin.trees


def test_tree_loops_stop_where_the_host_loop_stops(
    ckpts: Checkpoints,
    reference: list[list[int]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows with NaN logits (here: every row whose best token is a multiple of 5): the host
    loop adds the children of the step's valid rows, then stops the request; the tree loop's
    trees are the same, every step. Greedy output is still target-only's."""
    engine, twin = twin_engine(ckpts, "eagle3", 4, capture=False, topk=3, tree_size=9)
    for drafter in (twin.graph, twin.eager):
        module = drafter.modules[0]
        logits_of = module.compute_logits

        def poisoned(out: torch.Tensor, logits_of: Any = logits_of) -> torch.Tensor:
            logits = logits_of(out)
            bad = (logits.argmax(-1) % 5 == 0)[:, None]
            return torch.where(bad, torch.full_like(logits, float("nan")), logits)

        monkeypatch.setattr(module, "compute_logits", poisoned)
    sizes: list[int] = []
    original = twin.graph.step

    def step(*args: Any) -> dict[str, Tree]:
        trees = original(*args)
        sizes.extend(len(t) for t in trees.values())
        return trees

    twin.graph.step = step  # type: ignore[method-assign]
    outputs, _ = drive(engine, PLAN)
    assert outputs == reference
    check_run(twin, min_buckets=3, loop="tree")
    assert 1 in sizes and 9 in sizes and any(1 < n < 9 for n in sizes), sorted(set(sizes))


@pytest.mark.gpu
@pytest.mark.parametrize(("topk", "num_steps", "tree_size"), [(4, 5, 16), (2, 3, 6)])
def test_captured_tree_loops_equal_eager_trees(
    ckpts: Checkpoints, topk: int, num_steps: int, tree_size: int
) -> None:
    """Real capture on CUDA: every replayed tree loop against the eager drafter over more than
    200 steps while the batch moves between buckets."""
    if DEVICE.type != "cuda":
        pytest.skip("needs CUDA without TRITON_INTERPRET")
    engine, twin = twin_engine(
        ckpts, "eagle3", num_steps, capture=True, topk=topk, tree_size=tree_size
    )
    runner = twin.graph.graphs
    assert runner is not None and runner.captured and len(runner.tree_shapes) == 1
    outputs, steps = drive(engine, GPU_PLAN)
    assert steps >= 200
    assert outputs == target_only(ckpts, GPU_PLAN)
    check_run(twin, min_buckets=4, loop="tree")
    assert len(runner.tree_shapes) == 1  # nothing captured on the way
