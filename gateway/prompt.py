"""A Generate request's prompt as token ids, its size checked before any work is spent on it.

A prompt may fill the model's context less one token (room for the first new one). Both forms
are measured before they are read:

- token ids: their count, before the ids are copied out of the message or scanned;
- text: its UTF-8 length, before it is tokenized, against ``bytes_per_token`` bytes for each
  token of the context. Generous on purpose (English averages about four bytes per token, code
  and CJK text fewer than eight; no real prompt averages sixteen), so a prompt the model could
  take is never refused by its bytes; a longer one is refused without tokenizing it, and one
  within the bound that tokenizes to too many tokens is refused by its count.

Tokenizing runs off the event loop, in a small pool of threads (a transformers tokenizer's
batch encoding releases the GIL while it works), so a long prompt does not stall the other
clients' streams. The pool is bounded: prompts beyond its threads wait their turn. Before any
of this, the receive cap (``GatewayConfig.max_request_bytes``) bounds the message and the
screen (``gateway.screen``) its fields, by their lengths, before the message is parsed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tandem.errors import InvalidRequest
from tandem.v1 import gateway_pb2, target_pb2

BYTES_PER_TOKEN = 16  # the bound on a text prompt's bytes, per token of the context


class PromptReader:
    """Reads prompts into token ids for one gateway (its tokenizer and tokenizing threads)."""

    def __init__(
        self, tokenizer: Any, *, bytes_per_token: int = BYTES_PER_TOKEN, threads: int = 2
    ) -> None:
        if bytes_per_token < 1 or threads < 1:
            raise ValueError("bytes_per_token and threads must be >= 1")
        self.tokenizer = tokenizer  # a transformers tokenizer
        self.bytes_per_token = bytes_per_token
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    async def read(
        self, request: gateway_pb2.GenerateRequest, info: target_pb2.TargetServiceGetInfoResponse
    ) -> list[int]:
        """The prompt's token ids; InvalidRequest names the field (``prompt``, ``text`` or
        ``token_ids``) of a prompt that is missing, empty, too long or outside the vocabulary."""
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequest("prompt", "set text or token_ids")
        if which == "text":
            special = not request.HasField("add_special_tokens") or request.add_special_tokens
            prompt_ids = await self._tokenize(request.text, info.max_model_len, special)
        else:
            prompt_ids = _copy_ids(request.token_ids.ids, info.max_model_len)
        if not prompt_ids:
            raise InvalidRequest(which, "the prompt has no tokens")
        _check_fits(which, len(prompt_ids), info.max_model_len)
        if bad := [t for t in prompt_ids if t >= info.vocab_size]:
            raise InvalidRequest(which, f"ids {bad[:4]} outside [0, {info.vocab_size})")
        return prompt_ids

    def close(self) -> None:
        """Lets the threads go once the prompts they hold are read."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _tokenize(self, text: str, max_model_len: int, special: bool) -> list[int]:
        if not text:
            raise InvalidRequest("text", "must not be empty")
        limit = max_model_len * self.bytes_per_token
        # A character is at least one byte: most oversize texts are refused without encoding.
        size = len(text) if len(text) > limit else len(text.encode())
        if size > limit:
            raise InvalidRequest(
                "text",
                f"at least {size} bytes; a prompt for the {max_model_len}-token context may take "
                f"at most {limit} ({self.bytes_per_token} per token)",
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._encode, text, special)

    def _encode(self, text: str, special: bool) -> list[int]:
        # The tokenizer's call (a batch of one) works without the GIL; ``encode`` holds it.
        ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
        return [int(t) for t in ids]


def _copy_ids(ids: Sequence[int], max_model_len: int) -> list[int]:
    """The ids as a list, their count checked first (``len`` of a repeated field is free)."""
    _check_fits("token_ids", len(ids), max_model_len)
    return list(ids)


def _check_fits(field: str, num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise InvalidRequest(field, f"{num_tokens} tokens fill the context of the model")
