"""A request as the engine tracks it: tokens so far, KV progress, sampling state, outcome."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tandem.sampling import SamplingParams
from tandem.spec.types import NoTree, SpecStats, Tree


class FinishReason(enum.Enum):
    """Why a request stopped (mirrors ``tandem.v1.FinishReason``)."""

    STOP = "stop"  # a stop or EOS token
    LENGTH = "length"  # max_new_tokens or the model's context length
    ABORT = "abort"  # the client or the operator aborted it


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely tokens at one position and their log-probabilities, most likely first."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass(eq=False, kw_only=True)
class Request:
    """One generation. ``num_computed`` tokens of ``tokens`` have their KV written."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    # Per generated token, the ``params.top_logprobs`` most likely tokens (where asked).
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    speculate: bool = True  # per-request opt-out; False decodes with trees of one node
    tree: Tree | None = None  # the draft's proposal for the next step, node 0 = tokens[-1]
    in_draft: bool = False  # the draft tracks it (admitted after its prompt, until released)
    # Its prompt is on its way into a draft service (``DraftExchange``): it sits out speculating
    # steps until the draft has taken it in and its first tree is back.
    parked: bool = False
    readmissions: int = 0  # times it was recomputed to go back into a draft that had lost it
    miss: NoTree | None = None  # why it has no tree for its next step, where known
    lane: int = 0  # the group it steps with (docs/design.md section 5)
    trace_context: dict[str, str] = field(default_factory=dict)  # for the draft's span
    draft_seq: int = 0  # submissions to the draft so far; a tree answers the latest one only
    # Target features of the prompt positions, gathered chunk by chunk for the draft.
    draft_features: list[torch.Tensor] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    # The ids ``params.min_tokens`` holds back: its stop tokens, and EOS unless it ignores EOS.
    min_tokens_block: tuple[int, ...] = ()

    @property
    def decoding(self) -> bool:
        """Past its prompt: only the verified token lacks KV."""
        return self.num_computed == self.num_tokens - 1 and bool(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def length_limit(self, max_model_len: int) -> int:
        """The token count at which it finishes by length: ``max_new_tokens`` or the context."""
        return min(max_model_len, len(self.prompt_ids) + self.params.max_new_tokens)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # where asked
    finished: bool
    finish_reason: FinishReason | None
