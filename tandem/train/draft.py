"""Trains a draft of any kind for a target and records how (``training.json``).

One step: a batch of training blocks (and, when given, target-written sequences), the frozen
target's hidden states and logits on it, the kind's loss (:mod:`tandem.train.heads`,
:mod:`tandem.train.standalone`). Held-out figures before and after training come from the same
loss on held-out blocks. The saved checkpoint is loaded back through the draft loader of its
kind before this returns, so a checkpoint that would not load is never reported as trained.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from tandem.config import DTYPES, torch_dtype
from tandem.models import draft_loader
from tandem.train.blocks import Batches, TokenData
from tandem.train.features import FrozenTarget, TargetOutputs
from tandem.train.heads import Eagle3Trainer, EagleTrainer, Metrics, MTPTrainer
from tandem.train.loop import (
    Log,
    LoopSettings,
    autocast,
    chunks,
    log_stdout,
    run,
    seed_everything,
)
from tandem.train.standalone import StandaloneShape, StandaloneTrainer

KINDS = ("eagle3", "eagle", "mtp", "model")


@dataclass(frozen=True, kw_only=True)
class DraftSettings:
    """What ``tandem train-draft`` trains and how."""

    kind: str  # one of KINDS
    loop: LoopSettings = field(
        default_factory=lambda: LoopSettings(steps=1000, lr=2e-3, warmup_steps=50, grad_clip=0.5)
    )
    batch_size: int = 32  # sequences per step
    seq_len: int | None = None  # None: the data's block length
    ttt_steps: int = 5  # draft depths trained (eagle3, eagle; mtp: heads + self-fed depths)
    num_heads: int = 2  # mtp
    draft_vocab_size: int = 4096  # eagle3, capped at the target's vocabulary
    generated_fraction: float = 0.5  # share of each batch from target-written sequences
    hard_weight: float = 0.5  # label loss: weight of CE against the target's greedy token
    model_shape: StandaloneShape = field(default_factory=StandaloneShape)
    eval_blocks: int = 64
    seed: int = 0
    save_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {KINDS}")
        for name in ("batch_size", "ttt_steps", "num_heads", "draft_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if not 0.0 <= self.hard_weight <= 1.0:
            raise ValueError(f"hard_weight: must be in [0, 1], got {self.hard_weight}")
        if not 0.0 <= self.generated_fraction <= 1.0:
            raise ValueError(
                f"generated_fraction: must be in [0, 1], got {self.generated_fraction}"
            )
        if self.save_dtype not in DTYPES:
            raise ValueError(f"save_dtype: {self.save_dtype!r} is not one of {sorted(DTYPES)}")


class Trainer(Protocol):
    layers: tuple[int, ...]

    @property
    def modules(self) -> list[Any]: ...

    def params(self) -> list[nn.Parameter]: ...

    def losses(self, ids: torch.Tensor, target: TargetOutputs) -> tuple[torch.Tensor, Metrics]: ...

    def save(self, dtype: torch.dtype) -> None: ...


def train_draft(
    target_dir: Path,
    out: Path,
    data: TokenData,
    settings: DraftSettings,
    device: torch.device,
    *,
    data_info: dict[str, Any] | None = None,
    log: Log = log_stdout,
) -> dict[str, Any]:
    """Trains, saves to ``out`` (config.json, model.safetensors, training.json) and returns the
    record written to ``training.json``."""
    seed_everything(settings.seed)
    if settings.seq_len is not None:
        data = data.with_seq_len(settings.seq_len)
    out.mkdir(parents=True, exist_ok=True)
    target = FrozenTarget(target_dir, device)
    trainer = _trainer(settings, target, out, data, device)
    name = settings.kind
    num_params = sum(p.numel() for p in trainer.params())
    next_batch, n_gen = _sampler(data, settings)
    log(
        f"[{name}] {num_params / 1e6:.2f} M trainable parameters; batches of "
        f"{settings.batch_size - n_gen} corpus blocks + {n_gen} target-written sequences of "
        f"{data.seq_len} tokens"
    )

    def step() -> tuple[torch.Tensor, int, Metrics]:
        ids = next_batch().to(device, non_blocking=True)
        outputs = target.run(ids, trainer.layers)
        with autocast(device):
            loss, metrics = trainer.losses(ids, outputs)
        return loss, ids.numel(), metrics

    heldout = data.heldout[: settings.eval_blocks]
    before = evaluate(trainer, target, heldout, settings.batch_size, device)
    result = run(name, trainer.params(), step, settings.loop, log=log)
    after = evaluate(trainer, target, heldout, settings.batch_size, device)
    trainer.save(torch_dtype(settings.save_dtype))
    check_loads(settings.kind, out, target_dir)
    record = {
        "kind": settings.kind,
        "target": str(target_dir),
        "settings": asdict(settings),
        "data": {
            **(data_info or {}),
            "seq_len": data.seq_len,
            "train_blocks": int(data.train.shape[0]),
            "generated_sequences": 0 if data.generated is None else int(data.generated.shape[0]),
            "heldout_blocks": int(heldout.shape[0]),
        },
        "trainable_parameters": num_params,
        "steps": result.steps,
        "seconds": round(result.seconds, 1),
        "tokens": result.tokens,
        "train": {"loss": result.final_loss, **result.metrics},
        "heldout_before": before,
        "heldout": after,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shown = " ".join(f"{k} {v:.4f}" for k, v in after.items())
    log(
        f"[{name}] done: {result.steps} steps in {result.seconds:.0f}s; held-out {shown}; "
        f"saved {out}"
    )
    return record


@torch.no_grad()
def evaluate(
    trainer: Trainer,
    target: FrozenTarget,
    blocks: torch.Tensor,  # [num_blocks, seq_len]
    batch: int,
    device: torch.device,
) -> dict[str, float]:
    """The training loss and metrics, averaged over ``blocks`` (empty dict without blocks)."""
    if blocks.shape[0] == 0:
        return {}
    for module in trainer.modules:
        module.eval()
    sums: dict[str, float] = {}
    for part in chunks(blocks.shape[0], batch):
        ids = blocks[part].to(device)
        outputs = target.run(ids, trainer.layers)
        with autocast(device):
            loss, metrics = trainer.losses(ids, outputs)
        weight = ids.shape[0] / blocks.shape[0]
        for key, value in {"loss": loss, **metrics}.items():
            sums[key] = sums.get(key, 0.0) + float(value) * weight
    for module in trainer.modules:
        module.train()
    return sums


def _sampler(data: TokenData, settings: DraftSettings) -> tuple[Callable[[], torch.Tensor], int]:
    """A function returning the next batch [batch_size, seq_len] of training blocks and
    target-written sequences, and how many of each batch are the latter."""
    gen = data.generated
    use_gen = gen is not None and gen.shape[0] > 0 and settings.generated_fraction > 0
    n_gen = round(settings.batch_size * settings.generated_fraction) if use_gen else 0
    sources = [data.train] + ([gen] if n_gen and gen is not None else [])
    counts = [settings.batch_size - n_gen] + ([n_gen] if n_gen else [])
    batches = Batches([s.shape[0] for s in sources], counts, settings.seed)

    def next_batch() -> torch.Tensor:
        return torch.cat([s[rows] for s, rows in zip(sources, batches.next(), strict=True)])

    return next_batch, n_gen


def check_loads(kind: str, path: Path, target_dir: Path) -> None:
    """Loads ``path`` as its kind's runtime does (float32, CPU); raises if it does not."""
    loaders = {
        "eagle3": draft_loader.load_eagle3,
        "eagle": draft_loader.load_eagle,
        "mtp": draft_loader.load_mtp,
        "model": draft_loader.load_standalone,
    }
    loaders[kind](path, target_dir)


