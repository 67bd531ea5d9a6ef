"""Invariants of the cycle that parity alone would not catch: RoPE positions of every draft
pair and verified node, KV compaction equal to a fresh prefill, seeded determinism and a target
random stream that does not depend on the draft."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tandem.spec.verify as verify_module
from kernels import reference
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig, Tree
from tandem.target.engine import Engine
from tests.spec.conftest import Checkpoints, greedy, ragged_prompts

Calls = list[tuple[list[int], list[int]]]


def record(module: torch.nn.Module, calls: Calls, ids_arg: int, pos_arg: int) -> None:
    def hook(_: torch.nn.Module, args: tuple[Any, ...], __: Any) -> None:
        calls.append((args[ids_arg].tolist(), args[pos_arg].tolist()))

    module.register_forward_hook(hook)


def chain(tree: Tree | None) -> list[int]:
    if tree is None:
        return []
    assert tree.parents == tuple(range(-1, len(tree) - 1)), "expected a chain"
    return list(tree.tokens[1:])


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp-chain", "mtp-target", "model"])
def test_every_pair_runs_at_the_position_of_what_it_consumes(ckpts: Checkpoints, kind: str) -> None:
    """Target: a token at position p is token p of the sequence (committed + the chain being
    verified). Draft module with shift s: the pair consuming token t_j runs at j - s, for the
    committed pairs and for the chain it drafts."""
    engine = ckpts.engine(kind, SpecConfig(num_steps=3, topk=1))
    target_calls: Calls = []
    record(engine.model, target_calls, 0, 1)
    drafter: Any = engine.drafter
    draft_calls: list[Calls] = [[] for _ in drafter.modules]
    for module, calls in zip(drafter.modules, draft_calls, strict=True):
        record(module, calls, 0, 2)
    # The drafted chain as the draft returned it (the engine may cut it near max_new_tokens).
    drafted: dict[str, Tree] = {}
    step = drafter.step

    def spy(*args: Any) -> dict[str, Tree]:
        drafted.clear()
        drafted.update(step(*args))
        return drafted

    drafter.step = spy
    rid = engine.add_request(ragged_prompts()[2], greedy(40))
    req = engine._requests[rid]
    checked_target = checked_draft = 0
    while engine.has_unfinished():
        # The chain verified now is the one drafted at the end of the previous step.
        before = req.tokens + chain(drafted.get(rid))
        target_calls.clear()
        for calls in draft_calls:
            calls.clear()
        engine.step()
        for ids, positions in target_calls:
            for token, p in zip(ids, positions, strict=True):
                assert before[p] == token, (p, token)
                checked_target += 1
        after = req.tokens + chain(drafted.get(rid))
        for module, calls in zip(drafter.modules, draft_calls, strict=True):
            for ids, positions in calls:
                for token, p in zip(ids, positions, strict=True):
                    assert after[p + module.shift] == token, (module.shift, p, token)
                    checked_draft += 1
    assert checked_target > 40 and checked_draft > 40


def test_tree_nodes_run_at_node_zero_plus_depth(ckpts: Checkpoints) -> None:
    engine = ckpts.engine("model", SpecConfig(num_steps=3, topk=2, num_draft_tokens=8))
    calls: Calls = []
    record(engine.model, calls, 0, 1)
    drafter: Any = engine.drafter
    drafted: dict[str, Tree] = {}
    step = drafter.step

    def spy(*args: Any) -> dict[str, Tree]:
        drafted.clear()
        drafted.update(step(*args))
        return drafted

    drafter.step = spy
    rid = engine.add_request(ragged_prompts()[3], greedy(30))
    req = engine._requests[rid]
    trees = 0
    while engine.has_unfinished():
        tree, base = drafted.get(rid), req.num_computed  # verified in this step
        calls.clear()
        engine.step()
        if tree is not None and len(tree) > 1:
            n = len(calls[0][0])  # the engine cuts trees near max_new_tokens
            assert n > 1 and calls[0] == (
                list(tree.tokens[:n]),
                [base + d for d in tree.depths[:n]],
            )
            trees += 1
    assert trees > 3


@pytest.mark.parametrize("page_size", [1, 16])
def test_compacted_kv_equals_a_fresh_prefill(ckpts: Checkpoints, page_size: int) -> None:
    spec = SpecConfig(num_steps=3, topk=4, num_draft_tokens=8)
    # The target as its own draft accepts deep paths through a tree: real KV moves.
    engine = Engine(
        ckpts.engine(None, None, page_size=page_size).config,
        drafter=ckpts.drafter("model", page_size=page_size, path=ckpts.target),  # type: ignore[arg-type]
        spec=spec,
    )
    moves = []
    real = verify_module.compact_accepted_ref

    def spy(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        moves.append(int((src != dst).sum()))
        real(caches, src, dst)

    verify_module.compact_accepted_ref = spy  # type: ignore[assignment]
    try:
        ids = [engine.add_request(p, greedy(64)) for p in ragged_prompts()]
        reqs = [engine._requests[i] for i in ids]
        while min(len(r.output_ids) for r in reqs) < 30:
            engine.step()
    finally:
        verify_module.compact_accepted_ref = real  # type: ignore[assignment]
    assert sum(moves) > 0, "no step moved KV: the test would prove nothing"
    fresh = ckpts.engine(None, None, page_size=page_size)
    for req in reqs:
        n = req.num_computed
        rid = fresh.add_request(req.tokens[:n], greedy(2))
        fresh.step()  # prefill: writes KV for positions 0..n-1
        ours = engine.kv.allocator.slot_mapping(req.request_id, 0, n)
        theirs = fresh.kv.allocator.slot_mapping(rid, 0, n)
        for a, b in zip(
            engine.kv.k_caches + engine.kv.v_caches,
            fresh.kv.k_caches + fresh.kv.v_caches,
            strict=True,
        ):
            torch.testing.assert_close(a[ours], b[theirs], atol=1e-5, rtol=0)
        fresh.abort(rid)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_p=0.95, seed=seed, max_new_tokens=24, ignore_eos=True
    )


def test_same_seed_same_output(ckpts: Checkpoints) -> None:
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    prompts = ragged_prompts()
    params = [sampled(100 + i) for i in range(len(prompts))]
    runs = [
        [r.token_ids for r in ckpts.engine("eagle3", spec).generate(prompts, params)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    other = ckpts.engine("eagle3", spec).generate(prompts, [sampled(7)] * len(prompts))
    assert [r.token_ids for r in other] != runs[0]


def test_target_randomness_does_not_depend_on_the_draft(
    ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Coins and residual noise come from the request's own stream in a fixed block per step:
    with two different drafts the k-th verification of a request sees the same randomness."""
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    draws: list[list[tuple[list[float], list[float]]]] = []
    real = reference.verify_sampling_ref

    def spy(
        tokens: torch.Tensor,
        probs: torch.Tensor,
        coins: torch.Tensor,
        noise: torch.Tensor,
        *rest: Any,
    ) -> Any:
        draws[-1].append((coins[0].tolist(), noise[0, :8].tolist()))
        return real(tokens, probs, coins, noise, *rest)

    monkeypatch.setattr(verify_module, "verify_sampling_ref", spy)
    accepted = []
    base = ckpts.engine(None, None).config
    for drafter in (
        ckpts.drafter("model", path=ckpts.target),  # the target itself: accepts a lot
        ckpts.drafter("eagle3"),
        ckpts.drafter("ngram"),
    ):
        draws.append([])
        engine = Engine(base, drafter=drafter, spec=spec)  # type: ignore[arg-type]
        result = engine.generate([ragged_prompts()[3]], [sampled(42)])[0]
        accepted.append(result.stats.accept_lengths)
    n = min(len(d) for d in draws)
    assert n > 5
    assert accepted[0] != accepted[1], "the drafts should differ for this test to mean much"
    for step in range(n):
        (coins_a, noise_a), *others = (d[step] for d in draws)
        for coins_b, noise_b in others:
            # The verifier sees the coins of the tree's nodes: a prefix of the same block.
            k = min(len(coins_a), len(coins_b))
            assert coins_a[:k] == coins_b[:k] and noise_a == noise_b


def test_an_abort_while_idle_frees_the_draft_too(ckpts: Checkpoints) -> None:
    engine = ckpts.engine("eagle3", SpecConfig(num_steps=3, topk=1))
    drafter: Any = engine.drafter
    rid = engine.add_request(ragged_prompts()[3], greedy(40))
    for _ in range(3):
        engine.step()
    assert drafter.num_tracked() == 1
    engine.abort(rid)
    assert drafter.num_tracked() == 1  # the draft hears of it with the next message
    engine.flush_draft()
    assert drafter.num_tracked() == 0
    for kv in drafter.kvs:
        assert kv.allocator.num_free_pages == kv.allocator.num_pages
    assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages
