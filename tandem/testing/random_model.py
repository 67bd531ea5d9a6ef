"""Random-weight Hugging Face checkpoints for tests, demos and benchmarks (never downloaded).

``python -m tandem.testing.random_model --arch llama --out DIR`` writes one with a word-level
tokenizer whose words are ``w<id>``, so any id decodes and any text of such words encodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Small but not degenerate: GQA (4 heads over 2 KV heads), an odd vocabulary, 3 layers so that
# EAGLE-style captures of several layers are meaningful.
BASE: dict[str, Any] = {
    "vocab_size": 6000,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

ARCHS = ("llama", "qwen2", "qwen3")


def make_config(arch: str, **overrides: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kwargs = dict(BASE)
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # Qwen3 decouples head_dim from hidden / heads
    kwargs.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    return cls(**kwargs)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose words are ``w<id>``, so any id decodes and any text of such
    words encodes; specials <pad>=0, <s>=1, </s>=2 match BASE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.save_pretrained(path)


def make_checkpoint(
    path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Writes a random-weight ``arch`` model with save_pretrained and returns its directory."""
    from transformers import AutoModelForCausalLM

    config = make_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init leaves norms at 1 and biases at 0: perturb them so the test sees them.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        write_tokenizer(path, config.vocab_size)
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_checkpoint(args.out, args.arch, seed=args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
