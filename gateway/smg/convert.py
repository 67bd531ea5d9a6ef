"""The SMG worker protocol's messages <-> the gateway's (``gateway.smg.server`` serves them).

A worker request arrives tokenized (the router applies the chat template and tokenizes): it
becomes a native ``GenerateRequest`` with token ids, so it takes the native request path with
everything on it (admission, lanes, stop strings, failover, abort on disconnect). What Tandem
cannot honour yet is refused with INVALID_ARGUMENT naming the field, never silently ignored:
per-token-id logprobs, constrained decoding, multimodal and embedding inputs, LoRA,
hidden states, disaggregation. Presence and frequency penalties, ``min_new_tokens``,
``logit_bias``, top-N logprobs and ``n`` (completions of one prompt, by index) map onto the
native fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.prompt import BYTES_PER_TOKEN
from gateway.screen import OTHER_BYTES, field_sizes
from tandem.errors import InvalidRequest
from tandem.smg import sglang_scheduler_pb2 as smg_pb2
from tandem.v1 import common_pb2, gateway_pb2

FINISH_REASONS = {  # the OpenAI-style strings GenerateComplete.finish_reason carries
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


_TOKENIZED = smg_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["tokenized"].number
_ID_BYTES = 6  # the most one uint32 takes unpacked: its tag and a five-byte varint


def screen(data: bytes, *, max_model_len: int) -> None:
    """A serialized worker GenerateRequest's sizes checked before it is parsed, as
    ``gateway.screen`` checks a native one: the prompt's ids (and the text the router sends
    along) by what the context holds, everything else together by ``OTHER_BYTES``."""
    sizes = field_sizes(data)
    if sizes is None:
        return  # the parser refuses what is not a message
    limit = max_model_len * (_ID_BYTES + BYTES_PER_TOKEN)
    if sizes.get(_TOKENIZED, 0) > limit:
        raise InvalidRequest(
            "tokenized",
            f"{sizes[_TOKENIZED]} bytes; the {max_model_len}-token context needs at most {limit}",
        )
    others = sum(size for number, size in sizes.items() if number != _TOKENIZED)
    if others > OTHER_BYTES:
        raise InvalidRequest("request", f"{others} bytes besides the prompt, at most {OTHER_BYTES}")


def to_gateway(request: smg_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    """The native request for a worker request; InvalidRequest names an unsupported field."""
    _refuse_unsupported(request)
    if not request.request_id:
        raise InvalidRequest("request_id", "must not be empty")
    params = request.sampling_params
    sampling = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=max(params.top_k, 0),  # SGLang's -1 and Tandem's 0 both mean no filter
        min_p=params.min_p,
        stop_token_ids=params.stop_token_ids,
        stop_strings=params.stop,
        ignore_eos=params.ignore_eos,
        logprobs=request.return_logprob,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_new_tokens,
        logit_bias=_logit_bias(params.logit_bias),
        top_logprobs=request.top_logprobs_num if request.return_logprob else 0,
    )
    if params.top_p:  # proto3's 0 is "not given" here: the router always sends a value
        sampling.top_p = params.top_p
    if params.repetition_penalty:
        sampling.repetition_penalty = params.repetition_penalty
    if params.HasField("max_new_tokens"):
        sampling.max_new_tokens = params.max_new_tokens
    return gateway_pb2.GenerateRequest(
        n=params.n,
        request_id=request.request_id,
        token_ids=gateway_pb2.TokenIds(ids=request.tokenized.input_ids),
        sampling=sampling,
        # The router detokenizes; text is made here only to match stop strings.
        stream_options=gateway_pb2.StreamOptions(
            detokenize=False, skip_special_tokens=params.skip_special_tokens
        ),
    )


def _logit_bias(bias: Mapping[str, float]) -> dict[int, float]:
    """SGLang's logit_bias (token ids as decimal strings) as the native map; the native checks
    (range, count, vocabulary) follow at the gateway and the target."""
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= 2**32:
            raise InvalidRequest("sampling_params.logit_bias", f"{key[:20]!r} is not a token id")
        out[int(key)] = value
    return out


def _refuse_unsupported(request: smg_pb2.GenerateRequest) -> None:
    params = request.sampling_params
    unsupported = {
        "sampling_params.constraint": params.WhichOneof("constraint") is not None,
        "token_ids_logprob": bool(request.token_ids_logprob),
        "return_hidden_states": request.return_hidden_states,
        "mm_inputs": request.HasField("mm_inputs"),
        "input_embeds": bool(request.input_embeds),
        "lora_id": bool(request.lora_id),
        "disaggregated_params": request.HasField("disaggregated_params"),
        "custom_logit_processor": bool(request.custom_logit_processor),
    }
    for field, given in unsupported.items():
        if given:
            raise InvalidRequest(field, "is not supported by Tandem")
    if not request.HasField("tokenized"):
        raise InvalidRequest("tokenized", "the prompt's token ids are required")


def chunk(
    token_ids: list[int],
    logprobs: list[float] | None,
    prompt_tokens: int,
    completion_tokens: int,
    tops: Sequence[common_pb2.TopLogprobs] = (),
) -> smg_pb2.GenerateStreamChunk:
    """A streamed chunk: its new tokens (and their logprobs and top-N when asked) and
    cumulative counts."""
    out = smg_pb2.GenerateStreamChunk(
        token_ids=token_ids, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
    )
    if logprobs is not None:
        _logprobs(out.output_logprobs, token_ids, logprobs, tops)
    return out


def _logprobs(
    into: smg_pb2.OutputLogProbs,
    token_ids: list[int],
    logprobs: list[float],
    tops: Sequence[common_pb2.TopLogprobs],
) -> None:
    into.token_logprobs.extend(logprobs)
    into.token_ids.extend(token_ids)
    for top in tops:
        into.top_logprobs.add(values=top.logprobs, token_ids=top.token_ids)


def complete(
    done: gateway_pb2.GenerateComplete,
    output_ids: list[int],
    logprobs: list[float] | None,
    tops: Sequence[common_pb2.TopLogprobs] = (),
) -> smg_pb2.GenerateComplete:
    """The final message. ``output_ids``: every token for an unstreamed request, none for a
    streamed one (its chunks carried them). Speculation shows only in the acceptance counts."""
    out = smg_pb2.GenerateComplete(
        output_ids=output_ids,
        finish_reason=FINISH_REASONS.get(done.finish_reason, "abort"),
        prompt_tokens=done.usage.prompt_tokens,
        completion_tokens=done.usage.completion_tokens,
        spec_accepted_tokens=done.usage.accepted_tokens,
        spec_draft_tokens=done.usage.draft_tokens,
    )
    if done.HasField("stop_token_id"):
        out.matched_token_id = done.stop_token_id
    elif done.HasField("stop_string"):
        out.matched_stop_str = done.stop_string
    if logprobs is not None:
        _logprobs(out.output_logprobs, output_ids, logprobs, tops)
    return out
