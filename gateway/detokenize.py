"""Incremental detokenization and stop-string matching for one streamed request.

`IncrementalDetokenizer` turns committed token ids into text deltas the way TGI and vLLM do: it
decodes a short window of ids twice, with and without the newest ones, and emits the difference,
so tokenizers whose pieces depend on their neighbours (SentencePiece's leading spaces, WordPiece
joins) produce the same text as decoding the whole sequence. A delta that ends in U+FFFD is held
back until the next id completes the character, so no chunk carries half a UTF-8 sequence. The
window starts inside the prompt, so the streamed text is the continuation of the prompt's text
(it may begin with a space).

`StopStringMatcher` scans that text for the request's stop strings and releases only text that
cannot be the start of a match, so a stop string split across chunks is still found and the
client never sees any part of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
        self._ids: list[int] = list(prompt_ids)
        # ids[prefix_offset:read_offset] is text already emitted; ids[read_offset:] is not yet.
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT, 0)

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends committed ids; returns the text they complete (maybe empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end of the sequence)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

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
