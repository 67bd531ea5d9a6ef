"""Loads draft checkpoints (EAGLE-3, EAGLE-1/2, NextN MTP heads, standalone LMs) for a target.

Every loader takes the draft's directory and the target's: drafts borrow the target's
embedding and ``lm_head`` (read alone from the target's safetensors, tied embeddings followed)
and must agree with its widths and vocabulary. Loading is strict, as for targets: every
parameter comes from exactly one tensor, shapes are checked against
docs/draft-formats.md section 5, unknown or missing tensors raise
:class:`CheckpointError` naming them, and pickle checkpoints are refused. RoPE comes from the
draft's own config through :class:`ModelConfig`, exactly as for targets.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from tandem.errors import CheckpointError
from tandem.models.config import ModelConfig
from tandem.models.decoder import MLP, Attention, Rotary
from tandem.models.draft import DraftModule, StandaloneDraft
from tandem.models.eagle import Eagle3Module, EagleModule, resolve_aux_layer_ids
from tandem.models.loader import checkpoint_files, load_model
from tandem.models.mtp import MTPHead

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=DraftModule)
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_IGNORED = re.compile(r"rotary_emb\.")  # buffers some exporters save; we recompute them
_HEAD_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Sub-names of an MTP layer that belong to the head rather than to its decoder layer.
_MTP_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


@dataclass(frozen=True)
class _Target:
    config: ModelConfig
    embed: torch.Tensor  # [V, H_t]
    lm_head: torch.Tensor  # [V, H_t]


def load_eagle3(
    path: str | Path,
    target_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Eagle3Module:
    """An EAGLE-3 head (SafeAILab / SpecForge layout; SGLang's ``model.`` prefix accepted).

    Ownership (docs/draft-formats.md 1.6): ``embed_tokens`` is the checkpoint's if present, else the
    target's (refused when ``hidden_size != target_hidden_size``); ``lm_head`` is the
    checkpoint's, else (only when ``V_d == V``) the embedding if ``tie_word_embeddings``, else
    the target's. ``d2t`` may be absent only when ``V_d == V``; ``t2d`` is derived when absent.
    Aux-layer ids: :func:`resolve_aux_layer_ids`.
    """
    path = Path(path)
    raw = _raw_config(path)
    target = _read_target(Path(target_dir))
    tc = target.config
    _refuse_eagle3_variants(path, raw)
    config = _layer_config(path, raw)
    _check_fits(path, config, tc, hidden_key="target_hidden_size", raw=raw)
    aux_ids, convention = resolve_aux_layer_ids(raw, tc.num_layers)
    vocab_d = int(raw.get("draft_vocab_size") or config.vocab_size)
    module = _build(
        partial(
            Eagle3Module,
            config,
            target_hidden_size=tc.hidden_size,
            draft_vocab_size=vocab_d,
            aux_layer_ids=aux_ids,
            aux_id_convention=convention,
            fc_bias=bool(raw.get("bias", False)),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        ),
        config,
        dtype,
        device,
    )
    tensors = {_strip_model(n): t for n, t in _read(path, lambda n: True).items()}
    _borrow_eagle3_tensors(path, tensors, target, config, vocab_d, raw)
    _fill(module, tensors, path, lambda n: n)
    ids = torch.arange(vocab_d, device=module.d2t.device) + module.d2t  # [V_d] target ids
    if bool(((ids < 0) | (ids >= config.vocab_size)).any()):
        raise CheckpointError(f"{path}: d2t maps draft ids outside the target vocabulary")
    logger.info("EAGLE-3 head %s: aux layers %s (%s), V_d=%d", path, aux_ids, convention, vocab_d)
    return module.eval()


def _refuse_eagle3_variants(path: Path, raw: Mapping[str, Any]) -> None:
    """Variants (1.7) we do not implement are refused rather than misread."""
    for key, what in (
        ("norm_before_fc", "an fc input norm over the concatenated aux states"),
        ("fc_norm", "EAGLE-3.1 per-chunk fc norms"),
    ):
        if raw.get(key):
            raise CheckpointError(f"{path}: EAGLE-3 variant {key} is not supported ({what})")
    if "norm_output" in raw:  # either value is ambiguous
        raise CheckpointError(
            f"{path}: EAGLE-3 key norm_output is not supported: its meaning differs by producer "
            "(SpecForge: the norm before lm_head; vLLM / TRT-LLM: a post-norm recurrent state)"
        )
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True) is False:
        raise CheckpointError(f"{path}: eagle_config.use_aux_hidden_state=false is not supported")


def _borrow_eagle3_tensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    target: _Target,
    config: ModelConfig,
    vocab_d: int,
    raw: Mapping[str, Any],
) -> None:
    """Fills in what an EAGLE-3 checkpoint may leave out (see :func:`load_eagle3`)."""
    vocab = config.vocab_size
    if "embed_tokens.weight" not in tensors:
        if config.hidden_size != target.config.hidden_size:
            raise CheckpointError(
                f"{path}: missing tensors ['embed_tokens.weight'] (required when hidden_size "
                f"{config.hidden_size} != target hidden {target.config.hidden_size})"
            )
        tensors["embed_tokens.weight"] = target.embed
    if "lm_head.weight" not in tensors and vocab_d == vocab:
        tied = bool(raw.get("tie_word_embeddings", False))
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"] if tied else target.lm_head
    if "d2t" not in tensors and vocab_d == vocab:
        tensors["d2t"] = torch.zeros(vocab_d, dtype=torch.int64)
    if "t2d" not in tensors and "d2t" in tensors:
        t2d = torch.zeros(vocab, dtype=torch.bool)  # [V]
        ids = torch.arange(vocab_d) + tensors["d2t"].to(torch.int64)
        t2d[ids.clamp(0, vocab - 1)] = True  # out-of-range ids are refused after loading
        tensors["t2d"] = t2d


def load_eagle(
    path: str | Path,
    target_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> EagleModule:
    """An EAGLE-1/2 head. ``fc`` has a bias when the config says ``bias: true``, or, with no
    ``bias`` key, when the checkpoint holds ``fc.bias``. The checkpoint's ``embed_tokens`` and
    ``lm_head``, when present, are ignored for the target's (as SGLang does)."""
    path = Path(path)
    raw = _raw_config(path)
    target = _read_target(Path(target_dir))
    config = _layer_config(path, raw)
    if raw.get("qkv_bias"):  # Qwen2 heads written with a llama model_type
        config = replace(config, qkv_bias=True)
    _check_fits(path, config, target.config, hidden_key=None, raw=raw)
    tensors = {_strip_model(n): t for n, t in _read(path, lambda n: True).items()}
    for borrowed in ("embed_tokens.weight", "lm_head.weight"):
        tensors.pop(borrowed, None)
    fc_bias = bool(raw["bias"]) if "bias" in raw else "fc.bias" in tensors
    module = _build(lambda: EagleModule(config, fc_bias=fc_bias), config, dtype, device)
    tensors["embed_tokens.weight"] = target.embed
    tensors["lm_head.weight"] = target.lm_head
    _fill(module, tensors, path, lambda n: n)
    return module.eval()


def load_mtp(
    path: str | Path,
    target_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[MTPHead]:
    """The ``M = num_nextn_predict_layers`` NextN heads of ``path``, head ``k`` with shift 1+k.

    Head ``k`` is read from ``model.layers.{L + k}.*`` with ``L = num_hidden_layers``, or from
    ``model.layers.{k}.*`` when ``num_hidden_layers == M`` and no layer ``L`` exists (SGLang's
    ``export_deepseek_nextn.py`` layout). Layers below the first head and the other tensors of a
    full target checkpoint (DeepSeek ships its MTP layers inside it) are the target's and
    skipped; a layer past the last head is an error. ``embed_tokens`` / ``shared_head.head``
    are the head's own when present, else the target's.
    """
    path = Path(path)
    raw = _raw_config(path)
    target = _read_target(Path(target_dir))
    num_heads = int(raw.get("num_nextn_predict_layers") or 0)
    if num_heads < 1:
        raise CheckpointError(f"{path}: config has no num_nextn_predict_layers >= 1")
    config = _layer_config(path, raw)
    _check_fits(path, config, target.config, hidden_key=None, raw=raw)
    files = checkpoint_files(path)
    layer_ids = {int(m.group(1)) for n in _names(files) if (m := _HEAD_LAYER.match(n))}
    base = config.num_layers
    if base not in layer_ids and base == num_heads and 0 in layer_ids:
        base = 0
    if base not in layer_ids:
        raise CheckpointError(f"{path}: no MTP tensors under model.layers.{base}.")
    extra = sorted(i for i in layer_ids if i >= base + num_heads)
    if extra:
        raise CheckpointError(
            f"{path}: unexpected tensors under model.layers.{extra} "
            f"(num_nextn_predict_layers={num_heads} after layer {base})"
        )
    wanted = range(base, base + num_heads)
    found = _read(path, lambda n: (m := _HEAD_LAYER.match(n)) is not None and int(m[1]) in wanted)
    heads = []
    for k in range(num_heads):
        prefix = f"model.layers.{base + k}."
        tensors = {_mtp_ours(n[len(prefix) :]): t for n, t in found.items() if n.startswith(prefix)}
        tensors.setdefault("embed_tokens.weight", target.embed)
        tensors.setdefault("shared_head.head.weight", target.lm_head)
        head = _build(partial(MTPHead, config, head_index=k), config, dtype, device)
        _fill(head, tensors, path, partial(_mtp_ckpt_name, prefix))
        heads.append(head.eval())
    return heads


def load_standalone(
    path: str | Path,
    target_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> StandaloneDraft:
    """A small LM used as a draft. It must share the target's tokenizer: equal vocabularies
    when both directories hold one, and vocab sizes equal or differing only in padding rows
    beyond the tokenizer's length."""
    path, target_dir = Path(path), Path(target_dir)
    model = load_model(path, dtype=dtype, device=device)
    v_draft, v_target = model.config.vocab_size, ModelConfig.from_pretrained(target_dir).vocab_size
    tokenizers = [_tokenizer_vocab(p) for p in (path, target_dir)]
    if tokenizers[0] is not None and tokenizers[1] is not None and tokenizers[0] != tokenizers[1]:
        raise CheckpointError(f"{path}: its tokenizer differs from the target's ({target_dir})")
    known = next((t for t in tokenizers if t is not None), None)
    used = max(known.values()) + 1 if known else max(v_draft, v_target)
    if v_draft != v_target and min(v_draft, v_target) < used:
        raise CheckpointError(
            f"{path}: vocab_size {v_draft} is incompatible with the target's {v_target} "
            f"(the tokenizer uses {used} ids)"
        )
    return StandaloneDraft(model)


def _raw_config(path: Path) -> dict[str, Any]:
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint dir)")
    with open(path / "config.json") as f:
        raw: dict[str, Any] = json.load(f)
    return raw


def _layer_config(path: Path, raw: Mapping[str, Any]) -> ModelConfig:
    """The draft layer's architecture; a config without ``model_type`` is read as Llama."""
    if "model_type" in raw:
        return ModelConfig.from_pretrained(path)
    from transformers import LlamaConfig

    return ModelConfig.from_hf(LlamaConfig.from_dict(dict(raw)))


def _check_fits(
    path: Path,
    config: ModelConfig,
    tc: ModelConfig,
    *,
    hidden_key: str | None,
    raw: Mapping[str, Any],
) -> None:
    """The draft reads the target's hidden states and token ids: widths and V must agree."""
    hidden = int(raw.get(hidden_key) or config.hidden_size) if hidden_key else config.hidden_size
    if hidden != tc.hidden_size:
        name = hidden_key or "hidden_size"
        raise CheckpointError(f"{path}: {name} {hidden} != target hidden_size {tc.hidden_size}")
    if config.vocab_size != tc.vocab_size:
        raise CheckpointError(
            f"{path}: vocab_size {config.vocab_size} != target vocab_size {tc.vocab_size}"
        )
    if config.inv_freq != tc.inv_freq or config.rope_attention_scaling != tc.rope_attention_scaling:
        logger.warning("%s: draft RoPE differs from the target's; using the draft's", path)


def _read_target(target_dir: Path) -> _Target:
    """The target's config, embedding and lm_head (the embedding when tied); nothing else."""
    config = ModelConfig.from_pretrained(target_dir)
    names = ("model.embed_tokens.weight", "embed_tokens.weight", "lm_head.weight")
    found = _read(target_dir, lambda n: n in names)
    embed = found.get("model.embed_tokens.weight", found.get("embed_tokens.weight"))
    lm_head = embed if config.tie_word_embeddings else found.get("lm_head.weight")
    if embed is None or lm_head is None:
        wanted = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
        missing = [name for name, tensor in wanted.items() if tensor is None]
        raise CheckpointError(f"{target_dir}: target checkpoint lacks {missing}")
    return _Target(config=config, embed=embed, lm_head=lm_head)


def _names(files: list[Path]) -> list[str]:
    names: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def _read(path: Path, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors of checkpoint ``path`` whose names ``keep`` accepts (safetensors only)."""
    out: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if keep(name) and not _IGNORED.search(name):
                    out[name] = f.get_tensor(name)
    return out


def _strip_model(name: str) -> str:
    return name.removeprefix("model.")  # SGLang re-exports prefix all but lm_head


def _mtp_ours(sub: str) -> str:
    """A name inside an MTP layer -> ours: head tensors keep it, layer tensors go under
    ``decoder.``."""
    return sub if sub.startswith(_MTP_OWN) else f"decoder.{sub}"


def _mtp_ckpt_name(prefix: str, ours: str) -> str:
    return prefix + ours.removeprefix("decoder.")


def _build(
    factory: Callable[[], M], config: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> M:
    """``factory()`` allocated on ``device`` in ``dtype`` (contents filled by :func:`_fill`)."""
    with torch.device("meta"):
        module = factory()
    module.to_empty(device=device)
    module.to(dtype)  # floating tensors only: d2t / t2d keep int64 / bool
    for sub in module.modules():
        if isinstance(sub, Rotary):  # RoPE frequencies stay float32 whatever the dtype
            sub.inv_freq = torch.tensor(config.inv_freq, dtype=torch.float32, device=device)
    return module


def _layout(module: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, list[str]]]:
    """Checkpoint-style names (fused parameters split into their parts) -> expected shapes, and
    each fused parameter -> its part names in concatenation order."""
    shapes: dict[str, tuple[int, ...]] = {}
    fused: dict[str, list[str]] = {}
    for name, tensor in module.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        parent, _, kind = owner.rpartition(".")
        if kind not in _PARTS:
            shapes[name] = tuple(tensor.shape)
            continue
        sub = module.get_submodule(parent)
        if isinstance(sub, Attention):
            rows = [sub.q_size, sub.kv_size, sub.kv_size]
        else:
            assert isinstance(sub, MLP), f"{parent} holds {kind} but is {type(sub).__name__}"
            rows = [sub.intermediate_size] * 2
        parts = [f"{parent}.{p}.{leaf}" for p in _PARTS[kind]]
        for part, n in zip(parts, rows, strict=True):
            shapes[part] = (n, *tensor.shape[1:])
        fused[name] = parts
    return shapes, fused


def _fill(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],  # our names, fused parameters as their parts
    path: Path,
    ckpt_name: Callable[[str], str],  # our name -> the checkpoint's, for messages
) -> None:
    """Copies ``tensors`` into ``module``; every parameter and buffer exactly once."""
    shapes, fused = _layout(module)
    unknown = sorted(ckpt_name(n) for n in set(tensors) - set(shapes))
    if unknown:
        raise CheckpointError(f"{path}: unexpected tensors {unknown[:8]} ({len(unknown)} in all)")
    missing = sorted(ckpt_name(n) for n in set(shapes) - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:8]} ({len(missing)} in all)")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name]:
            raise CheckpointError(
                f"{path}: {ckpt_name(name)} has shape {tuple(tensor.shape)}, "
                f"expected {shapes[name]}"
            )
    with torch.no_grad():
        for name, dest in module.state_dict().items():
            parts = fused.get(name)
            src = torch.cat([tensors[p] for p in parts]) if parts else tensors[name]
            dest.copy_(src)


def _tokenizer_vocab(path: Path) -> dict[str, int] | None:
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    vocab: dict[str, int] = AutoTokenizer.from_pretrained(path).get_vocab()
    return vocab
