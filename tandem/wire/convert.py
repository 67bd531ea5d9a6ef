"""Protobuf <-> domain conversion of the contract's messages (sampling, speculation, trees,
admits, outcomes, finish reasons, usage).

Everything that comes in is validated and raises `InvalidRequest` with a dotted path
(``new_requests[2].sampling.top_p``); the `*_to_proto` side writes every value explicitly, so
a receiver never needs the sender's defaults. Floats travel as float32.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence

import torch

from tandem.errors import InvalidRequest
from tandem.request import FinishReason
from tandem.sampling import SamplingParams
from tandem.spec.types import DraftAdmit, NoTree, SpecConfig, SpecStats, Tree, VerifyOutcome
from tandem.v1 import common_pb2, draft_pb2
from tandem.wire.frames import MAX_FRAME_BYTES, Expected, _field, tensor_from_frames
from tandem.wire.framing import add_frames, tensor_to_frames

HIDDEN_STATES = "hidden_states"  # TensorFrame.name of prompt and outcome features
MAX_TEMPERATURE = 2.0  # common.proto's bound (vLLM's)

_DRAFT_KINDS: dict[str, common_pb2.DraftKind] = {
    "eagle3": common_pb2.DRAFT_KIND_EAGLE3,
    "eagle": common_pb2.DRAFT_KIND_EAGLE,
    "mtp": common_pb2.DRAFT_KIND_MTP,
    "model": common_pb2.DRAFT_KIND_MODEL,
    "ngram": common_pb2.DRAFT_KIND_NGRAM,
}
_KIND_NAMES = {v: k for k, v in _DRAFT_KINDS.items()}
_FINISH_REASONS = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_SPEC_FIELDS = ("num_steps", "topk", "num_draft_tokens")


def draft_kind_to_proto(kind: str | None) -> common_pb2.DraftKind:
    """``--draft-kind`` name (None: unspecified) -> `DraftKind`; ValueError if unknown."""
    if kind is None:
        return common_pb2.DRAFT_KIND_UNSPECIFIED
    try:
        return _DRAFT_KINDS[kind]
    except KeyError:
        raise ValueError(f"draft kind {kind!r} is not one of {sorted(_DRAFT_KINDS)}") from None


def draft_kind_from_proto(value: int, *, field: str = "draft_kind") -> str | None:
    """`DraftKind` -> name; None when unspecified."""
    if value == common_pb2.DRAFT_KIND_UNSPECIFIED:
        return None
    try:
        return _KIND_NAMES[value]  # type: ignore[index]
    except KeyError:
        raise InvalidRequest(field, f"unknown draft kind {value}") from None


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field explicit (``seed`` only when set); stop strings and logprobs are not part of
    the domain's SamplingParams and stay unset."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias),
        top_logprobs=params.top_logprobs,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_proto(
    msg: common_pb2.SamplingParams, *, default_max_new_tokens: int, field: str = "sampling"
) -> SamplingParams:
    """Validated SamplingParams with common.proto's defaults for unset fields (temperature,
    top_p and repetition_penalty 1.0; max_new_tokens ``default_max_new_tokens``, e.g. what is
    left of the context). ``stop_strings`` and ``logprobs`` are ignored here: the gateway
    matches stop strings itself and reads both from the message."""
    temperature = msg.temperature if msg.HasField("temperature") else 1.0
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise InvalidRequest(
            _field(field, "temperature"), f"must be in [0, {MAX_TEMPERATURE}], got {temperature}"
        )
    try:
        return SamplingParams(
            temperature=temperature,
            top_k=msg.top_k,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            min_p=msg.min_p,
            repetition_penalty=(
                msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0
            ),
            seed=msg.seed if msg.HasField("seed") else None,
            max_new_tokens=(
                msg.max_new_tokens if msg.HasField("max_new_tokens") else default_max_new_tokens
            ),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            min_tokens=msg.min_tokens,
            logit_bias=tuple(msg.logit_bias.items()),
            top_logprobs=msg.top_logprobs,
        )
    except InvalidRequest as exc:
        raise InvalidRequest(_field(field, exc.field), exc.reason) from None


def spec_to_proto(spec: SpecConfig | None, kind: str | None = None) -> common_pb2.SpeculationParams:
    """Explicit settings: ``enabled`` always set; S, K and N (resolved) when enabled."""
    msg = common_pb2.SpeculationParams(
        enabled=spec is not None, draft_kind=draft_kind_to_proto(kind)
    )
    if spec is not None:
        msg.num_steps, msg.topk, msg.num_draft_tokens = spec.num_steps, spec.topk, spec.tree_size
    return msg


def spec_from_proto(
    msg: common_pb2.SpeculationParams,
    default: SpecConfig | None,
    *,
    field: str = "speculation",
    deployed_kind: str | None = None,
) -> SpecConfig | None:
    """The SpecConfig in force, or None for no speculation.

    None when ``enabled`` is false or K is 0, and when nothing is set and there is no
    ``default`` (the policy is off). Otherwise unset S and K come from ``default`` (or
    SpecConfig's defaults); unset N is the default's when neither S nor K was given, else the
    chain size S+1. A ``draft_kind`` other than ``deployed_kind`` (when given) is refused.
    """
    kind = draft_kind_from_proto(msg.draft_kind, field=_field(field, "draft_kind"))
    if kind is not None and deployed_kind is not None and kind != deployed_kind:
        raise InvalidRequest(
            _field(field, "draft_kind"), f"{kind} requested, {deployed_kind} deployed"
        )
    given = {name: getattr(msg, name) for name in _SPEC_FIELDS if msg.HasField(name)}
    if (msg.HasField("enabled") and not msg.enabled) or given.get("topk") == 0:
        return None
    if default is None and not given and not msg.enabled:
        return None
    base = default or SpecConfig()
    num_draft_tokens = given.get("num_draft_tokens")
    if num_draft_tokens is None and not given:
        num_draft_tokens = base.num_draft_tokens
    elif num_draft_tokens is not None and num_draft_tokens < 2:
        raise InvalidRequest(
            _field(field, "num_draft_tokens"), f"must be >= 2 when set, got {num_draft_tokens}"
        )
    num_steps = given.get("num_steps", base.num_steps)
    if num_draft_tokens == num_steps + 1:
        num_draft_tokens = None  # the chain size, in SpecConfig's canonical spelling
    try:
        return SpecConfig(
            num_steps=num_steps,
            topk=given.get("topk", base.topk),
            num_draft_tokens=num_draft_tokens,
        )
    except InvalidRequest as exc:
        raise InvalidRequest(_field(field, exc.field), exc.reason) from None


def tree_to_proto(request_id: str, tree: Tree) -> draft_pb2.Tree:
    return draft_pb2.Tree(request_id=request_id, token_ids=tree.tokens, parent_indices=tree.parents)


def tree_from_proto(msg: draft_pb2.Tree, *, path: str = "tree") -> tuple[str, Tree]:
    """(request id, Tree) after shape checks only; the target runs `Tree.check` (ids in its
    vocabulary, parents before children, node 0 the verified token) before verifying."""
    _require_id(msg.request_id, path)
    n = len(msg.token_ids)
    if n < 1:
        raise InvalidRequest(_field(path, "token_ids"), "a tree has at least node 0")
    if len(msg.parent_indices) != n:
        raise InvalidRequest(
            _field(path, "parent_indices"), f"{len(msg.parent_indices)} entries for {n} nodes"
        )
    if msg.draft_logprobs and len(msg.draft_logprobs) != n:
        raise InvalidRequest(
            _field(path, "draft_logprobs"), f"{len(msg.draft_logprobs)} entries for {n} nodes"
        )
    return msg.request_id, Tree(tokens=tuple(msg.token_ids), parents=tuple(msg.parent_indices))


def admit_to_proto(
    admit: DraftAdmit, max_frame_bytes: int = MAX_FRAME_BYTES
) -> tuple[draft_pb2.DraftAdmit, draft_pb2.PromptFrames | None]:
    """The admit and, when it has features, their frames (each <= ``max_frame_bytes``
    serialized). The draft seed is 0: proposals are deterministic (architecture.md)."""
    if not admit.token_ids:
        raise ValueError("token_ids: an admit carries at least the verified token")
    msg = draft_pb2.DraftAdmit(
        request_id=admit.request_id,
        prompt_token_ids=admit.token_ids[:-1],
        verified_token_id=admit.token_ids[-1],
        sampling=common_pb2.SamplingParams(temperature=admit.temperature),
        speculation=spec_to_proto(admit.spec),
        trace_context=common_pb2.TraceContext(carrier=admit.trace_context),
    )
    if admit.features is None:
        return msg, None
    frames = tensor_to_frames(HIDDEN_STATES, admit.features, max_chunk_bytes=max_frame_bytes)
    return msg, draft_pb2.PromptFrames(request_id=admit.request_id, frames=frames)


def admit_from_proto(
    msg: draft_pb2.DraftAdmit,
    features: torch.Tensor | None,  # [len(prompt_token_ids), F], from the admit's PromptFrames
    *,
    default_spec: SpecConfig | None,
    path: str = "new_request",
    features_field: str = "prompt_frames",
    vocab_size: int | None = None,
    feature_size: int | None = None,
) -> DraftAdmit:
    """A validated DraftAdmit; its speculation resolves against ``default_spec`` and must be
    on (a request the draft tracks speculates)."""
    _require_id(msg.request_id, path)
    _check_ids(msg.prompt_token_ids, vocab_size, _field(path, "prompt_token_ids"))
    _check_ids([msg.verified_token_id], vocab_size, _field(path, "verified_token_id"))
    spec = spec_from_proto(msg.speculation, default_spec, field=_field(path, "speculation"))
    if spec is None:
        raise InvalidRequest(_field(path, "speculation"), "a request sent to the draft speculates")
    sampling = sampling_from_proto(
        msg.sampling, default_max_new_tokens=1, field=_field(path, "sampling")
    )
    if features is not None:
        _check_features(features, len(msg.prompt_token_ids), feature_size, features_field)
    return DraftAdmit(
        request_id=msg.request_id,
        token_ids=[*msg.prompt_token_ids, msg.verified_token_id],
        features=features,
        spec=spec,
        temperature=sampling.temperature,
        trace_context=dict(msg.trace_context.carrier),
    )


def admit_with_features(
    admit: DraftAdmit,
    features: torch.Tensor,
    *,
    num_prompt_tokens: int,
    field: str = "prompt_frames",
    feature_size: int | None = None,
) -> DraftAdmit:
    """``admit`` (from ``admit_from_proto``, validated) with its prompt's features, once they
    have arrived: checked as ``admit_from_proto`` checks them ([num_prompt_tokens, F] floats),
    the rest not converted again."""
    _check_features(features, num_prompt_tokens, feature_size, field)
    return dataclasses.replace(admit, features=features)


def outcome_to_proto(
    outcome: VerifyOutcome,
    committed_len: int,
    *,
    accepted_node_indices: Sequence[int] = (),
    max_frame_bytes: int = MAX_FRAME_BYTES,
    into: draft_pb2.VerifyOutcome | None = None,
) -> draft_pb2.VerifyOutcome:
    """``committed_len``: committed tokens after this step, bonus included. The domain outcome
    does not carry the accepted nodes' tree indices; pass them when known. ``into``: an empty
    message to fill (``request.outcomes.add()``: appending a built one copies its features
    once more)."""
    msg = draft_pb2.VerifyOutcome() if into is None else into
    msg.request_id = outcome.request_id
    msg.accepted_token_ids.extend(outcome.accepted_token_ids)
    msg.bonus_token_id = outcome.bonus_token_id
    msg.committed_len = committed_len
    msg.accepted_node_indices.extend(accepted_node_indices)
    if outcome.features is not None:
        add_frames(
            msg.hidden_states, HIDDEN_STATES, outcome.features, max_chunk_bytes=max_frame_bytes
        )
    return msg


def outcome_from_proto(
    msg: draft_pb2.VerifyOutcome,
    max_bytes: int,
    *,
    path: str = "outcome",
    vocab_size: int | None = None,
    feature_size: int | None = None,
    feature_dtype: torch.dtype | None = None,
    shared: Callable[[int, int], torch.Tensor] | None = None,
) -> VerifyOutcome:
    """A validated VerifyOutcome (features None when no frames came); ``max_bytes`` caps the
    feature tensor; ``shared`` reads a frame that names a shared buffer's bytes
    (``FrameAssembler``); with ``feature_size`` and ``feature_dtype`` (what the stream
    negotiated) the frames' header must announce exactly [accepted + 1, feature_size] of it.
    ``committed_len`` is only checked for consistency here (>= accepted + 2); a receiver that
    tracks lengths compares it with its own."""
    _require_id(msg.request_id, path)
    num_accepted = len(msg.accepted_token_ids)
    _check_ids(msg.accepted_token_ids, vocab_size, _field(path, "accepted_token_ids"))
    _check_ids([msg.bonus_token_id], vocab_size, _field(path, "bonus_token_id"))
    if msg.committed_len < num_accepted + 2:
        raise InvalidRequest(
            _field(path, "committed_len"),
            f"{msg.committed_len} is less than the accepted tokens + verified + bonus",
        )
    nodes = list(msg.accepted_node_indices)
    if nodes and (len(nodes) != num_accepted + 1 or nodes[0] != 0):
        raise InvalidRequest(
            _field(path, "accepted_node_indices"), f"expected 0 then {num_accepted} node indices"
        )
    if any(b <= a for a, b in itertools.pairwise(nodes)):
        raise InvalidRequest(_field(path, "accepted_node_indices"), "must be increasing")
    features = None
    if msg.hidden_states:
        field = _field(path, "hidden_states")
        expect = None
        if feature_size is not None and feature_dtype is not None:
            expect = Expected(feature_dtype, (num_accepted + 1, feature_size))
        features = tensor_from_frames(
            msg.hidden_states, max_bytes=max_bytes, path=field, shared=shared, expect=expect
        )
        _check_features(features, num_accepted + 1, feature_size, field)
    return VerifyOutcome(
        request_id=msg.request_id,
        accepted_token_ids=list(msg.accepted_token_ids),
        bonus_token_id=msg.bonus_token_id,
        features=features,
    )


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason:
    """None (still running) is FINISH_REASON_UNSPECIFIED."""
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_REASONS[reason]


def finish_reason_from_proto(value: int, *, field: str = "finish_reason") -> FinishReason | None:
    """None while unfinished. FINISH_REASON_ERROR has no domain twin: the request ends as
    ABORT (its ErrorStatus says why)."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    if value == common_pb2.FINISH_REASON_ERROR:
        return FinishReason.ABORT
    for reason, number in _FINISH_REASONS.items():
        if number == value:
            return reason
    raise InvalidRequest(field, f"unknown finish reason {value}")


def usage_to_proto(
    stats: SpecStats, prompt_tokens: int, completion_tokens: int
) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        verify_steps=stats.verify_steps,
        accept_length=stats.accept_length,
        drafted_steps=stats.drafts,
        steps_without_tree=without_tree_to_proto(stats.without_tree),
    )


def without_tree_to_proto(counts: Mapping[NoTree, int]) -> common_pb2.StepsWithoutTree:
    """Decode steps without a draft token, by cause (the fields are named as the causes)."""
    return common_pb2.StepsWithoutTree(**{str(cause): n for cause, n in counts.items()})


def _require_id(request_id: str, path: str) -> None:
    if not request_id:
        raise InvalidRequest(_field(path, "request_id"), "must not be empty")


def _check_ids(ids: Sequence[int], vocab_size: int | None, field: str) -> None:
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise InvalidRequest(field, f"token ids must be in [0, {vocab_size})")


def _check_features(
    features: torch.Tensor, num_rows: int, feature_size: int | None, field: str
) -> None:
    """Features are [num_rows, F] floats (F = ``feature_size`` when given)."""
    if features.dim() != 2 or features.shape[0] != num_rows or not features.is_floating_point():
        raise InvalidRequest(
            field, f"expected [{num_rows}, F] floats, got {list(features.shape)} {features.dtype}"
        )
    if feature_size is not None and features.shape[1] != feature_size:
        raise InvalidRequest(field, f"feature size {features.shape[1]}, expected {feature_size}")
