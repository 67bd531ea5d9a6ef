"""What one engine step is: the plan it runs (``StepPlan``), what it returns (``StepResult``)
and the interface of the step modes that run it (``StepMode``).

``Engine.step`` plans a step, hands the plan to its modes in order until one takes it, and
records the result's time and the policy's measure once. A mode that holds launched steps not
read yet (decoding ahead, a device-chain run) takes every plan it cannot continue with and
reads them first (a drain): the next step then finds it idle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from tandem.clock import StepTiming
from tandem.request import RequestOutput
from tandem.spec.types import NoTree, SpecStats

MAX_LANES = 2  # lanes 0 and 1 (docs/design.md section 5)


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What the engine decided before a step runs."""

    lanes: frozenset[int]  # lanes with work (empty: only launched steps are left to read)
    lane: int  # the lane whose turn it is (the lanes with work take turns)
    last_lane: int  # the lane the last step ran
    speculate: bool  # the lane runs with trees (K > 0); False: K=0, plain decoding
    policy_batch: int  # the batch size the adaptive policy counts the step at; 0: not counted
    plain: NoTree | None = None  # why a step with a drafter runs K=0 (decode steps' counters)


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one step committed and how it went."""

    outputs: list[RequestOutput]  # per request that got tokens (or finished) this step
    stats: SpecStats = field(default_factory=SpecStats)  # its verifications, all requests
    timing: StepTiming = field(default_factory=StepTiming)
    lane: int  # the lane it ran (a merged K=0 step: the lane its submission went out on)
    speculated: bool = False  # whether it verified with K > 0
    measured: bool = False  # the adaptive policy counts it (a step of its chosen mode)
    settled: bool = True  # not a step of the draft's catch-up after K=0 (its trees missing)

    @property
    def num_committed(self) -> int:
        return sum(len(out.new_token_ids) for out in self.outputs)


class StepMode(ABC):
    """One way to run a step: ordinary (synchronous) verification, plain decoding ahead, or
    device-chain steps."""

    @abstractmethod
    def run(self, plan: StepPlan) -> StepResult | None:
        """Runs one step of ``plan`` in this mode (or reads what the mode launched, where it
        cannot go on); None when the mode does not take the plan: the next mode does."""


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request: the tokens of several read steps, in order."""
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        seen = merged.get(out.request_id)
        if seen is not None:
            out = RequestOutput(
                request_id=out.request_id,
                new_token_ids=seen.new_token_ids + out.new_token_ids,
                new_logprobs=seen.new_logprobs + out.new_logprobs,
                new_top_logprobs=seen.new_top_logprobs + out.new_top_logprobs,
                finished=out.finished,
                finish_reason=out.finish_reason,
            )
        merged[out.request_id] = out
    return list(merged.values())
