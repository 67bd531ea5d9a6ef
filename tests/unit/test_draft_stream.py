"""tandem.link.messages: prompts go out in messages under the stream's budget, each admit with
its first frame, and arrive whole."""

from __future__ import annotations

import torch

from tandem import wire
from tandem.link.messages import StreamState
from tandem.spec.types import DraftAdmit, SpecConfig, VerifyOutcome
from tandem.v1 import common_pb2, draft_pb2

FEATURES = 48  # bf16: 96 bytes a token


def _admit(request_id: str, num_tokens: int, seed: int) -> DraftAdmit:
    gen = torch.Generator().manual_seed(seed)
    return DraftAdmit(
        request_id=request_id,
        token_ids=list(range(1, num_tokens + 1)),
        features=torch.randn(num_tokens - 1, FEATURES, generator=gen).to(torch.bfloat16),
        spec=SpecConfig(),
    )


def test_prompts_span_messages_under_the_budget_and_arrive_whole() -> None:
    budget, frame_bytes = 4096, 1024
    state = StreamState(budget=budget, frame_bytes=frame_bytes, hidden_dtype=torch.bfloat16)
    admits = [_admit("a", 90, 1), _admit("b", 7, 2), _admit("c", 40, 3)]  # 8.5, 0.6, 3.7 KiB
    messages = [state.build(draft_pb2.SpeculateRequest(step_id=1), admits, [], [])]
    step = 2
    while state.outbox:
        messages.append(state.build(draft_pb2.SpeculateRequest(step_id=step), [], [], []))
        step += 1
    assert len(messages) >= 4
    frames: dict[str, list[common_pb2.TensorFrame]] = {}
    admitted = []
    for msg in messages:
        wire_bytes = msg.SerializeToString()
        assert len(wire_bytes) <= budget
        wired = draft_pb2.SpeculateRequest.FromString(wire_bytes)
        admitted += [m.request_id for m in wired.new_requests]
        for part in wired.prompt_frames:
            assert all(f.ByteSize() <= frame_bytes for f in part.frames)
            frames.setdefault(part.request_id, []).extend(part.frames)
    assert admitted == ["a", "b", "c"]
    for admit in admits:
        got = wire.tensor_from_frames(frames[admit.request_id], max_bytes=1 << 20)
        assert admit.features is not None and torch.equal(got, admit.features)


def test_joined_bytes_parse_as_the_message_upb_builds() -> None:
    """Outgoing joins the request's bytes and its frames'; the draft parses the message that
    building every frame into the request gives."""
    state = StreamState(budget=1 << 20, frame_bytes=512, hidden_dtype=torch.bfloat16)
    admits = [_admit("a", 12, 1), _admit("b", 3, 2)]
    outcome = VerifyOutcome(request_id="c", accepted_token_ids=[4], bonus_token_id=5, features=None)
    state.tracked["c"] = 10
    request = draft_pb2.SpeculateRequest(step_id=7, lane_id=1, released_request_ids=["z"])
    out = state.build(request, admits, [outcome], [])
    assert [rid for rid, _ in out.prompts] == ["a", "b"]
    built = draft_pb2.SpeculateRequest()
    built.CopyFrom(out.request)
    for request_id, frames in out.prompts:
        part = built.prompt_frames.add(request_id=request_id)
        for frame in frames:
            frame.add_to(part.frames)
    assert out.message() == built
    assert len(out.SerializeToString()) == built.ByteSize()
