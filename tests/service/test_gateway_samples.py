"""``GenerateRequest.n`` > 1 through the gateway over gRPC (against ``EchoTarget``): each
completion a request of its own at the target (id, seed + i, the prompt tokenized once), their
messages interleaved with their index under the request's id, one completion message each; Abort
by the request's id ends them all; bad values refused by name; a failure ends the call."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import grpc
import pytest

from tandem.v1 import common_pb2, gateway_pb2, target_pb2
from tests.helpers.gateway import LENGTH, ids_request, run, stack, wait_until

ABORT = common_pb2.FINISH_REASON_ABORT


async def collect(call: object) -> dict[int, list[gateway_pb2.GenerateResponse]]:
    by_index: dict[int, list[gateway_pb2.GenerateResponse]] = defaultdict(list)
    async for response in call:  # type: ignore[attr-defined]
        by_index[response.index].append(response)
    return dict(by_index)


def test_each_completion_is_a_request_of_its_own(words: Path) -> None:
    async def body() -> None:
        async with stack(words, tokens_per_step=2) as s:
            request = ids_request([5, 6, 7], max_new_tokens=5, temperature=1.0, seed=2**63 - 2)
            request.request_id, request.n = "many", 3
            out = await collect(s.stub.Generate(request))
            assert sorted(out) == [0, 1, 2]
            for responses in out.values():
                assert all(r.request_id == "many" for r in responses)
                *chunks, last = responses
                assert all(r.HasField("chunk") for r in chunks) and last.HasField("complete")
                assert [t for r in chunks for t in r.chunk.token_ids] == [5, 6, 7, 5, 6]
                assert last.complete.finish_reason == LENGTH
                assert last.complete.usage.completion_tokens == 5
            ids = sorted(a.request_id.rsplit("#", 1)[0] for a in s.target.admits)
            assert ids == ["many/0", "many/1", "many/2"], ids  # the gateway adds #seq
            seeds = sorted(a.sampling.seed for a in s.target.admits)
            assert seeds == [0, 2**63 - 2, 2**63 - 1]  # seed + i, wrapping within the seeds

            # A text prompt is tokenized once, BOS included, and sent as ids to each.
            text = gateway_pb2.GenerateRequest(
                text="w9 w10", n=2, sampling=common_pb2.SamplingParams(max_new_tokens=2)
            )
            out = await collect(s.stub.Generate(text))
            assert sorted(out) == [0, 1]
            assert all(r.request_id == out[0][0].request_id for rs in out.values() for r in rs)
            assert [list(a.prompt_token_ids) for a in s.target.admits[3:]] == [[1, 9, 10]] * 2

    run(body)


def test_abort_by_the_request_id_ends_every_completion(words: Path) -> None:
    async def body() -> None:
        async with stack(words) as s:
            s.target.paused = True
            request = ids_request([5, 6], max_new_tokens=50)
            request.request_id, request.n = "pair", 2
            call = s.stub.Generate(request)
            await wait_until(lambda: len(s.target.admits) == 2)
            answer = await s.stub.Abort(gateway_pb2.AbortRequest(request_ids=["pair", "other"]))
            assert list(answer.aborted_request_ids) == ["pair"]
            out = await collect(call)
            assert sorted(out) == [0, 1]
            assert all(rs[-1].complete.finish_reason == ABORT for rs in out.values())
            await wait_until(lambda: s.gateway.servicer.admission.num_running == 0)

    run(body)


@pytest.mark.parametrize(("n", "field"), [(17, "n"), (2**32 - 1, "n")])
def test_too_many_completions_are_refused_by_name(words: Path, n: int, field: str) -> None:
    async def body() -> None:
        async with stack(words) as s:
            request = ids_request([5, 6], max_new_tokens=2)
            request.n = n
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(s.stub.Generate(request))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (refused.value.details() or "").startswith(f"{field}:")
            assert s.target.admits == []

    run(body)


def test_a_running_id_is_refused_and_a_failure_ends_the_call(words: Path) -> None:
    async def body() -> None:
        async with stack(words) as s:
            s.target.paused = True
            request = ids_request([5, 6], max_new_tokens=50)
            request.request_id, request.n = "busy", 2
            first = s.stub.Generate(request)
            await wait_until(lambda: len(s.target.admits) == 2)
            for again in (request, ids_request([5], max_new_tokens=1)):
                again.request_id = "busy"
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await collect(s.stub.Generate(again))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (refused.value.details() or "").startswith("request_id:")
            first.cancel()
            # The client went away: both completions are aborted at the target.
            await wait_until(lambda: len({i for a in s.target.aborts for i in a.request_ids}) == 2)
            # A completion the target fails ends the call with the target's status.
            s.target.paused = False
            s.target.refuse = target_pb2.Commit(
                finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=common_pb2.ErrorStatus(
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="no", field="x"
                ),
            )
            request = ids_request([5, 6], max_new_tokens=2)
            request.n = 2
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await collect(s.stub.Generate(request))
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await wait_until(lambda: s.gateway.servicer.admission.num_running == 0)

    run(body)
