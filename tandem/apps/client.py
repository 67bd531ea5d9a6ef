"""A small client of the public API, used by ``tandem generate --server`` (and an example of
how to call the gateway from Python: see docs/client.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from tandem.serving.rpc import channel_options
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


async def generate_one(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    prompt: str | list[int],
    sampling: common_pb2.SamplingParams,
) -> dict[str, Any]:
    """Streams one generation; returns what ``tandem generate --json`` prints. A prompt of
    token ids is sent as ids and not detokenized (``text`` is then empty)."""
    token_ids: list[int] = []
    text: list[str] = []
    record: dict[str, Any] = {"prompt": prompt}
    if isinstance(prompt, str):
        request = gateway_pb2.GenerateRequest(text=prompt, sampling=sampling)
    else:
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling=sampling,
            stream_options=gateway_pb2.StreamOptions(detokenize=False),
        )
    async for response in stub.Generate(request):
        which = response.WhichOneof("payload")
        if which == "chunk":
            token_ids += response.chunk.token_ids
            text.append(response.chunk.text)
        elif which == "complete":
            usage = response.complete.usage
            record.update(
                finish_reason=_FINISH.get(response.complete.finish_reason, "unknown"),
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                accept_length=round(usage.accept_length, 4),
                draft_tokens=usage.draft_tokens,
                accepted_tokens=usage.accepted_tokens,
                verify_steps=usage.verify_steps,
            )
        elif which == "error":
            raise RuntimeError(f"{response.error.field}: {response.error.message}")
    record.update(token_ids=token_ids, text="".join(text))
    return record


def generate_remote(
    address: str,
    prompts: list[str],
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repetition_penalty: float,
    seed: int | None,
    max_new_tokens: int,
    ignore_eos: bool,
) -> list[dict[str, Any]]:
    """All prompts concurrently through the gateway at ``address``; prompt i gets seed+i."""

    async def run() -> list[dict[str, Any]]:
        async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            jobs = []
            for i, prompt in enumerate(prompts):
                sampling = common_pb2.SamplingParams(
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    min_p=min_p,
                    repetition_penalty=repetition_penalty,
                    max_new_tokens=max_new_tokens,
                    ignore_eos=ignore_eos,
                )
                if seed is not None:
                    sampling.seed = seed + i
                jobs.append(generate_one(stub, prompt, sampling))
            return list(await asyncio.gather(*jobs))

    return asyncio.run(run())
