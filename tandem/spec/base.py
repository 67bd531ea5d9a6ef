"""The interface every drafter implements: one call per step, as on the wire.

The engine talks to a drafter per lane (docs/design.md section 5): ``submit(lane, ...)`` hands over
what the lane's verification committed, ``collect(lane)`` returns the trees for the lane's next
step. An in-process drafter does the work inside ``submit``; the remote one only sends there,
so the draft service drafts lane B while the target verifies lane A.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.spec.chain import DraftHalf
from tandem.spec.types import DraftAdmit, SpecConfig, Tree, VerifyOutcome

logger = logging.getLogger(__name__)


class DraftState(enum.IntEnum):
    """The draft as the target sees it (the values are ``tandem.v1.DraftState``'s)."""

    DISABLED = 1  # no draft: the target decodes alone
    CONNECTING = 2  # a draft service, no stream established yet
    HEALTHY = 3  # answering within its deadlines (an in-process drafter always is)
    UNHEALTHY = 4  # late, or gone and reconnecting


@dataclass(frozen=True, kw_only=True)
class DraftStatus:
    """What the target reports of its drafter (``GetServerInfo``, metrics)."""

    state: DraftState
    kv_pages_total: int = 0  # the draft's KV pool after its last answer (0: not known)
    kv_pages_used: int = 0
    kv_page_size: int = 0
    fallback_steps: int = 0  # steps that went without their trees (a late or gone draft)


class Drafter(ABC):
    """Proposes trees. ``target_layer_ids`` are the target features it needs (transformers'
    ``hidden_states`` numbering, concatenated in this order); empty for token-only drafts."""

    target_layer_ids: tuple[int, ...] = ()
    # Whether submissions cross a wire (a draft service): then the exchange paces the features
    # it sends per step (HELD_BYTES_PER_STEP) so one message stays far below its cap. In
    # process a speculating step sends everything due at once (only K=0 flushes are paced).
    remote: bool = False
    # A draft service whose prompts travel through a buffer it shares on this host
    # (``tandem.link.prompt_ring.PromptRing``): taking them in costs no serialisation.
    shares_prompts: bool = False
    # Time spent in draft model compute (forwards, logits, top-k) so far, host clock; for a
    # remote draft, what its answers reported. Benchmarks subtract it from cycle times.
    model_ns: int = 0

    @abstractmethod
    def step(
        self,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> dict[str, Tree]:
        """Applies one step's updates and returns the next tree of each updated request. A
        request without a tree decodes without speculation this step (a late draft, say)."""

    def submit(
        self,
        lane: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> None:
        """Hands the draft one lane's updates; ``collect(lane)`` returns the trees. At most one
        submission per lane is outstanding: the engine collects before it submits again."""
        self._answers()[lane] = self.step(admits, outcomes, released)

    def collect(self, lane: int) -> dict[str, Tree]:
        """The trees answering the lane's last submission ({} when there is none, or when
        the answer missed its deadline)."""
        return self._answers().pop(lane, {})

    def in_flight(self, lane: int) -> bool:
        """True while the lane's last submission is still being drafted (or travelling)."""
        return False

    def wait_sent(self, lane: int) -> None:
        """Returns once the lane's last submission has left this process (in process: at
        once). A remote drafter sends from its own thread, which otherwise waits for the
        GIL while the engine thread finishes the step."""
        return None

    def poll(self) -> None:
        """Handles what a remote draft has sent meanwhile without waiting (late answers, a
        closed connection); the engine calls it when idle. Most drafters have nothing to do."""
        return None

    def behind(self) -> bool:
        """Whether an answer that missed its deadline is still to come: the draft is still
        drafting a step the engine has decoded without, so it decodes plainly (holding its
        outcomes, as K=0 does) until that answer is in, rather than queue more steps behind
        it. In process: never."""
        return False

    def _answers(self) -> dict[int, dict[str, Tree]]:
        # Created on first use, so subclasses need not call an __init__ of this ABC.
        answers: dict[int, dict[str, Tree]] = vars(self).setdefault("_lane_answers", {})
        return answers

    def take_dropped(self) -> list[str]:
        """Requests whose draft state was lost since the last call (a full draft pool, a
        restarted draft service); they are not sent to the draft again."""
        return []

    def num_tracked(self) -> int:
        """Requests this drafter holds state for (0 after every release: a tested invariant)."""
        return 0

    def status(self) -> DraftStatus:
        """The drafter's state as the target reports it; in process it is always healthy."""
        return DraftStatus(state=DraftState.HEALTHY)

    def use_graphs(
        self,
        *,
        batch_sizes: Sequence[int],
        max_model_len: int,
        num_steps: Sequence[int] = (),
        trees: Sequence[SpecConfig] = (),
        capture: bool = True,
    ) -> bool:
        """Captures the draft's CUDA graphs for the target's batch buckets (the draft follows
        the target), chains of each S in ``num_steps`` and trees (K > 1) of each shape in
        ``trees``; False where this drafter has none (an n-gram draft; a draft service
        captures its own)."""
        logger.info("draft graphs: not available for %s; drafting eagerly", type(self).__name__)
        return False

    def chain_problem(self) -> str:
        """Why this drafter cannot take the draft's half of device-chain steps ('' when it
        can; a draft service says at each run's start whether it takes the run)."""
        return "needs a draft service or an in-process drafter with draft graphs"

    def chain_half(self, num_steps: int, device: torch.device) -> DraftHalf:
        """The draft's half of device-chain runs of ``num_steps`` drafts on ``device`` (the
        target's); only where ``chain_problem()`` is ''."""
        raise ValueError(f"device chain: {self.chain_problem()}")
