"""Tree building (EAGLE-2 selection), tree validation at the draft/target boundary, and the
drafter's refusal to propose from NaN logits."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tandem.errors import InvalidRequest
from tandem.spec.tree import CandidatePool
from tandem.spec.types import SpecConfig, Tree
from tests.spec.conftest import Checkpoints, greedy, ragged_prompts


def test_spec_config_validation() -> None:
    assert SpecConfig(num_steps=3, topk=1).tree_size == 4
    assert SpecConfig(num_steps=3, topk=4, num_draft_tokens=16).pool_size == 4 + 2 * 16
    with pytest.raises(InvalidRequest, match="num_draft_tokens"):
        SpecConfig(num_steps=3, topk=1, num_draft_tokens=8)  # a chain has N = S+1
    with pytest.raises(InvalidRequest, match="num_draft_tokens"):
        SpecConfig(num_steps=1, topk=2, num_draft_tokens=8)  # only 2 candidates exist
    with pytest.raises(InvalidRequest, match="topk"):
        SpecConfig(num_steps=3, topk=0)
    with pytest.raises(InvalidRequest, match="num_steps"):
        SpecConfig(num_steps=0)


def test_selection_takes_the_best_cumulative_scores_and_stays_closed() -> None:
    pool = CandidatePool(verified_token=7)
    lp = math.log
    first = pool.add_children(-1, [10, 11], [lp(0.6), lp(0.4)])
    pool.select_frontier(first, 2)
    # Children of 10 (0.6 * 0.9, 0.6 * 0.1) and of 11 (0.4 * 0.5, 0.4 * 0.5).
    second = pool.add_children(first[0], [20, 21], [lp(0.9), lp(0.1)])
    second += pool.add_children(first[1], [22, 23], [lp(0.5), lp(0.5)])
    pool.select_frontier(second, 2)
    assert [pool.tokens[i] for i in pool.frontier] == [20, 22]  # 0.54, then 0.2 (22 before 23)
    tree = pool.to_tree(5)
    # Best 4: 10 (.6), 20 (.54), 11 (.4), 22 (.2; ties with 23, lower index wins).
    assert tree.tokens == (7, 10, 11, 20, 22)
    assert tree.parents == (-1, 0, 0, 1, 2)
    assert tree.depths == (0, 1, 1, 2, 2)


def test_ties_between_parent_and_child_keep_the_parent() -> None:
    pool = CandidatePool(verified_token=1)
    a = pool.add_children(-1, [5], [0.0])  # probability 1
    pool.select_frontier(a, 1)
    b = pool.add_children(a[0], [6], [0.0])  # the same cumulative score as its parent
    pool.select_frontier(b, 1)
    assert pool.to_tree(2).tokens == (1, 5)


def test_tree_check_rejects_bad_trees() -> None:
    ok = Tree(tokens=(3, 4, 5), parents=(-1, 0, 1))
    assert ok.check(vocab_size=10, max_nodes=4, verified_token=3) is None
    cases = {
        "outside": Tree(tokens=(3, 10), parents=(-1, 0)),
        "outside [0, 1)": Tree(tokens=(3, 4), parents=(-1, 1)),
        "not the verified": Tree(tokens=(2, 4), parents=(-1, 0)),
        "repeats a sibling": Tree(tokens=(3, 4, 4), parents=(-1, 0, 0)),
        "size": Tree(tokens=(3, 4, 5, 6, 7), parents=(-1, 0, 1, 2, 3)),
    }
    for reason, tree in cases.items():
        problem = tree.check(vocab_size=10, max_nodes=4, verified_token=3)
        assert problem is not None and reason in problem, (reason, problem)
    assert ok.prefix(2) == Tree(tokens=(3, 4), parents=(-1, 0))


def test_nan_draft_logits_propose_nothing(
    ckpts: Checkpoints, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = ckpts.engine("eagle3", SpecConfig(num_steps=3, topk=1))
    module: Any = engine.drafter.modules[0]  # type: ignore[union-attr]
    real = module.compute_logits
    calls = []

    def poisoned(out: torch.Tensor) -> torch.Tensor:
        logits = real(out)
        calls.append(logits.shape[0])
        logits[::2] = float("nan")  # every other row: those requests must propose nothing
        return logits

    monkeypatch.setattr(module, "compute_logits", poisoned)
    results = engine.generate(ragged_prompts(), greedy())
    assert [r.token_ids for r in results] == reference
    assert calls, "the poisoned logits were never used"
    assert any(r.stats.draft_tokens == 0 for r in results)
