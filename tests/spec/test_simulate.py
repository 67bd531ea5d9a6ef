"""Simulated acceptance (perf only): the mean accept length is what was asked, the accepted
path goes into the deepest subtree (the first child on a tie), the bonus is the target's argmax,
a draw is a function of the prompt and the position (the same on the host and on a device), and
nothing leaks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.spec.simulate import (
    AcceptSimulator,
    expected_accepted,
    parse_accept_length,
    prompt_key,
    unit,
    unit_tensor,
)
from tandem.spec.types import SpecConfig, Tree
from tandem.spec.verify import verify
from tandem.target.engine import Engine
from tests.spec.conftest import Checkpoints, greedy, ragged_prompts

VOCAB = 97


def chain(rng: random.Random, steps: int) -> Tree:
    return Tree(
        tokens=tuple(rng.randrange(VOCAB) for _ in range(steps + 1)),
        parents=tuple(range(-1, steps)),
    )


@pytest.mark.parametrize("steps", [3, 5])
@pytest.mark.parametrize("accept_length", [1.5, 3.0])
def test_verify_accepts_the_asked_mean(steps: int, accept_length: float) -> None:
    rng = random.Random(0)
    simulator = AcceptSimulator(accept_length, steps, seed=1)
    params = SamplingParams(max_new_tokens=8)
    lengths: list[int] = []
    for _ in range(4):  # 4 verify steps of 500 requests
        trees = [chain(rng, steps) for _ in range(500)]
        reqs = [Request(request_id=str(i), prompt_ids=[i], params=params) for i in range(500)]
        logits = torch.randn(500 * (steps + 1), VOCAB)
        done = verify(logits, trees, reqs, coin_block=steps + 1, simulate=simulator)
        for b, (tree, v) in enumerate(zip(trees, done, strict=True)):
            k = len(v.accept_nodes) - 1
            assert v.accept_nodes == list(range(k + 1))  # a chain's first k drafts
            assert v.new_tokens[:-1] == list(tree.tokens[1 : k + 1])  # the drafts, committed
            assert v.new_tokens[-1] == int(logits[b * (steps + 1) + k].argmax())  # bonus
            lengths.append(k + 1)
    mean = sum(lengths) / len(lengths)
    assert abs(mean - accept_length) < 0.1
    assert min(lengths) >= 1 and max(lengths) <= steps + 1
    assert len(set(lengths)) > 1  # drawn, not constant


def test_solved_mean_is_exact_and_endpoints_are_constant() -> None:
    for steps in (1, 3, 5):
        for a in (1.2, 1.5, 2.0, 3.0):
            if a <= steps + 1:
                sim = AcceptSimulator(a, steps)
                assert expected_accepted(sim.mu, steps) == pytest.approx(a - 1, abs=1e-9)
    assert {AcceptSimulator(1.0, 3).draw(key, 9) for key in range(50)} == {0}
    assert {AcceptSimulator(4.0, 3).draw(key, 9) for key in range(50)} == {3}


def test_a_draw_is_a_function_of_seed_prompt_and_position() -> None:
    a, b = AcceptSimulator(2.5, 4, seed=7), AcceptSimulator(2.5, 4, seed=7)
    params = SamplingParams(max_new_tokens=8)
    one = Request(request_id="x", prompt_ids=[3, 1, 4], params=params)
    two = Request(request_id="y", prompt_ids=[3, 1, 4], params=params)  # same prompt
    assert a.key(one) == b.key(two) == prompt_key([3, 1, 4], 7) != prompt_key([3, 1, 4], 8)
    assert prompt_key([3, 1, 4]) != prompt_key([3, 1, 5])
    draws = [a.draw(a.key(one), p) for p in range(400)]
    assert draws == [b.draw(b.key(two), p) for p in range(400)]
    assert set(draws) == set(range(5))  # every depth of S=4 drawn
    other = AcceptSimulator(2.5, 4, seed=8)
    assert draws != [other.draw(other.key(one), p) for p in range(400)]


def test_the_device_draws_the_hosts_bits() -> None:
    """``unit_tensor`` (the device chain's draw, inside its graph) equals ``unit`` bit for bit,
    over the whole int64 range of keys."""
    rng = random.Random(3)
    keys = [rng.randrange(-(2**63), 2**63) for _ in range(4000)] + [0, -1, 2**63 - 1, -(2**63)]
    positions = [rng.randrange(0, 1 << 20) for _ in keys]
    for device in ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]:
        drawn = unit_tensor(
            torch.tensor(keys, device=device), torch.tensor(positions, device=device)
        )
        assert drawn.tolist() == [unit(k, p) for k, p in zip(keys, positions, strict=True)]
    units = [unit(k, p) for k, p in zip(keys, positions, strict=True)]
    assert min(units) >= 0.0 and max(units) < 1.0
    assert abs(sum(units) / len(units) - 0.5) < 0.02


def test_trees_follow_the_deepest_first_child_and_stop_at_leaves() -> None:
    #      0
    #    1   2       node 1's first child is 3, node 3 has none
    #    3   4
    tree = Tree(tokens=(0, 1, 2, 3, 4), parents=(-1, 0, 0, 1, 2))
    sim = AcceptSimulator(4.0, 3)  # always 3 deep, but the tree is 2 deep along first children
    assert sim.path(tree, 1, 2) == [0, 1, 3]
    assert sim.path(Tree(tokens=(5,), parents=(-1,)), 1, 2) == [0]
    #      0
    #    1   2       node 1 is a leaf: the path takes node 2's deeper branch
    #        3 4
    #        5
    deep = Tree(tokens=(0, 1, 2, 3, 4, 5), parents=(-1, 0, 0, 2, 2, 3))
    assert sim.path(deep, 1, 2) == [0, 2, 3, 5]


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="simulate_accept_length"):
        AcceptSimulator(4.5, 3)
    with pytest.raises(ValueError, match="TANDEM_SIMULATE_ACCEPT_LENGTH"):
        parse_accept_length("x", 3)
    with pytest.raises(ValueError, match="needs a draft"):
        parse_accept_length("2", None)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        parse_accept_length("5", 3)
    assert parse_accept_length("2.5", 3) == 2.5
    with pytest.raises(ValueError, match="simulate_accept_length"):
        EngineConfig(model="x", simulate_accept_length=0.5)  # type: ignore[arg-type]


def test_engine_simulates_and_frees_everything(ckpts: Checkpoints) -> None:
    spec = SpecConfig(num_steps=3, topk=1)
    config = EngineConfig(model=ckpts.target, simulate_accept_length=3.0)
    engine = Engine(config, drafter=ckpts.drafter("eagle3"), spec=spec)  # type: ignore[arg-type]
    results = engine.generate(ragged_prompts(), greedy(96))
    drafts = sum(r.stats.drafts for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert drafts > 60
    assert abs(accepted / drafts + 1 - 3.0) < 0.3  # the random draft alone accepts ~nothing
    assert all(len(r.token_ids) == 96 for r in results)
    alloc = engine.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages and len(alloc) == 0
    assert engine.drafter is not None and engine.drafter.num_tracked() == 0


def test_simulation_needs_a_drafter(ckpts: Checkpoints) -> None:
    with pytest.raises(ValueError, match="needs speculation"):
        Engine(EngineConfig(model=ckpts.target, simulate_accept_length=2.0))


def test_target_service_takes_it_from_the_environment_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from target_service.__main__ import _config, build_parser

    parser = build_parser()
    assert not any("simulate" in action.dest for action in parser._actions)  # no flag
    with_draft = ["--target", str(tmp_path), "--draft-addr", "127.0.0.1:1"]
    assert _config(parser.parse_args(with_draft)).engine.simulate_accept_length is None
    monkeypatch.setenv("TANDEM_SIMULATE_ACCEPT_LENGTH", "2.5")
    assert _config(parser.parse_args(with_draft)).engine.simulate_accept_length == 2.5
    with pytest.raises(ValueError, match="needs a draft"):
        _config(parser.parse_args(["--target", str(tmp_path)]))
    monkeypatch.setenv("TANDEM_SIMULATE_ACCEPT_LENGTH", "9")
    with pytest.raises(ValueError, match="TANDEM_SIMULATE_ACCEPT_LENGTH"):
        _config(parser.parse_args(with_draft))
