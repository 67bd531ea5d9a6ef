"""The gateway's generation over gRPC (in-process servers on loopback ports), against
`EchoTarget` (tests/helpers/gateway.py): streamed chunks and the completion, text that never
splits a character, stop strings, every invalid field named; and one run against the real
target service."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

from gateway.__main__ import start_gateway
from gateway.config import GatewayConfig
from tandem.models.tokenizer import load_tokenizer
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2_grpc
from tests.helpers.gateway import (
    LENGTH,
    MAX_MODEL_LEN,
    STOP,
    VOCAB,
    generate,
    ids_request,
    rich_status,
    run,
    stack,
    wait_until,
)


def test_streams_chunks_then_a_completion_with_usage(words: Path) -> None:
    async def body() -> None:
        async with stack(words, tokens_per_step=2) as s:
            request = ids_request([5, 6, 7, 8], max_new_tokens=6, logprobs=True)
            request.speculation.enabled = False
            chunks, complete = await generate(s.stub, request)
            assert [list(c.token_ids) for c in chunks] == [[5, 6], [7, 8], [5, 6]]
            assert "".join(c.text for c in chunks) == " w5 w6 w7 w8 w5 w6"  # continues the prompt
            assert all(list(c.logprobs) == [-0.5] * len(c.token_ids) for c in chunks)
            assert complete.finish_reason == LENGTH
            assert not complete.HasField("stop_token_id")
            usage = complete.usage
            assert (usage.prompt_tokens, usage.completion_tokens) == (4, 6)
            assert (usage.verify_steps, usage.draft_tokens, usage.accepted_tokens) == (3, 3, 3)
            assert usage.accept_length == pytest.approx(2.0)
            assert 0 < complete.queue_ns <= complete.ttft_ns <= complete.total_ns
            # The target got explicit sampling values and the per-request opt-out.
            (admit,) = s.target.admits
            assert list(admit.prompt_token_ids) == [5, 6, 7, 8]
            assert admit.sampling.HasField("temperature") and admit.sampling.temperature == 1.0
            assert admit.sampling.max_new_tokens == 6 and admit.sampling.logprobs
            assert not admit.sampling.stop_strings
            assert admit.speculation.HasField("enabled") and not admit.speculation.enabled

            # Text prompts are tokenized like `tandem generate` (with <s>); unset max_new_tokens
            # fills the context; a stop token id is reported as what matched.
            request = gateway_pb2.GenerateRequest(
                text="w9 w10 w11", sampling=common_pb2.SamplingParams(stop_token_ids=[10])
            )
            request.stream_options.continuous_usage = True
            request.stream_options.skip_special_tokens = True
            chunks, complete = await generate(s.stub, request)
            assert list(s.target.admits[1].prompt_token_ids) == [1, 9, 10, 11]
            assert s.target.admits[1].sampling.max_new_tokens == MAX_MODEL_LEN - 4
            assert s.target.admits[1].speculation.enabled
            assert [list(c.token_ids) for c in chunks] == [[1, 9], [10]]
            assert [c.text for c in chunks] == [" w9", " w10"]  # <s> skipped
            assert [c.usage.completion_tokens for c in chunks] == [2, 3]
            assert complete.finish_reason == STOP and complete.stop_token_id == 10

    run(body)


def test_special_tokens_switch_and_request_features_reach_the_target(words: Path) -> None:
    async def body() -> None:
        async with stack(words, tokens_per_step=2) as s:
            sampling = common_pb2.SamplingParams(
                max_new_tokens=4,
                presence_penalty=0.5,
                frequency_penalty=-1.25,
                min_tokens=2,
                logit_bias={7: -100.0, 9: 2.5},
            )
            for special, ids in ((None, [1, 9, 10]), (True, [1, 9, 10]), (False, [9, 10])):
                request = gateway_pb2.GenerateRequest(text="w9 w10", sampling=sampling)
                if special is not None:
                    request.add_special_tokens = special
                _, complete = await generate(s.stub, request)
                assert list(s.target.admits[-1].prompt_token_ids) == ids
                assert complete.usage.prompt_tokens == len(ids)
            admitted = s.target.admits[-1].sampling
            assert (admitted.presence_penalty, admitted.frequency_penalty) == (0.5, -1.25)
            assert admitted.min_tokens == 2 and dict(admitted.logit_bias) == {7: -100.0, 9: 2.5}
            # Token ids are used as they are, whatever the switch says.
            request = ids_request([5, 6], max_new_tokens=2)
            request.add_special_tokens = True
            await generate(s.stub, request)
            assert list(s.target.admits[-1].prompt_token_ids) == [5, 6]

    run(body)


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_multibyte_text_is_never_split(byte_level: Path, tokens_per_step: int) -> None:
    text = "héllo wörld 😀 日本語 ✓"

    async def body() -> None:
        async with stack(byte_level, tokens_per_step=tokens_per_step) as s:
            prompt = load_tokenizer(byte_level)(text)["input_ids"]
            assert len(prompt) == len(text.encode())
            request = gateway_pb2.GenerateRequest(
                text=text,
                sampling=common_pb2.SamplingParams(max_new_tokens=len(prompt), ignore_eos=True),
            )
            chunks, complete = await generate(s.stub, request)
            assert [t for c in chunks for t in c.token_ids] == prompt
            assert all("\ufffd" not in c.text for c in chunks)
            assert "".join(c.text for c in chunks) == text
            if tokens_per_step == 1:  # an incomplete character holds its text back
                assert any(c.text == "" for c in chunks)
            assert complete.finish_reason == LENGTH

    run(body)


@pytest.mark.parametrize(
    ("tokens_per_step", "stop", "ids", "text"),
    [
        (1, "w7", [5, 6, 7], " w5 w6 "),
        (4, "w6 w7", [5, 6, 7], " w5 "),  # the match ends inside a commit: later ids dropped
        (1, "6 w", [5, 6, 7], " w5 w"),  # spans chunks; the client never sees part of it
    ],
)
def test_stop_strings_cut_the_text_and_abort_the_target(
    words: Path, tokens_per_step: int, stop: str, ids: list[int], text: str
) -> None:
    async def body() -> None:
        async with stack(words, tokens_per_step=tokens_per_step) as s:
            request = ids_request([5, 6, 7, 8, 9], max_new_tokens=40, stop_strings=["zzz", stop])
            request.request_id = "stopper"
            chunks, complete = await generate(s.stub, request)
            assert [t for c in chunks for t in c.token_ids] == ids
            assert "".join(c.text for c in chunks) == text
            assert complete.finish_reason == STOP and complete.stop_string == stop
            assert complete.usage.completion_tokens == len(ids)
            aborts = [(list(a.request_ids), a.finish_reason) for a in s.target.aborts]
            assert aborts == [([s.target.admits[0].request_id], STOP)]
            assert s.target.admits[0].request_id.startswith("stopper#")
            assert not s.target.admits[0].sampling.stop_strings

    run(body)


INVALID: list[tuple[gateway_pb2.GenerateRequest, str]] = [
    (gateway_pb2.GenerateRequest(), "prompt"),
    (gateway_pb2.GenerateRequest(text=""), "text"),
    (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds()), "token_ids"),
    (ids_request([5, VOCAB]), "token_ids"),
    (ids_request(list(range(4, 4 + MAX_MODEL_LEN))), "token_ids"),
    (ids_request([5], temperature=-1.0), "sampling.temperature"),
    (ids_request([5], top_p=0.0), "sampling.top_p"),
    (ids_request([5], repetition_penalty=0.0), "sampling.repetition_penalty"),
    (ids_request([5], max_new_tokens=0), "sampling.max_new_tokens"),
    (ids_request([5, 6], max_new_tokens=MAX_MODEL_LEN - 1), "sampling.max_new_tokens"),
    (ids_request([5], stop_token_ids=[VOCAB]), "sampling.stop_token_ids"),
    (ids_request([5], stop_strings=[""]), "sampling.stop_strings"),
    (ids_request([5], stop_strings=[f"s{i}" for i in range(9)]), "sampling.stop_strings"),
    (gateway_pb2.GenerateRequest(request_id="", text="w5"), "request_id"),
    (
        gateway_pb2.GenerateRequest(
            text="w5",
            speculation=common_pb2.SpeculationParams(draft_kind=common_pb2.DRAFT_KIND_EAGLE3),
        ),
        "speculation.draft_kind",
    ),
]


def test_each_invalid_field_is_named(words: Path) -> None:
    async def body() -> None:
        async with stack(words) as s:
            for request, field_path in INVALID:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await generate(s.stub, request)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field_path
                assert (info.value.details() or "").startswith(f"{field_path}:")
                (detail,) = rich_status(info.value).details
                bad_request = error_details_pb2.BadRequest()
                assert detail.Unpack(bad_request)
                assert bad_request.field_violations[0].field == field_path
            assert s.target.admits == []  # nothing reached the target

    run(body)


def test_against_the_real_target_service(tmp_path: Path) -> None:
    from tandem.config import EngineConfig
    from tandem.sampling import SamplingParams
    from tandem.serving import rpc
    from tandem.target.engine import Engine
    from tandem.testing.random_model import make_checkpoint
    from target_service.__main__ import get_info, status
    from target_service.config import TargetServiceConfig
    from target_service.engine import TargetLoop
    from target_service.server import TargetServicer

    target_dir = make_checkpoint(tmp_path / "target", "llama", seed=5)
    prompt = [1, 5, 6, 7]  # "w5 w6 w7" with <s>
    config = TargetServiceConfig(engine=EngineConfig(model=target_dir, num_pages=64))
    (expected,) = Engine(config.engine).generate(
        [prompt], SamplingParams(max_new_tokens=8, ignore_eos=True)
    )
    tokenizer = load_tokenizer(target_dir)

    async def body() -> None:
        engine = Engine(config.engine)
        loop = TargetLoop(engine, status=lambda: status(engine, None), status_interval_s=0.05)
        server = rpc.make_server()
        servicer = TargetServicer(loop, get_info(engine, config))
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        loop.start()
        gateway = await start_gateway(
            GatewayConfig(target_addr=f"127.0.0.1:{port}", tokenizer=target_dir, port=0)
        )
        try:
            await gateway.client.wait_connected(10.0)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                sampling = common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=8, ignore_eos=True
                )
                request = gateway_pb2.GenerateRequest(text="w5 w6 w7", sampling=sampling)
                chunks, complete = await generate(stub, request)
                ids = [t for c in chunks for t in c.token_ids]
                assert ids == expected.token_ids

                def continuation(n: int) -> str:
                    return tokenizer.decode(prompt + ids[:n])[len(tokenizer.decode(prompt)) :]

                assert "".join(c.text for c in chunks) == continuation(8)
                assert complete.finish_reason == LENGTH
                assert complete.usage.completion_tokens == 8 and complete.usage.verify_steps

                # A stop string on a later token: cut, and the target frees the request.
                k = next(
                    k for k in range(2, 8) if tokenizer.decode([ids[k]]) not in continuation(k)
                )
                stop = tokenizer.decode([ids[k]])
                sampling.stop_strings.append(stop)
                request = gateway_pb2.GenerateRequest(text="w5 w6 w7", sampling=sampling)
                chunks, complete = await generate(stub, request)
                assert [t for c in chunks for t in c.token_ids] == ids[: k + 1]
                text = continuation(k + 1)
                assert "".join(c.text for c in chunks) == text[: text.index(stop)]
                assert complete.finish_reason == STOP and complete.stop_string == stop
                # The target's own final commit (its usage) answered the STOP abort.
                assert complete.usage.verify_steps > 0
                alloc = engine.kv.allocator
                await wait_until(lambda: alloc.num_free_pages == alloc.num_pages)
                info = await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
                assert info.vocab_size == engine.model.config.vocab_size
                # No draft: speculation off, no policy; the gateway's default limits.
                described = await stub.GetServerInfo(gateway_pb2.GetServerInfoRequest())
                assert described.speculation == common_pb2.SpeculationParams(enabled=False)
                assert described.spec_policy == common_pb2.SPEC_POLICY_UNSPECIFIED
                assert (described.max_running, described.max_queue) == (64, 256)
                assert gateway.client.num_connects == 1  # the stop abort kept the stream up

                # n completions: seeded samples are each what a lone request with seed + i
                # returns.
                sampled = common_pb2.SamplingParams(temperature=1.0, seed=11, max_new_tokens=6)
                lone = []
                for seed in (11, 12):
                    sampled.seed = seed
                    request = gateway_pb2.GenerateRequest(text="w5 w6 w7", sampling=sampled)
                    chunks, _ = await generate(stub, request)
                    lone.append([t for c in chunks for t in c.token_ids])
                sampled.seed = 11
                request = gateway_pb2.GenerateRequest(text="w5 w6 w7", sampling=sampled, n=2)
                both: dict[int, list[int]] = {0: [], 1: []}
                async for response in stub.Generate(request):
                    both[response.index] += list(response.chunk.token_ids)
                assert [both[0], both[1]] == lone and lone[0] != lone[1]

                # Top log-probabilities only where asked: one list per token, the greedy
                # choice first with the token's own log-probability.
                sampling = common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=True
                )
                request = gateway_pb2.GenerateRequest(text="w5 w6 w7", sampling=sampling)
                chunks, _ = await generate(stub, request)
                assert all(not c.top_logprobs for c in chunks)
                request.sampling.top_logprobs = 3
                chunks, _ = await generate(stub, request)
                assert [t for c in chunks for t in c.token_ids] == ids
                for c in chunks:
                    assert len(c.top_logprobs) == len(c.token_ids)
                    for token, logprob, top in zip(
                        c.token_ids, c.logprobs, c.top_logprobs, strict=True
                    ):
                        assert len(top.token_ids) == 3 and top.token_ids[0] == token
                        assert top.logprobs[0] == pytest.approx(logprob, abs=1e-5)
                        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        finally:
            await gateway.stop(0)
            loop.stop()
            await server.stop(0)

    run(body)


def test_stop_string_matcher_holds_back_only_possible_matches() -> None:
    from gateway.detokenize import StopStringMatcher

    matcher = StopStringMatcher(["aab", "xyz"])
    assert matcher.feed("cca") == "cc"  # "a" may start "aab"
    assert matcher.feed("a") == ""  # "aa" too
    assert matcher.feed("a") == "a"  # "aaa": only the last two can still match
    assert matcher.feed("bq") == "" and matcher.matched == "aab"
    assert matcher.feed("more") == "" and matcher.flush() == ""
    unmatched = StopStringMatcher(["xyz"])
    assert unmatched.feed("abx") == "ab" and unmatched.flush() == "x"
    assert unmatched.matched is None
