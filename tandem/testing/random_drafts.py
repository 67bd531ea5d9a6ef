"""Random-weight draft checkpoints for a given target, in the formats real heads ship in.

For tests and demos (never downloaded): EAGLE-3 (SpecForge layout, ``midlayer.*``, ``d2t`` /
``t2d``), EAGLE-1 (SafeAILab layout, ``layers.0.*`` without ``input_layernorm``) and DeepSeek
NextN-style MTP heads (``model.layers.{L + k}.*``), each as ``config.json`` +
``model.safetensors``. Tensor names are spelled out here from
docs/draft-formats.md, not derived from our modules, so the loader is tested
against the formats rather than against itself.

``python -m tandem.testing.random_drafts --kind eagle3 --target TARGET_DIR --out DIR``
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.models.config import ModelConfig
from tandem.models.eagle import AUX_ID_KEY

# Keys copied from the target's config into a draft's: RoPE must match the target's.
_ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings")


def make_eagle3_checkpoint(
    path: Path,
    target_dir: Path,
    *,
    draft_vocab_size: int | None = None,
    aux_layer_ids: tuple[int, ...] | list[int] | None = None,
    convention: str = "specforge",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """An EAGLE-3 head for ``target_dir``; returns ``path``.

    ``aux_layer_ids`` are written as given, in ``convention``'s numbering: ``"specforge"``
    nests them in ``eagle_config`` (output of layer x), ``"vllm"`` puts them at the top level
    (input of layer x), ``"default"`` writes none (they must be None). None with another
    convention picks the outputs of the first, middle and last target layers. The draft
    vocabulary (``draft_vocab_size``, default the target's V) is a random sorted subset of
    target ids, stored as ``d2t`` offsets and the ``t2d`` mask.
    """
    tc, raw = _target(target_dir)
    num_layers = tc.num_layers
    if convention not in ("specforge", "vllm", "default"):
        raise ValueError(f"convention: {convention!r} is not specforge, vllm or default")
    if convention == "default" and aux_layer_ids is not None:
        raise ValueError("aux_layer_ids: the default convention writes no ids")
    if aux_layer_ids is None and convention != "default":
        outputs = [0, (num_layers - 1) // 2, num_layers - 1]  # output convention
        aux_layer_ids = outputs if convention == "specforge" else [x + 1 for x in outputs]
    vocab, size = tc.vocab_size, tc.hidden_size
    vocab_d = vocab if draft_vocab_size is None else draft_vocab_size
    if not 1 <= vocab_d <= vocab:
        raise ValueError(f"draft_vocab_size: must be in [1, {vocab}], got {vocab_d}")
    config = _draft_config(tc, raw, architecture="LlamaForCausalLMEagle3")
    config["draft_vocab_size"] = vocab_d
    if convention == "specforge":
        config["eagle_config"] = {AUX_ID_KEY: list(aux_layer_ids or ())}
    elif convention == "vllm":
        config[AUX_ID_KEY] = list(aux_layer_ids or ())
    gen = torch.Generator().manual_seed(seed)
    layer = _plain_layer(tc)
    tensors = {"fc.weight": _linear(gen, size, 3 * size)}
    tensors |= _layer_tensors("midlayer.", layer, 2 * size, gen)
    tensors["midlayer.hidden_norm.weight"] = _norm(gen, size)
    tensors["norm.weight"] = _norm(gen, size)
    tensors["lm_head.weight"] = _linear(gen, vocab_d, size)
    used = torch.randperm(vocab, generator=gen)[:vocab_d].sort().values  # [V_d] target ids
    d2t = used - torch.arange(vocab_d)  # [V_d] int64 offsets
    t2d = torch.zeros(vocab, dtype=torch.bool)  # [V]
    t2d[used] = True
    _save(path, config, tensors, dtype, {"d2t": d2t, "t2d": t2d})
    return path


def make_eagle_checkpoint(
    path: Path,
    target_dir: Path,
    *,
    bias: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """An EAGLE-1 head for ``target_dir`` (``fc`` with a bias when ``bias``); returns ``path``.

    Like SafeAILab's uploads it has no ``input_layernorm``, final norm or ``lm_head``.
    """
    tc, raw = _target(target_dir)
    size = tc.hidden_size
    config = _draft_config(tc, raw, architecture="LlamaForCausalLM")
    config["bias"] = bias
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _linear(gen, size, 2 * size)}
    if bias:
        tensors["fc.bias"] = _bias(gen, size)
    tensors |= _layer_tensors("layers.0.", _plain_layer(tc), size, gen, input_norm=False)
    _save(path, config, tensors, dtype)
    return path


def make_mtp_checkpoint(
    path: Path,
    target_dir: Path,
    *,
    num_heads: int = 2,
    own_head: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """``num_heads`` NextN heads as ``model.layers.{L + k}.*`` beside a copy of the target's
    config (``num_nextn_predict_layers`` added); their decoder layers have the target's
    architecture. With ``own_head`` each head stores its own random ``embed_tokens`` and
    ``shared_head.head``; otherwise the loader takes the target's."""
    if num_heads < 1:
        raise ValueError(f"num_heads: must be >= 1, got {num_heads}")
    tc, raw = _target(target_dir)
    size, vocab = tc.hidden_size, tc.vocab_size
    config = dict(raw, num_nextn_predict_layers=num_heads)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for k in range(num_heads):
        prefix = f"model.layers.{tc.num_layers + k}."
        tensors[prefix + "enorm.weight"] = _norm(gen, size)
        tensors[prefix + "hnorm.weight"] = _norm(gen, size)
        tensors[prefix + "eh_proj.weight"] = _linear(gen, size, 2 * size)
        tensors |= _layer_tensors(prefix, tc, size, gen)
        tensors[prefix + "shared_head.norm.weight"] = _norm(gen, size)
        if own_head:
            tensors[prefix + "embed_tokens.weight"] = 0.05 * torch.randn(vocab, size, generator=gen)
            tensors[prefix + "shared_head.head.weight"] = _linear(gen, vocab, size)
    _save(path, config, tensors, dtype)
    return path


def _target(target_dir: Path) -> tuple[ModelConfig, dict[str, Any]]:
    with open(Path(target_dir) / "config.json") as f:
        raw: dict[str, Any] = json.load(f)
    return ModelConfig.from_pretrained(target_dir), raw


def _plain_layer(tc: ModelConfig) -> ModelConfig:
    """EAGLE draft layers are plain Llama layers whatever the target's architecture."""
    return replace(tc, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)


def _draft_config(tc: ModelConfig, raw: dict[str, Any], *, architecture: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_attention_heads": tc.num_heads,
        "num_key_value_heads": tc.num_kv_heads,
        "head_dim": tc.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": tc.rms_norm_eps,
        "vocab_size": tc.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tc.bos_token_id,
        "eos_token_id": list(tc.eos_token_ids),
    }
    config |= {k: raw[k] for k in _ROPE_KEYS if k in raw}
    return config


def _linear(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:  # [rows, cols]
    std = min(0.1, max(0.02, cols**-0.5))  # ~1/sqrt(fan_in), kept in [0.02, 0.1]
    return std * torch.randn(rows, cols, generator=gen)


def _norm(gen: torch.Generator, size: int) -> torch.Tensor:  # [size], near 1
    return 1.0 + 0.1 * torch.randn(size, generator=gen)


def _bias(gen: torch.Generator, size: int) -> torch.Tensor:  # [size]
    return 0.02 * torch.randn(size, generator=gen)


def _layer_tensors(
    prefix: str,
    c: ModelConfig,
    in_size: int,
    gen: torch.Generator,
    *,
    input_norm: bool = True,
) -> dict[str, torch.Tensor]:
    """One Llama-family decoder layer whose q/k/v read ``in_size`` features, HF names."""
    size, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out: dict[str, torch.Tensor] = {}
    if input_norm:
        out["input_layernorm.weight"] = _norm(gen, size)
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out[f"self_attn.{name}.weight"] = _linear(gen, rows, in_size)
        if c.qkv_bias:
            out[f"self_attn.{name}.bias"] = _bias(gen, rows)
    out["self_attn.o_proj.weight"] = _linear(gen, size, q)
    if c.o_bias:
        out["self_attn.o_proj.bias"] = _bias(gen, size)
    if c.qk_norm:
        out["self_attn.q_norm.weight"] = _norm(gen, c.head_dim)
        out["self_attn.k_norm.weight"] = _norm(gen, c.head_dim)
    out["post_attention_layernorm.weight"] = _norm(gen, size)
    inter = c.intermediate_size
    for name, shape in (("gate_proj", (inter, size)), ("up_proj", (inter, size))):
        out[f"mlp.{name}.weight"] = _linear(gen, *shape)
    out["mlp.down_proj.weight"] = _linear(gen, size, inter)
    if c.mlp_bias:
        for name, rows in (("gate_proj", inter), ("up_proj", inter), ("down_proj", size)):
            out[f"mlp.{name}.bias"] = _bias(gen, rows)
    return {prefix + name: t for name, t in out.items()}


def _save(
    path: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    exact: dict[str, torch.Tensor] | None = None,  # written as they are (index tensors)
) -> None:
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config, dtype=str(dtype).removeprefix("torch."))
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    out = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
    out |= exact or {}
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("eagle3", "eagle", "mtp"), required=True)
    parser.add_argument("--target", type=Path, required=True, help="target checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="draft checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.kind == "eagle3":
        make_eagle3_checkpoint(args.out, args.target, seed=args.seed)
    elif args.kind == "eagle":
        make_eagle_checkpoint(args.out, args.target, seed=args.seed)
    else:
        make_mtp_checkpoint(args.out, args.target, seed=args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
