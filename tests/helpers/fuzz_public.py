"""Hypothesis strategies for the gateway's public requests, each with what the gateway must
answer: a `Case` is a call (Generate, Abort, GetServerInfo, GetModelInfo) whose request is
built field by field from valid values and their extremes, then, for an invalid case, broken
in exactly one field (so the answer must name that field), or raw bytes (random, truncated,
invalid UTF-8, unknown fields appended)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import strategies as st

from tandem.v1 import common_pb2, gateway_pb2

VALID = ""  # Case.expect of a request that must be served
ANY = "*"  # bytes whose verdict is not predicted: served, or refused naming a known field
UNDECODABLE = "request"

# Prompts whose greedy continuations the test computes once (target only) for comparison.
REFERENCE_PROMPTS = [[5, 6, 7], [42], [100, 200, 300, 400, 500], [9] * 12, [3, 1, 4, 1, 5, 9, 2, 6]]
REFERENCE_TOKENS = 8
# Every field path a refusal may name.
FIELDS = {
    "request",
    "request_id",
    "prompt",
    "text",
    "token_ids",
    "sampling",
    "speculation",
    "stream_options",
    *(
        f"sampling.{name}"
        for name in common_pb2.SamplingParams.DESCRIPTOR.fields_by_name  # type: ignore[attr-defined]
    ),
    "speculation.draft_kind",
}


@dataclass
class Case:
    method: str  # Generate, Abort, GetServerInfo, GetModelInfo
    request: gateway_pb2.GenerateRequest | gateway_pb2.AbortRequest | None = None
    raw: bytes | None = None  # sent instead of ``request`` when set
    expect: str = VALID  # VALID, ANY, or the field the refusal names
    aborts: list[int] = field(default_factory=list)  # Abort: batch positions it names
    named: bool = False  # Generate: gets an id the batch's Aborts may name


finite = {"allow_nan": False, "allow_infinity": False}
ids = st.integers(0, 2**32 - 1)


@st.composite
def sampling(draw: st.DrawFn, vocab: int) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    if draw(st.booleans()):
        s.temperature = draw(st.one_of(st.just(0.0), st.just(2.0), st.floats(0, 2, **finite)))
    s.top_k = draw(st.one_of(st.just(0), st.integers(0, 64), ids))
    if draw(st.booleans()):
        s.top_p = draw(st.one_of(st.just(1.0), st.floats(1e-30, 1.0, **finite)))
    s.min_p = draw(st.one_of(st.just(0.0), st.floats(0, 0.999, **finite)))
    if draw(st.booleans()):
        s.repetition_penalty = draw(st.one_of(st.just(1.0), st.floats(1e-30, 1e30, **finite)))
    if draw(st.booleans()):
        s.seed = draw(st.one_of(st.just(0), st.integers(0, 2**63 - 1)))
    s.max_new_tokens = draw(st.integers(1, 6))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, vocab - 1), max_size=4)))
    s.stop_strings.extend(draw(st.lists(st.text(min_size=1, max_size=16), max_size=3)))
    s.ignore_eos = draw(st.booleans())
    s.logprobs = draw(st.booleans())
    return s


@st.composite
def valid_generate(draw: st.DrawFn, vocab: int, max_model_len: int) -> gateway_pb2.GenerateRequest:
    r = gateway_pb2.GenerateRequest()
    form = draw(st.sampled_from(["reference", "ids", "words", "text"]))
    if form == "reference":
        r.token_ids.ids.extend(draw(st.sampled_from(REFERENCE_PROMPTS)))
    elif form == "ids":
        r.token_ids.ids.extend(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40)))
    elif form == "words":
        words = draw(st.lists(st.integers(0, vocab + 50), min_size=0, max_size=40))
        r.text = " ".join(f"w{w}" for w in words) or " "
    else:
        r.text = draw(st.text(min_size=1, max_size=200))
    r.sampling.CopyFrom(draw(sampling(vocab)))
    if draw(st.integers(0, 9)) == 0:  # unset: what is left of the context, with a long prompt
        r.sampling.ClearField("max_new_tokens")
        r.ClearField("text")
        r.token_ids.ids[:] = [7 + i % 50 for i in range(max_model_len - 4)]
    spec = r.speculation
    if draw(st.booleans()):
        spec.enabled = draw(st.booleans())
    spec.draft_kind = draw(st.sampled_from([0, common_pb2.DRAFT_KIND_EAGLE3]))
    for name in ("num_steps", "topk", "num_draft_tokens"):
        if draw(st.booleans()):
            setattr(spec, name, draw(st.one_of(st.integers(0, 8), ids)))
    options = r.stream_options
    if draw(st.booleans()):
        options.detokenize = draw(st.booleans())
    options.skip_special_tokens = draw(st.booleans())
    options.continuous_usage = draw(st.booleans())
    return r


nan_or_inf = st.sampled_from([math.nan, math.inf, -math.inf])


@st.composite
def broken(draw: st.DrawFn, r: gateway_pb2.GenerateRequest, vocab: int, max_model_len: int) -> str:
    """Breaks ``r`` in one field; returns the field the refusal must name."""
    s = r.sampling
    which = draw(
        st.sampled_from(
            [
                *("temperature", "top_p", "min_p", "repetition_penalty", "seed"),
                *("max_new_tokens", "stop_token_ids", "stop_strings", "request_id"),
                *("prompt", "text", "token_ids", "draft_kind"),
            ]
        )
    )
    if which == "temperature":
        s.temperature = draw(st.one_of(nan_or_inf, st.floats(max_value=-1e-6), st.floats(2.01)))
    elif which == "top_p":
        s.top_p = draw(st.one_of(nan_or_inf, st.just(0.0), st.floats(max_value=0), st.floats(1.01)))
    elif which == "min_p":
        s.min_p = draw(st.one_of(nan_or_inf, st.floats(max_value=-1e-6), st.floats(min_value=1)))
    elif which == "repetition_penalty":
        s.repetition_penalty = draw(st.one_of(nan_or_inf, st.floats(max_value=0)))
    elif which == "seed":
        s.seed = draw(st.integers(2**63, 2**64 - 1))
    elif which == "max_new_tokens":
        s.max_new_tokens = draw(st.one_of(st.just(0), st.integers(max_model_len, 2**32 - 1)))
    elif which == "stop_token_ids":
        s.stop_token_ids.append(draw(st.integers(vocab, 2**32 - 1)))
    elif which == "stop_strings":
        bad = st.one_of(st.just(""), st.text(min_size=257, max_size=300))
        many = st.lists(st.text(min_size=1, max_size=4), min_size=9, max_size=12)
        s.stop_strings[:] = draw(st.one_of(bad.map(lambda x: [x]), many))
    elif which == "request_id":
        r.request_id = draw(st.one_of(st.just(""), st.text(min_size=257, max_size=300)))
    elif which == "prompt":
        r.ClearField("text")
        r.ClearField("token_ids")
    elif which == "text":
        r.text = draw(
            st.one_of(
                st.just(""),
                st.just(" ".join(["w5"] * max_model_len)),  # too many tokens
                st.just("x" * (16 * max_model_len + 1)),  # too many bytes
            )
        )
    elif which == "token_ids":
        r.ClearField("text")
        r.token_ids.ids[:] = draw(
            st.one_of(
                st.just([]),
                st.lists(st.integers(vocab, 2**32 - 1), min_size=1, max_size=3),
                st.just([5] * max_model_len),
            )
        )
        if not r.token_ids.ids:
            r.token_ids.SetInParent()
    else:
        r.speculation.draft_kind = draw(st.sampled_from([2, 3, 4, 5, 6, 99, 2**31 - 1, -1]))
        return "speculation.draft_kind"
    return which if which in ("request_id", "prompt", "text", "token_ids") else f"sampling.{which}"


def _unknown_fields(draw: st.DrawFn) -> bytes:
    """One to three fields of numbers no message of the API uses (kept, ignored)."""
    out = b""
    for _ in range(draw(st.integers(1, 3))):
        number = draw(st.integers(100, 10_000))
        kind = draw(st.sampled_from([0, 2]))
        out += _varint(number << 3 | kind)
        if kind == 0:
            out += _varint(draw(st.integers(0, 2**64 - 1)))
        else:
            payload = draw(st.binary(max_size=32))
            out += _varint(len(payload)) + payload
    return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _parses(message: type, data: bytes) -> bool:
    try:
        message.FromString(data)  # type: ignore[attr-defined]
    except Exception:
        return False
    return True


@st.composite
def generate_case(draw: st.DrawFn, vocab: int, max_model_len: int) -> Case:
    r = draw(valid_generate(vocab, max_model_len))
    kind = draw(st.sampled_from(["valid", "valid", "broken", "broken", "bytes"]))
    if kind == "valid":
        return Case("Generate", r, named=draw(st.booleans()))
    if kind == "broken":
        return Case("Generate", r, expect=draw(broken(r, vocab, max_model_len)))
    data = r.SerializeToString()
    how = draw(st.sampled_from(["unknown", "random", "truncated", "utf8"]))
    if how == "unknown":
        return Case("Generate", r, raw=data + _unknown_fields(draw))
    if how == "utf8":
        r.ClearField("token_ids")
        r.text = "w5 w6"
        data = r.SerializeToString().replace(b"w5 w6", b"w5\xff\xfe")
        return Case("Generate", raw=data, expect=UNDECODABLE)
    if how == "truncated" and len(data) > 1:
        data = data[: draw(st.integers(1, len(data) - 1))]
    else:
        data = draw(st.binary(min_size=1, max_size=64))
    parses = _parses(gateway_pb2.GenerateRequest, data)
    return Case("Generate", raw=data, expect=ANY if parses else UNDECODABLE)


@st.composite
def other_case(draw: st.DrawFn) -> Case:
    method = draw(st.sampled_from(["Abort", "Abort", "GetServerInfo", "GetModelInfo"]))
    request = None
    aborts: list[int] = []
    if method == "Abort":
        names = st.text(max_size=40).map(lambda t: f"x:{t}")
        request = gateway_pb2.AbortRequest(request_ids=draw(st.lists(names, max_size=4)))
        aborts = draw(st.lists(st.integers(0, 63), max_size=4))
    data = b"" if request is None else request.SerializeToString()
    how = draw(st.sampled_from(["message", "message", "unknown", "random"]))
    if how == "message":
        return Case(method, request, aborts=aborts)
    if how == "unknown":
        return Case(method, request, raw=data + _unknown_fields(draw), aborts=aborts)
    data = draw(st.binary(min_size=1, max_size=48))
    message = {
        "Abort": gateway_pb2.AbortRequest,
        "GetServerInfo": gateway_pb2.GetServerInfoRequest,
        "GetModelInfo": gateway_pb2.GetModelInfoRequest,
    }[method]
    # Bytes that parse are a request like any other (unknown fields are kept and ignored).
    return Case(method, raw=data, expect=VALID if _parses(message, data) else UNDECODABLE)


def cases(vocab: int, max_model_len: int) -> st.SearchStrategy[Case]:
    return st.one_of(
        generate_case(vocab, max_model_len),
        generate_case(vocab, max_model_len),
        generate_case(vocab, max_model_len),
        other_case(),
    )
