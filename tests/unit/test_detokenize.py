"""The gateway's incremental detokenizer (tokenizers' DecodeStream, and its windowed path for
Python tokenizers): chunks in any grouping add up to the continuation's text, never carry half
a character, and a decoder that rewrites earlier text does not fail the request."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.detokenize import IncrementalDetokenizer
from tandem.apps.embedded import family_dir
from tandem.models.tokenizer import load_tokenizer

TEXT = "héllo wörld 😀 日本語 ✓ def f(x):\n    return x ** 2  # ok"


def _byte_level() -> Any:
    """Byte-level BPE without merges: one token per UTF-8 byte (a fast tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _byt5() -> Any:
    """transformers' ByT5: a Python tokenizer (no Rust backend), one token per byte."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


TOKENIZERS = {
    "byte_level": _byte_level,
    "byt5": _byt5,
    "embedded": lambda: load_tokenizer(family_dir() / "target"),
}
_LOADED: dict[str, Any] = {}


def tokenizer(name: str) -> Any:
    if name not in _LOADED:
        _LOADED[name] = TOKENIZERS[name]()
    return _LOADED[name]


def stream(tok: Any, prompt: list[int], groups: list[list[int]], **options: Any) -> list[str]:
    detokenizer = IncrementalDetokenizer(tok, prompt, **options)
    return [detokenizer.add(group) for group in groups] + [detokenizer.flush()]


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in pairwise(bounds)]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=25, deadline=None)
@given(cut=st.integers(1, len(TEXT) - 1), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_chunks_add_up_to_the_continuation(name: str, cut: int, cuts: list[int]) -> None:
    tok = tokenizer(name)
    prompt_text, completion_text = TEXT[:cut], TEXT[cut:]
    prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
    completion = tok(completion_text, add_special_tokens=False)["input_ids"]
    chunks = stream(tok, prompt, split(completion, cuts))
    assert all("\ufffd" not in chunk for chunk in chunks)
    whole = tok.decode(prompt + completion, clean_up_tokenization_spaces=False)
    start = len(tok.decode(prompt, clean_up_tokenization_spaces=False))
    assert "".join(chunks) == whole[start:]


@pytest.mark.parametrize("name", ["byte_level", "byt5"])
def test_a_character_split_across_tokens_is_held_back(name: str) -> None:
    tok = tokenizer(name)
    prompt = tok("a", add_special_tokens=False)["input_ids"]
    emoji = tok("😀", add_special_tokens=False)["input_ids"]
    assert len(emoji) == 4
    assert stream(tok, prompt, [[i] for i in emoji]) == ["", "", "", "😀", ""]
    # Cut short inside the character: flush releases what the whole decode would show.
    cut = stream(tok, prompt, [emoji[:2]])
    whole = tok.decode(prompt + emoji[:2], clean_up_tokenization_spaces=False)
    assert "".join(cut) == whole[len("a") :] and cut[0] == ""


def test_special_tokens_are_skipped_only_when_asked() -> None:
    tok = tokenizer("byte_level")
    ids = tok("ab", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    assert "".join(stream(tok, [], [ids[:1], [eos], ids[1:]])) == "a</s>b"
    skipped = stream(tok, [], [ids[:1], [eos], ids[1:]], skip_special_tokens=True)
    assert skipped == ["a", "", "b", ""]


def test_a_prompt_ending_inside_a_character_is_not_streamed_back() -> None:
    tok = tokenizer("byte_level")
    prompt = tok("abcdé", add_special_tokens=False)["input_ids"]
    text = "".join(stream(tok, prompt[:-1], [prompt[-1:], tok("xy")["input_ids"]]))
    assert text.endswith("xy") and "abcd" not in text


def test_a_decoder_that_rewrites_earlier_text_falls_back_to_the_window(tmp_path: Path) -> None:
    """DecodeStream raises when a new token changes the text before it (here a Replace after
    Fuse turns "ab" into "XYZ"); the request goes on with the windowed difference."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<s>"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "XYZ")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    assert stream(tok, [4], [[2], [3], [4], [2]]) == ["a", "YZ", "c", "a", ""]
