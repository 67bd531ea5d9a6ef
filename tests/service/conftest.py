"""Fixtures of the service tests: the two test tokenizers (the gateway's), and the draft
service's checkpoints and a server on each of its streams."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.testing.random_model import write_tokenizer
from tests.helpers.draft_service import ckpts, server  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Word-level tokenizer: id i >= 4 is the word ``w<i>``; <s>=1 is prepended to texts."""
    path = tmp_path_factory.mktemp("words")
    write_tokenizer(path, 64)
    return path


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level BPE without merges: one token per UTF-8 byte, so characters span tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("bytes")
    vocab = {"<s>": 0, "</s>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return path
