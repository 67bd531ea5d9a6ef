"""Lanes: which group each running request steps with (docs/design.md section 5).

The target steps one lane at a time and the draft drafts a lane while the target verifies the
other, so with two lanes neither service waits for the other; the price is that each request
steps every other forward. That pays when the batch is large (a forward is long enough to hide
a draft step behind), not at low load, where one lane gives the lowest latency. So:

- one lane while fewer than ``two_lane_batch`` requests run (0 keeps one lane always);
- at ``two_lane_batch`` the newest half of lane 0 moves to lane 1, and new requests join the
  smaller lane;
- back to one lane when the running set falls below half the threshold (hysteresis, so a batch
  near the threshold does not flap), moving lane 1's requests into lane 0;
- in between, finishing requests can unbalance the lanes: when they differ by more than a
  quarter of the batch (and by more than one), the newest of the larger lane move over.

The planner only decides; the gateway sends each admit's lane and every move to the target,
which applies them between steps (a moved request decodes its next step without a tree at
worst, never with a stale one).
"""

from __future__ import annotations

from dataclasses import dataclass

NUM_LANES = 2


@dataclass(frozen=True)
class Move:
    """Requests to move to ``lane``."""

    request_ids: list[str]
    lane: int


class LanePlanner:
    def __init__(self, two_lane_batch: int) -> None:
        if two_lane_batch < 0:
            raise ValueError(f"two_lane_batch must be >= 0, got {two_lane_batch}")
        self.two_lane_batch = two_lane_batch
        self.num_lanes = 1
        self._lane: dict[str, int] = {}  # running request -> lane, in admission order

    def lane_of(self, request_id: str) -> int | None:
        return self._lane.get(request_id)

    def sizes(self) -> list[int]:
        """Requests per lane in use."""
        sizes = [0] * self.num_lanes
        for lane in self._lane.values():
            sizes[lane] += 1
        return sizes

    def admit(self, request_id: str) -> tuple[int, list[Move]]:
        """The new request's lane, and the moves its arrival causes (a switch to two lanes)."""
        if request_id in self._lane:
            raise ValueError(f"request {request_id!r} already has a lane")
        moves = self._switch(len(self._lane) + 1)
        sizes = self.sizes()
        lane = min(range(self.num_lanes), key=lambda n: (sizes[n], n))
        self._lane[request_id] = lane
        return lane, moves

    def finish(self, request_id: str) -> list[Move]:
        """Forgets a request; the moves that rebalance what remains. Unknown ids: no-op."""
        if self._lane.pop(request_id, None) is None:
            return []
        moves = self._switch(len(self._lane))
        if self.num_lanes == 2:
            moves += self._balance()
        return moves

    def _switch(self, running: int) -> list[Move]:
        if self.num_lanes == 1 and self.two_lane_batch and running >= self.two_lane_batch:
            self.num_lanes = 2
            lane0 = list(self._lane)
            return self._move(lane0[len(lane0) - len(lane0) // 2 :], 1)
        if self.num_lanes == 2 and running < max(1, self.two_lane_batch // 2):
            self.num_lanes = 1
            return self._move([r for r, lane in self._lane.items() if lane == 1], 0)
        return []

    def _balance(self) -> list[Move]:
        sizes = self.sizes()
        big = 0 if sizes[0] > sizes[1] else 1
        gap = sizes[big] - sizes[1 - big]
        if gap <= max(1, sum(sizes) // 4):
            return []
        members = [r for r, lane in self._lane.items() if lane == big]
        return self._move(members[len(members) - gap // 2 :], 1 - big)

    def _move(self, request_ids: list[str], lane: int) -> list[Move]:
        if not request_ids:
            return []
        for request_id in request_ids:
            self._lane[request_id] = lane
        return [Move(request_ids, lane)]