def _trainer(
    settings: DraftSettings, target: FrozenTarget, out: Path, data: TokenData, device: torch.device
) -> Trainer:
    dtype = torch_dtype(settings.save_dtype)
    layers, seed, ttt = target.num_layers, settings.seed, settings.ttt_steps
    if settings.kind == "eagle3":
        vocab = int(target.config.vocab_size)
        streams = [data.train.flatten()]
        if data.generated is not None:
            streams.append(data.generated.flatten())
        counts = torch.bincount(torch.cat(streams), minlength=vocab)[:vocab]  # [V]
        return Eagle3Trainer(
            out,
            target.path,
            num_target_layers=layers,
            token_counts=counts,
            draft_vocab_size=min(settings.draft_vocab_size, vocab),
            ttt_steps=ttt,
            hard_weight=settings.hard_weight,
            seed=seed,
            save_dtype=dtype,
            device=device,
        )
    if settings.kind == "eagle":
        return EagleTrainer(
            out,
            target.path,
            num_target_layers=layers,
            ttt_steps=ttt,
            hard_weight=settings.hard_weight,
            seed=seed,
            save_dtype=dtype,
            device=device,
        )
    if settings.kind == "mtp":
        return MTPTrainer(
            out,
            target.path,
            num_target_layers=layers,
            num_heads=settings.num_heads,
            ttt_steps=ttt,
            hard_weight=settings.hard_weight,
            seed=seed,
            save_dtype=dtype,
            device=device,
        )
    return StandaloneTrainer(
        out, target, shape=settings.model_shape, hard_weight=settings.hard_weight, device=device
    )
