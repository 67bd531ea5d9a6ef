"""Structure-aware fuzzing of the internal streams against the services in process (real gRPC
servers on loopback, tiny random models: tests/helpers/inproc_stack.py): hypothesis-generated
sequences of the target's Control commands (admits with bad values, duplicate ids, bad lanes;
aborts of unknown ids, unknown finish reasons; lane moves; policy updates; empty commands) and
of the draft's Speculate messages (hellos missing, repeated or of another version; admits with
bad ids, prompts and speculation; prompt and outcome frames with bad dtypes, shapes, sizes and
chunk orders; outcomes and releases of unknown requests). No answer is UNKNOWN or INTERNAL: a
bad command refuses that request only (one final commit per admit), a malformed Speculate
stream ends with INVALID_ARGUMENT where the test predicts it, every other message is
answered; afterwards neither KV pool holds a page and no service tracks a request."""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from tandem import wire
from tandem.v1 import common_pb2, draft_pb2, target_pb2
from tests.helpers.fuzz_internal import control_ops, speculate_steps
from tests.helpers.inproc_stack import InProcessStack, make_checkpoints

pytestmark = pytest.mark.slow

SETTINGS = settings(
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
# At least 500 internal messages a run: 400 Control commands, 200 or more Speculate messages
# (a stream that must break there stops at its break).
CONTROL_EXAMPLES, CONTROL_OPS = 40, 10
SPECULATE_EXAMPLES, SPECULATE_STEPS = 40, 8
MIN_SPECULATE = 200
FINAL = common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessStack]:
    running = InProcessStack(make_checkpoints(tmp_path_factory.mktemp("fuzz-internal")))
    yield running
    running.close()


COUNTS: Counter[str] = Counter()


def _control(stack: InProcessStack, ops: list[target_pb2.ControlRequest]) -> None:
    """Sends ``ops`` on a Control stream of its own; every admit gets exactly one final
    commit, refusals name their field, no commit is INTERNAL; the stream ends cleanly."""
    outbox: queue.Queue[target_pb2.ControlRequest | None] = queue.Queue()
    for op in ops:
        outbox.put(op)
    COUNTS["control messages"] += len(ops)
    admits = Counter(op.admit.request_id for op in ops if op.HasField("admit"))
    call = stack.target.Control(iter(outbox.get, None), timeout=60)
    finals: Counter[str] = Counter()
    deadline = time.monotonic() + 45
    for response in call:
        for commit in response.step.commits:
            assert commit.request_id in admits, commit
            if commit.finish_reason == FINAL:
                continue
            finals[commit.request_id] += 1
            if commit.finish_reason == common_pb2.FINISH_REASON_ERROR:
                COUNTS[f"control refusals (code {commit.error.code})"] += 1
                assert commit.error.code in (3, 8), commit  # never INTERNAL
                assert commit.error.code != 3 or commit.error.field, commit
        if finals == admits or time.monotonic() > deadline:
            break
    assert finals == admits, (finals, admits)
    outbox.put(None)  # the gateway side closes: the stream ends without an error
    assert all(r.HasField("status") or r.HasField("step") for r in call)
    assert call.code() == grpc.StatusCode.OK, call.details()


def _speculate(stack: InProcessStack, steps: list[tuple[draft_pb2.SpeculateRequest, bool]]) -> None:
    """Sends ``steps`` (a message, whether it must end the stream) on a Speculate stream of
    its own, then one releasing every id; answers in order, INVALID_ARGUMENT exactly at a
    predicted break; afterwards the draft's pool holds no page."""
    breaks = [i for i, (_, broken) in enumerate(steps) if broken]
    sent = steps[: breaks[0] + 1] if breaks else steps
    messages = [m for m, _ in sent]
    if not breaks:
        names = {a.request_id for m in messages for a in m.new_requests}
        messages.append(draft_pb2.SpeculateRequest(step_id=999, released_request_ids=names))
    COUNTS["speculate messages"] += len(messages)
    answers: list[draft_pb2.SpeculateResponse] = []
    try:
        for answer in stack.draft.Speculate(iter(messages), timeout=60):
            answers.append(answer)
            for tree in answer.trees:
                assert all(t < stack.engine.model.config.vocab_size for t in tree.token_ids)
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, exc)
    assert [a.step_id for a in answers] == [m.step_id for m in messages][: len(answers)]
    if breaks:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and len(answers) == breaks[0]
        COUNTS["speculate streams refused"] += 1
    else:
        assert code == grpc.StatusCode.OK and len(answers) == len(messages)
        assert answers[-1].kv_usage.pages_used == 0, "pages left after every release"


def test_generated_control_streams(stack: InProcessStack) -> None:
    before = COUNTS["control messages"]

    @given(control_ops(CONTROL_OPS))
    def run(ops: list[target_pb2.ControlRequest]) -> None:
        _control(stack, ops)

    settings(SETTINGS, max_examples=CONTROL_EXAMPLES)(run)()
    assert COUNTS["control messages"] - before >= CONTROL_EXAMPLES * CONTROL_OPS
    assert stack.wait_idle() == dict.fromkeys(stack.idle(), 0)
    info = stack.target.GetInfo(target_pb2.TargetServiceGetInfoRequest(), timeout=10)
    assert info.status.kv_usage.pages_total > 0, "GetInfo reports the pool now"


def test_generated_speculate_streams(stack: InProcessStack) -> None:
    info = stack.draft.GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=10)
    features = len(info.target_layer_ids) * info.hidden_size
    assert wire.torch_dtype(info.hidden_dtype) == torch.float32 and features > 0
    before = COUNTS["speculate messages"]

    @given(speculate_steps(SPECULATE_STEPS, features, info.target_vocab_size))
    def run(steps: list[tuple[draft_pb2.SpeculateRequest, bool]]) -> None:
        _speculate(stack, steps)

    settings(SETTINGS, max_examples=SPECULATE_EXAMPLES)(run)()
    print(dict(COUNTS))
    assert COUNTS["speculate messages"] - before >= MIN_SPECULATE, COUNTS
    assert stack.wait_idle() == dict.fromkeys(stack.idle(), 0)
