"""Hypothesis strategies for the internal streams: sequences of the target's Control commands
and of the draft's Speculate messages, valid values and extremes mixed with broken ones, over
a few request ids so that duplicates, aborts and releases of known and unknown ids occur."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from tandem import wire
from tandem.v1 import common_pb2, draft_pb2, target_pb2
from tests.helpers.inproc_stack import MAX_MODEL_LEN, VOCAB

NAMES = st.sampled_from(["a", "b", "c", "d", ""]) | st.text(max_size=12)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
RARELY = st.sampled_from([False] * 39 + [True])  # hypothesis favours 0 in integers(0, n)
ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 3.0, 1e30])


@st.composite
def _sampling(draw: st.DrawFn) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(max_new_tokens=draw(st.integers(1, 4)))
    if draw(st.booleans()):
        s.temperature = draw(st.floats(0, 2) | ODD_FLOATS)
    if draw(st.integers(0, 4)) == 0:
        s.top_p = draw(st.floats(0, 1) | ODD_FLOATS)
    if draw(st.integers(0, 4)) == 0:
        s.repetition_penalty = draw(st.floats(0, 10) | ODD_FLOATS)
    if draw(st.integers(0, 4)) == 0:
        s.seed = draw(U64)
    if draw(st.integers(0, 6)) == 0:
        s.max_new_tokens = draw(st.sampled_from([0, 2**32 - 1]))
    if draw(st.integers(0, 8)) == 0:
        s.ClearField("max_new_tokens")  # the rest of the context
    s.top_k = draw(st.sampled_from([0, 1, 5]) | U32)
    s.stop_token_ids.extend(draw(st.lists(U32, max_size=2)))
    s.ignore_eos = draw(st.booleans())
    s.logprobs = draw(st.booleans())
    return s


def _speculation(draw: st.DrawFn) -> common_pb2.SpeculationParams:
    spec = common_pb2.SpeculationParams()
    if draw(st.booleans()):
        spec.enabled = draw(st.booleans())
    spec.draft_kind = draw(st.sampled_from([0, 1, 1, 2, 99]))
    for name in ("num_steps", "topk", "num_draft_tokens"):
        if draw(st.booleans()):
            setattr(spec, name, draw(st.integers(0, 4) | U32))
    return spec


@st.composite
def _control_op(draw: st.DrawFn) -> target_pb2.ControlRequest:
    kind = draw(st.sampled_from(["admit"] * 5 + ["abort"] * 2 + ["lanes", "policy", "empty"]))
    op = target_pb2.ControlRequest()
    if kind == "admit":
        a = op.admit
        a.request_id = draw(NAMES)
        prompt = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
        a.prompt_token_ids.extend(
            draw(
                prompt
                | st.just([])
                | st.lists(st.integers(VOCAB, 2**32 - 1), min_size=1, max_size=2)
                | st.just([5] * MAX_MODEL_LEN)
            )
        )
        a.sampling.CopyFrom(draw(_sampling()))
        a.speculation.CopyFrom(_speculation(draw))
        a.lane_id = draw(st.sampled_from([0, 0, 1, 2]) | U32)
        carrier = st.dictionaries(st.sampled_from(["traceparent", "tracestate", "x"]), st.text())
        a.trace_context.carrier.update(draw(carrier))
    elif kind == "abort":
        op.abort.request_ids.extend(draw(st.lists(NAMES, max_size=3)))
        op.abort.finish_reason = draw(st.sampled_from([0, 1, 2, 3, 4, 99, -5]))
    elif kind == "lanes":
        op.lane_assignment.request_ids.extend(draw(st.lists(NAMES, max_size=3)))
        op.lane_assignment.lane_id = draw(st.sampled_from([0, 1, 2]) | U32)
    elif kind == "policy":
        op.policy_update.lane_id = draw(U32)
        op.policy_update.speculation.CopyFrom(_speculation(draw))
        if draw(st.booleans()):
            op.policy_update.draft_deadline_ns = draw(U64)
    return op


def control_ops(n: int) -> st.SearchStrategy[list[target_pb2.ControlRequest]]:
    return st.lists(_control_op(), min_size=n, max_size=n)


IDS = st.sampled_from(["p", "q", "r", ""])


def _frames(draw: st.DrawFn, rows: int, features: int) -> tuple[list[common_pb2.TensorFrame], bool]:
    """Frames of a [rows, features] float32 tensor, maybe broken (then True)."""
    tensor = torch.randn(rows, features)
    chunk = draw(st.sampled_from([1 << 20, 512]))
    frames = wire.tensor_to_frames(wire.HIDDEN_STATES, tensor, max_chunk_bytes=chunk)
    how = draw(st.sampled_from(["ok"] * 6 + ["dtype", "shape", "total", "index", "drop", "shared"]))
    if how == "ok":
        return frames, False
    first = frames[0]
    if how == "dtype":
        first.dtype = draw(st.sampled_from([0, 2, 6, 7, 99]))
    elif how == "shape":
        first.shape[:] = draw(st.lists(st.integers(0, 2**40), max_size=9))
    elif how == "total":
        first.total_bytes = draw(U64)
    elif how == "index":
        frames[-1].chunk_index = draw(U32)
    elif how == "drop":
        frames = frames[:-1] if len(frames) > 1 else []
    else:
        first.shared_offset = draw(U64)
    return frames, True


@st.composite
def _step(
    draw: st.DrawFn, step_id: int, features: int, vocab: int, lengths: dict[str, int]
) -> tuple[draft_pb2.SpeculateRequest, bool]:
    m = draft_pb2.SpeculateRequest(step_id=step_id, lane_id=draw(st.sampled_from([0, 1, 2])))
    breaks = False
    odd = draw(RARELY)  # rarely: no hello first, a hello later
    if (step_id == 0) != odd:
        m.hello.protocol_version = wire.PROTOCOL_VERSION
        if step_id == 0 and draw(RARELY):
            m.hello.protocol_version = draw(st.sampled_from([0, 2, 2**32 - 1]))
            breaks = True
    breaks = breaks or odd
    m.speculation.enabled = True
    m.speculation.num_steps = draw(st.integers(1, 3))
    m.speculation.topk = draw(st.integers(1, 2))
    if draw(RARELY):
        m.speculation.draft_kind = common_pb2.DRAFT_KIND_EAGLE  # not the deployed kind
        breaks = True
    m.deadline_ns = draw(st.sampled_from([0, 10**9]) | U64)
    for request_id in draw(st.lists(IDS, max_size=2, unique=True)):
        rows = draw(st.integers(1, 10) | st.just(MAX_MODEL_LEN))
        admit = m.new_requests.add(request_id=request_id)
        admit.prompt_token_ids.extend(
            draw(st.lists(st.integers(0, vocab - 1), min_size=rows, max_size=rows))
        )
        if draw(st.integers(0, 9)) == 0:
            admit.prompt_token_ids[0] = draw(st.integers(vocab, 2**32 - 1))
        admit.verified_token_id = draw(st.integers(0, vocab - 1) | U32)
        admit.sampling.temperature = draw(st.floats(0, 2) | ODD_FLOATS)
        admit.speculation.enabled = True
        admit.speculation.num_steps = draw(st.integers(1, 3) | st.just(9))
        admit.speculation.topk = draw(st.integers(1, 2))
        frames, _ = _frames(draw, rows, features)
        m.prompt_frames.add(request_id=request_id, frames=frames)
        lengths[request_id] = rows + 1
    for request_id in draw(st.lists(IDS, max_size=2, unique=True)):
        accepted = draw(st.integers(0, 2))
        outcome = m.outcomes.add(request_id=request_id)
        outcome.accepted_token_ids.extend([7] * accepted)
        outcome.bonus_token_id = draw(st.integers(0, vocab - 1) | U32)
        length = lengths.get(request_id, 0) + accepted + 1
        outcome.committed_len = draw(st.just(length) | st.just(length) | U32)
        lengths[request_id] = length
        if draw(st.booleans()):
            outcome.accepted_node_indices.extend(range(accepted + 1))
        frames, _ = _frames(draw, accepted + 1, features)
        outcome.hidden_states.extend(frames)
    m.released_request_ids.extend(draw(st.lists(IDS | st.text(max_size=4), max_size=2)))
    for request_id in m.released_request_ids:
        lengths.pop(request_id, None)
    return m, breaks


@st.composite
def speculate_steps(
    draw: st.DrawFn, n: int, features: int, vocab: int
) -> list[tuple[draft_pb2.SpeculateRequest, bool]]:
    """``n`` messages of one stream, each with whether the draft must end the stream there."""
    lengths: dict[str, int] = {}
    return [draw(_step(i, features, vocab, lengths)) for i in range(n)]
