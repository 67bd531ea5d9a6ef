"""The interface every draft network implements, and the standalone-LM draft.

A draft module consumes (hidden, token) *pairs*: the pair that consumes token ``t_j`` runs at
RoPE position ``j - shift`` and, for the EAGLE family, pairs the hidden state of that position
with the token after it (EAGLE's ``(f_i, t_{i+1})``), so ``shift`` is 1; MTP head ``k`` pairs
position ``i`` with ``t_{i+1+k}`` (shift ``1 + k``); a standalone LM consumes tokens at their own
positions (shift 0, no hidden). Its output is the recurrent hidden state that the next pair can
consume, and ``compute_logits`` turns it into draft-vocabulary logits that predict the token
after the consumed one (``to_target_ids`` maps them back through ``d2t``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from tandem.models.decoder import DecoderLM, ForwardContext


class DraftModule(nn.Module, ABC):
    """One draft network with its own KV (``ctx.kv`` has ``num_layers`` layers)."""

    shift: int  # consumed token index minus RoPE position (see the module docstring)
    hidden_size: int  # width of hidden_in and of the outputs (H_d); 0 when no hidden is used
    vocab_size: int  # draft vocabulary V_d: the width of compute_logits
    num_layers: int  # attention layers, i.e. KV layers this module needs
    num_kv_heads: int
    head_dim: int
    uses_hidden: bool  # False for a standalone LM: hidden_in is always None

    def project_target(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, F] -> hidden_in [T, H_d] (EAGLE-3's fc; identity by default)."""
        return features

    @abstractmethod
    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64, target-vocabulary ids of the consumed tokens
        hidden_in: torch.Tensor | None,  # [T, H_d], None when uses_hidden is False
        positions: torch.Tensor,  # [T] int64 RoPE positions
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, H_d] recurrent output (for a standalone LM: the final hidden)
        ...

    @abstractmethod
    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H_d] -> [T, V_d] float32."""

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``j + d2t[j]``); identity when V_d == V."""
        return draft_ids


class StandaloneDraft(DraftModule):
    """A small LM sharing the target's tokenizer, used as a draft (kind ``model``)."""

    def __init__(self, model: DecoderLM) -> None:
        super().__init__()
        self.model = model
        c = model.config
        self.shift = 0
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.num_layers = c.num_layers
        self.num_kv_heads = c.num_kv_heads
        self.head_dim = c.head_dim
        self.uses_hidden = False

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden_in: torch.Tensor | None,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        return self.model(token_ids, positions, ctx).hidden

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(out)
