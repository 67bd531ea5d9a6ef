"""Trains a small Llama target from scratch with transformers and saves it in HF format.

The architecture is plain Llama (GQA, RoPE, SwiGLU, RMSNorm, tied embeddings), i.e. what both
``transformers`` and Tandem's runtime load. The objective is next-token cross-entropy over
packed blocks; held-out loss is the same on held-out blocks (nats per predicted token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.train.blocks import Batches, TokenData
from tandem.train.loop import Log, LoopResult, LoopSettings, autocast, chunks, log_stdout, run
from tandem.train.tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass(frozen=True, kw_only=True)
class TargetSettings:
    """Architecture and optimisation of the target (defaults: the reference family's)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    batch_size: int = 128
    loop: LoopSettings = field(
        default_factory=lambda: LoopSettings(
            steps=3000, lr=3e-3, warmup_steps=100, weight_decay=0.1
        )
    )
    eval_blocks: int = 256  # held-out blocks evaluated (at most)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.num_heads < 1 or self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads: {self.num_heads} must divide hidden_size")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads")

    def hf_config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )

    def record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainedTarget:
    model: Any  # LlamaForCausalLM, float32 parameters on the training device
    loop: LoopResult
    heldout_loss: float
    num_params: int


def train_target(
    data: TokenData, settings: TargetSettings, device: torch.device, *, log: Log = log_stdout
) -> TrainedTarget:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(settings.seed)
    config = settings.hf_config()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    log(
        f"[target] {num_params / 1e6:.2f} M parameters, {data.train.shape[0]} train blocks of "
        f"{data.seq_len} tokens ({data.num_tokens / 1e6:.1f} M tokens), "
        f"{data.heldout.shape[0]} held-out blocks"
    )
    batches = Batches([data.train.shape[0]], [settings.batch_size], settings.seed)

    def step() -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        (rows,) = batches.next()
        ids = data.train[rows].to(device, non_blocking=True)
        with autocast(device):
            loss = model(input_ids=ids, labels=ids).loss
        return loss, ids.numel(), {}

    params = [p for p in model.parameters() if p.requires_grad]
    result = run("target", params, step, settings.loop, log=log)
    model.eval()
    heldout = heldout_loss(model, data.heldout[: settings.eval_blocks], device)
    log(
        f"[target] done: {result.steps} steps in {result.seconds:.0f}s, "
        f"train loss {result.final_loss:.4f}, held-out loss {heldout:.4f} nats/token"
    )
    return TrainedTarget(model=model, loop=result, heldout_loss=heldout, num_params=num_params)


@torch.no_grad()
def heldout_loss(model: Any, blocks: torch.Tensor, device: torch.device, batch: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over every prediction in ``blocks``."""
    total, count = 0.0, 0
    for part in chunks(blocks.shape[0], batch):
        ids = blocks[part].to(device)
        with autocast(device):
            logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            ids[:, 1:].reshape(-1),
            reduction="sum",
        )
        total += float(loss)
        count += ids[:, 1:].numel()
    return total / max(count, 1)


def save_target(model: Any, tokenizer: Any, path: Path, dtype: torch.dtype) -> None:
    """``save_pretrained`` in ``dtype`` (safetensors) with the tokenizer beside it."""
    path.mkdir(parents=True, exist_ok=True)
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.to(device="cpu", dtype=dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
