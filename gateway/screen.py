"""A serialized GenerateRequest's sizes checked before it is parsed (the error interceptor runs
`screen_generate` on a Generate call's bytes: ``tandem.serving.rpc``).

Parsing is work: the protobuf runtime spends time on every element of a repeated field, on
the event loop, so a few MiB of packed token ids would stall the other clients as long as
tokenizing would. The receive cap (``max_request_bytes``) bounds a message; the screen bounds
each part of it by what the model can use, reading only the top-level fields' tags and lengths:

- ``text``: at most ``bytes_per_token`` bytes per token of the context (``gateway.prompt``);
- ``token_ids``: at most as many ids as the context holds, at six bytes each (a tag and the
  longest varint: ids may come unpacked);
- everything else together (id, sampling, speculation, stream options): ``OTHER_BYTES``;
- at most ``MAX_FIELDS`` top-level fields (an encoder writes each once; a parser merges
  repeats).

A refusal names the field, as the servicer's would. Bytes that are not a well-formed message
go on to the parser, which refuses them as undecodable.
"""

from __future__ import annotations

from tandem.errors import InvalidRequest
from tandem.v1 import gateway_pb2

OTHER_BYTES = 64 << 10
MAX_FIELDS = 32
_ID_BYTES = 6  # the most one uint32 takes unpacked: its tag and a five-byte varint

_FIELDS = gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_number
_TEXT = gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number
_TOKEN_IDS = gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number


def screen_generate(data: bytes, *, max_model_len: int, bytes_per_token: int) -> None:
    """Raises InvalidRequest when a serialized GenerateRequest's fields are larger than any
    request the model could serve; returns without a verdict on malformed bytes."""
    sizes = field_sizes(data)
    if sizes is None:
        return
    text_limit = max_model_len * bytes_per_token
    if sizes.get(_TEXT, 0) > text_limit:
        raise InvalidRequest(
            "text",
            f"{sizes[_TEXT]} bytes; a prompt for the {max_model_len}-token context may take "
            f"at most {text_limit} ({bytes_per_token} per token)",
        )
    if sizes.get(_TOKEN_IDS, 0) > max_model_len * _ID_BYTES:
        raise InvalidRequest(
            "token_ids",
            f"{sizes[_TOKEN_IDS]} bytes hold more ids than the {max_model_len}-token context",
        )
    others = {n: size for n, size in sizes.items() if n not in (_TEXT, _TOKEN_IDS)}
    if sum(others.values()) > OTHER_BYTES:
        largest = max(others, key=lambda n: others[n])
        name = _FIELDS[largest].name if largest in _FIELDS else "request"
        raise InvalidRequest(
            name, f"{sum(others.values())} bytes besides the prompt, at most {OTHER_BYTES}"
        )


def field_sizes(data: bytes) -> dict[int, int] | None:
    """Bytes per top-level field number (a length-delimited field's contents, any other
    field's tag and value); None if the bytes are malformed."""
    sizes: dict[int, int] = {}
    pos, count = 0, 0
    while pos < len(data):
        count += 1
        if count > MAX_FIELDS:
            raise InvalidRequest("request", f"more than {MAX_FIELDS} top-level fields")
        start = pos
        key, pos = _varint(data, pos)
        if key is None:
            return None
        kind = key & 7
        if kind == 0:
            _, pos = _varint(data, pos)
            if pos < 0:
                return None
        elif kind == 1:
            pos += 8
        elif kind == 2:
            length, pos = _varint(data, pos)
            if length is None:
                return None
            pos += length
            start = pos - length
        elif kind == 5:
            pos += 4
        else:  # groups, or not a wire type
            return None
        if pos > len(data):
            return None
        sizes[key >> 3] = sizes.get(key >> 3, 0) + pos - start
    return sizes


def _varint(data: bytes, pos: int) -> tuple[int | None, int]:
    """The varint at ``pos`` and the position after it; (None, -1) if malformed."""
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None, -1
