"""The gateway's lane policy: one lane at low load, two from the threshold on, back to one
below half of it, balanced in between; every request is always in exactly one lane."""

from __future__ import annotations

import random

import pytest

from gateway.lanes import LanePlanner, Move


def apply(lanes: dict[str, int], moves: list[Move]) -> None:
    for move in moves:
        for request_id in move.request_ids:
            assert request_id in lanes, "a move for a request the planner does not run"
            lanes[request_id] = move.lane


def test_one_lane_below_the_threshold() -> None:
    planner = LanePlanner(4)
    for i in range(3):
        assert planner.admit(f"r{i}") == (0, [])
    assert planner.num_lanes == 1 and planner.sizes() == [3]


def test_the_threshold_splits_the_newest_half_off() -> None:
    planner = LanePlanner(4)
    lanes = {}
    for i in range(3):
        lanes[f"r{i}"], _ = planner.admit(f"r{i}")
    lane, moves = planner.admit("r3")
    lanes["r3"] = lane
    apply(lanes, moves)
    assert planner.num_lanes == 2
    assert moves == [Move(["r2"], 1)] and lane == 1  # r3 joins the smaller lane
    assert lanes == {"r0": 0, "r1": 0, "r2": 1, "r3": 1} and planner.sizes() == [2, 2]


def test_back_to_one_lane_below_half_the_threshold() -> None:
    planner = LanePlanner(4)
    lanes = {}
    for i in range(4):
        lane, moves = planner.admit(f"r{i}")
        lanes[f"r{i}"] = lane
        apply(lanes, moves)
    apply(lanes, planner.finish("r0"))
    del lanes["r0"]
    assert planner.num_lanes == 2  # 3 >= 4 // 2: hysteresis keeps two
    apply(lanes, planner.finish("r1"))
    del lanes["r1"]
    assert planner.num_lanes == 2
    moves = planner.finish("r2")
    del lanes["r2"]
    apply(lanes, moves)
    assert planner.num_lanes == 1 and lanes == {"r3": 0} and planner.sizes() == [1]


def test_zero_keeps_one_lane() -> None:
    planner = LanePlanner(0)
    for i in range(100):
        assert planner.admit(f"r{i}") == (0, [])
    assert planner.sizes() == [100]


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_stays_consistent_and_balanced(seed: int) -> None:
    rng = random.Random(seed)
    planner = LanePlanner(8)
    lanes: dict[str, int] = {}
    for step in range(2000):
        if lanes and (rng.random() < 0.5 or len(lanes) > 40):
            request_id = rng.choice(sorted(lanes))
            del lanes[request_id]
            apply(lanes, planner.finish(request_id))
        else:
            request_id = f"r{step}"
            lane, moves = planner.admit(request_id)
            lanes[request_id] = lane
            apply(lanes, moves)
        assert all(planner.lane_of(r) == lane for r, lane in lanes.items())
        sizes = planner.sizes()
        assert sum(sizes) == len(lanes) and len(sizes) == planner.num_lanes
        if planner.num_lanes == 1:
            assert len(lanes) < 8
            assert set(lanes.values()) <= {0}
        else:
            assert len(lanes) >= 4
            assert abs(sizes[0] - sizes[1]) <= max(1, len(lanes) // 4) + 1


def test_errors() -> None:
    with pytest.raises(ValueError, match="two_lane_batch"):
        LanePlanner(-1)
    planner = LanePlanner(2)
    planner.admit("a")
    with pytest.raises(ValueError, match="already"):
        planner.admit("a")
    assert planner.finish("unknown") == []
