"""Random-weight benchmark checkpoints of realistic shapes, written fast (never downloaded).

A preset names a target (a Llama config), an EAGLE-3 head for it (draft vocabulary, aux
layers) and a standalone assistant LM with the same vocabulary for transformers' assisted
generation. The target's tensors are drawn on the device in its dtype, one at a time, and
written as safetensors shards with an index, so a Llama-3.1-8B-shaped bf16 target (16 GB)
takes seconds of GPU time plus the disk. The EAGLE-3 head comes from
``tandem.testing.random_drafts`` (its SpecForge layout is tested there).

Random weights mean random acceptance: pair these with ``--simulate-accept-length``.

    python -m tandem.bench.models --preset llama-3.1-8b --out DIR --device cuda
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.bench.presets import PRESETS, SPECIALS, Preset
from tandem.config import DTYPES, torch_dtype


@dataclass(frozen=True)
class PresetPaths:
    target: Path
    draft: Path  # EAGLE-3 head
    assistant: Path  # standalone LM with the target's vocabulary


def llama_config(overrides: dict[str, Any], dtype: str) -> Any:
    from transformers import LlamaConfig

    kwargs = {"architectures": ["LlamaForCausalLM"], **SPECIALS, **overrides, "dtype": dtype}
    return LlamaConfig(**kwargs)


def write_preset(
    preset: Preset,
    root: Path,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> PresetPaths:
    """Writes (or reuses, when ``root`` holds the same preset, dtype and seed) the preset's
    target, EAGLE-3 head and assistant under ``root``."""
    from tandem.testing.random_drafts import make_eagle3_checkpoint
    from tandem.testing.random_model import write_tokenizer

    dtype = dtype or preset.dtype
    paths = PresetPaths(root / "target", root / "eagle3", root / "assistant")
    stamp = {"preset": preset.name, "dtype": dtype, "seed": seed}
    marker = root / "bench-preset.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return paths
    marker.unlink(missing_ok=True)
    target = llama_config(preset.target, dtype)
    write_llama(paths.target, target, device=device, seed=seed, progress=progress)
    write_tokenizer(paths.target, target.vocab_size)
    make_eagle3_checkpoint(
        paths.draft,
        paths.target,
        draft_vocab_size=preset.draft_vocab_size,
        aux_layer_ids=preset.aux_layer_ids,
        convention="specforge",
        seed=seed + 1,
        dtype=torch_dtype(dtype),
    )
    assistant = llama_config({**preset.target, **preset.assistant}, dtype)
    write_llama(paths.assistant, assistant, device=device, seed=seed + 2, progress=progress)
    write_tokenizer(paths.assistant, assistant.vocab_size)
    marker.write_text(json.dumps(stamp))
    return paths


def llama_tensors(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes, in file order."""
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        out.append(("lm_head.weight", (v, h)))
    return out


def write_llama(
    path: Path,
    config: Any,
    *,
    device: str = "cpu",
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    progress: Callable[[str, int, int], None] | None = None,
) -> Path:
    """A random Llama checkpoint from ``config`` (a LlamaConfig): weights N(0, 0.02), norms
    near 1, drawn on ``device`` in the config's dtype; shards of at most ``shard_bytes``.
    ``progress(name, bytes_done, bytes_total)`` is called after every tensor."""
    dtype = torch_dtype(str(config.dtype).removeprefix("torch."))
    specs = llama_tensors(config)
    size = torch.tensor([], dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * size
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    total = sum(math.prod(s) for _, s in specs) * size
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    config.save_pretrained(path)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    done = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        if len(shards) == 1:
            fname = "model.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in shard:
            t = torch.empty(shape, dtype=dtype, device=device)
            if name.endswith("norm.weight"):
                t.normal_(1.0, 0.1, generator=gen)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.cpu()
            weight_map[name] = fname
            done += t.numel() * size
            if progress is not None:
                progress(path.name, done, total)
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def show(name: str, done: int, total: int) -> None:
        print(f"\r{name}: {done / 2**30:.2f} / {total / 2**30:.2f} GiB", end="", flush=True)

    paths = write_preset(
        PRESETS[args.preset], args.out, device=args.device, dtype=args.dtype, progress=show
    )
    print()
    print(json.dumps({k: str(v) for k, v in vars(paths).items()}))


if __name__ == "__main__":
    main()
