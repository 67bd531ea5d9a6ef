"""Incremental detokenization and stop-string matching for one streamed request.

`IncrementalDetokenizer` turns committed token ids into text deltas with the tokenizers
library's `DecodeStream` (the algorithm TGI and vLLM use): it decodes the ids of the last delta
with and without the new ones and emits the difference, so tokenizers whose pieces depend on
their neighbours (SentencePiece's leading spaces, WordPiece joins, byte-level BPE) produce the
same text as decoding the whole sequence, and holds text that ends in U+FFFD back until the
next id completes the character, so no chunk carries half a UTF-8 sequence. The first window
starts inside the prompt, so the streamed text is the continuation of the prompt's text (it may
begin with a space). A tokenizer without a Rust backend (transformers' Python tokenizers) runs
the same algorithm through its own ``decode``; so does a request whose decoder turns out not to
keep a text's prefix (tokenizers raises; the windowed difference goes on) and one whose prompt
ends inside a character (`DecodeStream` would emit the prompt's window as text).

`StopStringMatcher` scans that text for the request's stop strings and releases only text that
cannot be the start of a match, so a stop string split across chunks is still found and the
client never sees any part of it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

# How far into the prompt the first decode window reaches: enough context for pieces whose
# text depends on the previous token (TGI and vLLM use the same 5).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence; one instance per request."""

    def __init__(
        self,
        tokenizer: Any,  # a transformers tokenizer (PreTrainedTokenizerBase)
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The ids of the last text emitted (first: the prompt's tail), and those after them
        # whose text is held back: the window DecodeStream keeps, mirrored for flush().
        self._context: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._held: list[int] = []
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: tuple[DecodeStream, Tokenizer] | None = None
        if isinstance(backend, Tokenizer) and not self._decode(self._context).endswith(
            _REPLACEMENT
        ):
            stream = DecodeStream(self._context, skip_special_tokens=skip_special_tokens)
            self._stream = (stream, backend)

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends committed ids; returns the text they complete (maybe empty)."""
        if not token_ids:
            return ""
        self._held.extend(token_ids)
        text = self._step(list(token_ids))
        if text is None:
            return ""
        self._context, self._held = self._held, []
        return text

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end of the sequence)."""
        if not self._held:
            return ""
        text = self._window(final=True) or ""
        self._context, self._held = self._held, []
        return text

    def _step(self, token_ids: list[int]) -> str | None:
        if self._stream is not None:
            try:
                stream, backend = self._stream
                return stream.step(backend, token_ids)
            except Exception as exc:  # tokenizers raises a bare Exception (InvalidPrefix)
                logger.debug("DecodeStream gave up (%s); windowed decode from here", exc)
                self._stream = None
        return self._window(final=False)

    def _window(self, *, final: bool) -> str | None:
        """What DecodeStream computes, through the tokenizer's ``decode``: the held ids' text
        after the context's, or None while it would be empty or end in an incomplete
        character (unless ``final``)."""
        prefix = self._decode(self._context)
        text = self._decode(self._context + self._held)
        if not final and (len(text) <= len(prefix) or text.endswith(_REPLACEMENT)):
            return None
        return text[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return text


class StopStringMatcher:
    """Finds the first stop string in a growing text and holds back possible partial matches."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._stop_strings = tuple(stop_strings)
        self._longest = max((len(s) for s in self._stop_strings), default=0)
        self._text = ""  # text received and not yet released
        self.matched: str | None = None  # the stop string found, once one is

    def feed(self, delta: str) -> str:
        """Adds text; returns what may be released now. After a match, returns the text before
        the stop string (once) and then nothing; `matched` names the string."""
        if self.matched is not None:
            return ""
        self._text += delta
        if not self._stop_strings:
            return self._release(len(self._text))
        found = self._find()
        if found is not None:
            index, stop = found
            self.matched = stop
            return self._release(index)
        return self._release(len(self._text) - self._partial_match_len())

    def flush(self) -> str:
        """Releases what is held back: the request ended without completing a match."""
        if self.matched is not None:
            return ""
        return self._release(len(self._text))

    def _find(self) -> tuple[int, str] | None:
        # Earliest match wins; at one position the longest string wins, so "ab" beats "a".
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            index = self._text.find(stop)
            if index < 0:
                continue
            if best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1])):
                best = (index, stop)
        return best

    def _partial_match_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for n in range(min(self._longest - 1, len(self._text)), 0, -1):
            tail = self._text[-n:]
            if any(stop.startswith(tail) for stop in self._stop_strings):
                return n
        return 0

    def _release(self, end: int) -> str:
        released, self._text = self._text[:end], self._text[end:]
        return released
