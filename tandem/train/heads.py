"""EAGLE-3, EAGLE-1 and MTP heads trained on a frozen target's hidden states and logits.

Each head starts as the random checkpoint :mod:`tandem.testing.random_drafts` writes for the target
(the format's tensor names, shapes and config come from there) and is loaded through
:mod:`tandem.models.draft_loader`, so the trained module is the runtime's own; saving writes the
trained values back under exactly the names of that file. Borrowed tensors (the target's
embedding and ``lm_head``) stay frozen and are not saved.

Per draft step the loss is :func:`tandem.train.labels.step_terms` (soft and greedy-token
cross-entropy against the target), weighted ``0.8 ** depth``. Metrics: ``ce0``, the soft
cross-entropy at the first step; ``acc{d}``, top-1 agreement with the target's greedy token at
depth ``d + 1``.

- ``eagle3``: the three aux states through ``fc``, unrolled ``ttt_steps`` (training-time test);
  draft vocabulary = the ``draft_vocab_size`` most frequent training tokens (``d2t``/``t2d``);
  labels restricted to it and renormalised; ``lm_head`` starts as the target's rows.
- ``eagle``: EAGLE-1 over the final hidden, unrolled ``ttt_steps``; loss = smooth-L1 to the
  target's next feature + 0.1 * the label loss (EAGLE-1's weights).
- ``mtp``: ``num_heads`` NextN heads, chained as ``--mtp-mode chain`` serves them: head 0 on the
  target's final hidden, head m on head m-1's output; the last head also feeds on itself for
  the remaining ``ttt_steps - num_heads`` depths. Decoder layers start as the target's last.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tandem.models import load_model
from tandem.models.draft import DraftModule
from tandem.models.draft_loader import load_eagle, load_eagle3, load_mtp
from tandem.models.eagle import resolve_aux_layer_ids
from tandem.testing.random_drafts import (
    make_eagle3_checkpoint,
    make_eagle_checkpoint,
    make_mtp_checkpoint,
)
from tandem.train.features import TargetOutputs
from tandem.train.labels import Labels, masked_mean, scored, step_terms
from tandem.train.ttt import unroll

DECAY = 0.8  # per-depth loss weight (SafeAILab, SpecForge)
Metrics = dict[str, torch.Tensor]


class HeadTrainer(ABC):
    """Draft modules being trained, the target layers they read, their loss and their save."""

    modules: list[DraftModule]
    layers: tuple[int, ...]  # target hidden_states indices the loss needs

    def __init__(
        self, path: Path, modules: list[DraftModule], layers: tuple[int, ...], hard_weight: float
    ) -> None:
        if not 0.0 <= hard_weight <= 1.0:
            raise ValueError(f"hard_weight: must be in [0, 1], got {hard_weight}")
        self.path = path  # the checkpoint directory (holds the random init until saved)
        self.modules = modules
        self.layers = layers
        self.hard_weight = hard_weight
        for module in modules:
            module.train()

    def params(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters() if p.requires_grad]

    @abstractmethod
    def losses(self, ids: torch.Tensor, target: TargetOutputs) -> tuple[torch.Tensor, Metrics]:
        """``ids`` [B, N] and the target's outputs on them -> (loss, metrics)."""

    def ours(self, name: str) -> tuple[int, str]:
        """A checkpoint tensor name -> (module index, our unfused name)."""
        return 0, name

    def save(self, dtype: torch.dtype) -> None:
        """The trained values under the names and shapes of the init file, in ``dtype``."""
        file = self.path / "model.safetensors"
        states = [unfused_state(m) for m in self.modules]
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                index, ours = self.ours(name)
                tensor = states[index][ours].detach().cpu()
                if tuple(tensor.shape) != tuple(f.get_slice(name).get_shape()):
                    raise AssertionError(f"{name}: trained shape {tuple(tensor.shape)} differs")
                out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        save_file({k: v.contiguous() for k, v in out.items()}, str(file), metadata={"format": "pt"})


