"""The reference family's tokenizer: byte-level BPE trained with ``tokenizers``.

Saved as a Hugging Face fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) that
``AutoTokenizer.from_pretrained`` loads with ``<s>`` prepended to every encoding (the documents
it was trained on start with it too), ``</s>`` as EOS and ``<pad>`` as id 0. Byte-level: every
string encodes and ``decode(encode(text)) == text`` exactly (no cleanup of spaces). It carries a
plain chat template (``chat_template.jinja``: ``<s>``, then ``### role`` and the content per
message) so chat front ends, the SMG router's among them, can serve it; the model never saw a
conversation, it continues the text as code.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '### ' + message['role'] + '\\n' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int, model_max_length: int = 2048) -> Any:
    """A ``PreTrainedTokenizerFast`` trained on ``texts`` (deterministic for the same texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size: must hold the 256 bytes and the specials, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )


def sample_texts(texts: Iterable[str], max_bytes: int) -> list[str]:
    """The first texts (in the given order) whose UTF-8 size fits in ``max_bytes``."""
    out: list[str] = []
    used = 0
    for text in texts:
        size = len(text.encode())
        if used + size > max_bytes and out:
            break
        out.append(text)
        used += size
    return out


def save_tokenizer(tokenizer: Any, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