class Eagle3Trainer(HeadTrainer):
    def __init__(
        self,
        path: Path,
        target_dir: Path,
        *,
        num_target_layers: int,
        token_counts: torch.Tensor,  # [V] training-token frequencies
        draft_vocab_size: int,
        ttt_steps: int,
        hard_weight: float,
        seed: int,
        save_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        outputs = aux_layer_outputs(num_target_layers)
        make_eagle3_checkpoint(
            path,
            target_dir,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=outputs,
            convention="specforge",
            seed=seed,
            dtype=save_dtype,
        )
        module = load_eagle3(path, target_dir, device=device)
        used = token_counts.topk(draft_vocab_size).indices.sort().values.to(device)  # [V_d]
        with torch.no_grad():
            module.d2t.copy_(used - torch.arange(draft_vocab_size, device=device))
            module.t2d.zero_()
            module.t2d[used] = True
            module.lm_head.weight.copy_(_target_lm_head(target_dir, device)[used])
        module.embed_tokens.weight.requires_grad_(False)
        self.head = module
        self.used = used
        self.ttt_steps = ttt_steps
        super().__init__(path, [module], tuple(module.aux_layer_ids), hard_weight)

    def losses(self, ids: torch.Tensor, target: TargetOutputs) -> tuple[torch.Tensor, Metrics]:
        module = self.head
        hidden0 = module.project_target(torch.cat(target.hidden, dim=-1))  # [B, N, H]
        labels = Labels.of(target.logits, self.used, module.t2d)
        total = hidden0.new_zeros((), dtype=torch.float32)
        metrics: Metrics = {}
        for k, out in enumerate(unroll(module, hidden0, ids, self.ttt_steps)):
            found = scored(out, labels, module.shift + k)
            if found is None:
                break
            valid, rows = found
            loss, soft, agree = step_terms(module.compute_logits(valid), rows, self.hard_weight)
            total = total + DECAY**k * masked_mean(loss, rows.keep)
            metrics[f"acc{k}"] = agree.float().mean()
            if k == 0:
                metrics["ce0"] = masked_mean(soft, rows.keep)
        return total, metrics


class EagleTrainer(HeadTrainer):
    def __init__(
        self,
        path: Path,
        target_dir: Path,
        *,
        num_target_layers: int,
        ttt_steps: int,
        hard_weight: float,
        seed: int,
        save_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        make_eagle_checkpoint(path, target_dir, bias=False, seed=seed, dtype=save_dtype)
        module = load_eagle(path, target_dir, device=device)
        last = _target_last_layer(target_dir)
        module.layers[0].load_state_dict(last, strict=False)  # no input_layernorm in EAGLE-1
        module.embed_tokens.weight.requires_grad_(False)
        module.lm_head.weight.requires_grad_(False)
        self.ttt_steps = ttt_steps
        super().__init__(path, [module], (num_target_layers,), hard_weight)

    def losses(self, ids: torch.Tensor, target: TargetOutputs) -> tuple[torch.Tensor, Metrics]:
        module = self.modules[0]
        (final,) = target.hidden  # [B, N, H] post-norm
        labels = Labels.of(target.logits)
        total = final.new_zeros((), dtype=torch.float32)
        metrics: Metrics = {}
        for k, out in enumerate(unroll(module, final, ids, self.ttt_steps)):
            found = scored(out, labels, module.shift + k)
            if found is None:
                break
            valid, rows = found
            loss, soft, agree = step_terms(module.compute_logits(valid), rows, self.hard_weight)
            offset = module.shift + k
            feature = final[:, offset : offset + valid.shape[1]].float()  # f_{i+1+k}
            regression = F.smooth_l1_loss(valid.float(), feature)
            total = total + DECAY**k * (regression + 0.1 * loss.mean())
            metrics[f"acc{k}"] = agree.float().mean()
            if k == 0:
                metrics["ce0"] = soft.mean()
        return total, metrics


class MTPTrainer(HeadTrainer):
    def __init__(
        self,
        path: Path,
        target_dir: Path,
        *,
        num_target_layers: int,
        num_heads: int,
        ttt_steps: int,
        hard_weight: float,
        seed: int,
        save_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        make_mtp_checkpoint(path, target_dir, num_heads=num_heads, seed=seed, dtype=save_dtype)
        heads = load_mtp(path, target_dir, device=device)
        last = _target_last_layer(target_dir)
        for head in heads:
            head.decoder.load_state_dict(last)
            head.embed_tokens.weight.requires_grad_(False)
            head.shared_head.head.weight.requires_grad_(False)
        self.base = num_target_layers
        self.ttt_steps = ttt_steps
        super().__init__(path, list(heads), (num_target_layers,), hard_weight)

    def losses(self, ids: torch.Tensor, target: TargetOutputs) -> tuple[torch.Tensor, Metrics]:
        (final,) = target.hidden  # [B, N, H] post-norm
        labels = Labels.of(target.logits)
        last = len(self.modules) - 1
        total = final.new_zeros((), dtype=torch.float32)
        metrics: Metrics = {}
        hidden0 = final
        for m, head in enumerate(self.modules):
            outs = unroll(head, hidden0, ids, 1 if m < last else max(1, self.ttt_steps - last))
            for k, out in enumerate(outs):
                found = scored(out, labels, head.shift + k)
                if found is None:
                    break
                valid, rows = found
                loss, soft, agree = step_terms(head.compute_logits(valid), rows, self.hard_weight)
                total = total + DECAY ** (m + k) * loss.mean()
                metrics[f"acc{m + k}"] = agree.float().mean()
                if m + k == 0:
                    metrics["ce0"] = soft.mean()
            hidden0 = outs[0].detach()  # chain: the next head reads this head's output
        return total, metrics

    def ours(self, name: str) -> tuple[int, str]:
        """``model.layers.{L + k}.X`` -> head k's ``X`` or, for its decoder layer,
        ``decoder.X``."""
        parts = name.split(".", 3)
        index = int(parts[2]) - self.base
        sub = parts[3]
        state = self.modules[index].state_dict()
        return index, sub if sub in state else f"decoder.{sub}"


def aux_layer_outputs(num_target_layers: int) -> list[int]:
    """EAGLE-3 aux layers in SpecForge's output convention: its default ``[1, L//2 - 1, L - 4]``
    when that is increasing, else the first, middle and last layers (small test targets)."""
    n = num_target_layers
    ids = [1, n // 2 - 1, n - 4]
    if not 0 <= ids[0] < ids[1] < ids[2] < n:
        ids = [0, (n - 1) // 2, n - 1]
    resolve_aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}, n)
    return ids


def unfused_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with fused ``qkv_proj`` / ``gate_up_proj`` split back into the
    checkpoint's ``q/k/v_proj`` / ``gate/up_proj``."""
    out: dict[str, torch.Tensor] = {}
    parts: tuple[str, ...]
    for name, tensor in module.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        parent, _, kind = owner.rpartition(".")
        sub = module.get_submodule(parent) if kind in ("qkv_proj", "gate_up_proj") else None
        if kind == "qkv_proj" and sub is not None:
            sizes = [sub.q_size, sub.kv_size, sub.kv_size]
            parts = ("q_proj", "k_proj", "v_proj")
        elif kind == "gate_up_proj" and sub is not None:
            sizes = [sub.intermediate_size] * 2
            parts = ("gate_proj", "up_proj")
        else:
            out[name] = tensor
            continue
        for part, piece in zip(parts, tensor.split(sizes), strict=True):
            out[f"{parent}.{part}.{leaf}"] = piece
    return out


def _target_lm_head(target_dir: Path, device: torch.device) -> torch.Tensor:  # [V, H_t]
    model = load_model(target_dir)
    return model.lm_head.weight.detach().to(device)


def _target_last_layer(target_dir: Path) -> dict[str, torch.Tensor]:
    """The state of the target's last decoder layer (our fused names), on the CPU."""
    model = load_model(target_dir)
    return {k: v.clone() for k, v in model.layers[-1].state_dict().items()}
