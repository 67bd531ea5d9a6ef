"""What drafts learn from: the target's next-token distribution, and the label loss.

:class:`Labels` holds, for every position of a batch, the target's softmax (over the draft's
vocabulary) and its greedy token, computed once per batch; each draft step reads a shifted
slice. :func:`step_terms` is the per-position loss: ``(1 - hard_weight)`` * cross-entropy
against the target's softmax (what sampling acceptance rewards) + ``hard_weight`` *
cross-entropy against its greedy token (what greedy acceptance rewards; it also keeps the
draft's confidence in line with how often its top token is the target's argmax, which EAGLE-2
tree selection ranks candidates by).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Labels:
    probs: torch.Tensor  # [B, N, V'] target softmax over the draft vocabulary V'
    top: torch.Tensor  # [B, N] int64 the target's greedy token, as an index into V'
    keep: torch.Tensor  # [B, N] bool: the greedy token is in V' (all True unless V' is pruned)

    @classmethod
    def of(
        cls,
        logits: torch.Tensor,  # [B, N, V] the target's; position p predicts token p + 1
        used: torch.Tensor | None = None,  # [V'] target ids of the draft vocabulary, sorted
        in_vocab: torch.Tensor | None = None,  # [V] bool, target id is in ``used``
    ) -> Labels:
        """Softmax restricted to ``used`` and renormalised (SpecForge) when given."""
        top = logits.argmax(-1)  # [B, N]
        if used is None or in_vocab is None:
            return cls(
                torch.softmax(logits.float(), -1), top, torch.ones_like(top, dtype=torch.bool)
            )
        restricted = logits[..., used]  # [B, N, V']
        return cls(torch.softmax(restricted.float(), -1), restricted.argmax(-1), in_vocab[top])

    def at(self, offset: int, length: int) -> Labels:
        """Rows ``offset .. offset + length - 1``: what pairs ``0 .. length - 1`` predict when
        pair ``i``'s output predicts the token after ``t[i + offset]``."""
        rows = slice(offset, offset + length)
        return Labels(self.probs[:, rows], self.top[:, rows], self.keep[:, rows])


def scored(out: torch.Tensor, labels: Labels, offset: int) -> tuple[torch.Tensor, Labels] | None:
    """The outputs ``out`` [B, N, H] of the pairs whose predicted token lies inside the
    sequence (``i + offset + 1 <= N - 1``), with their labels; None when there are none."""
    length = labels.top.shape[1] - 1 - offset
    if length < 1:
        return None
    return out[:, :length], labels.at(offset, length)


def step_terms(
    logits: torch.Tensor,  # [B, M, V'] the draft's
    labels: Labels,  # of the same M positions
    hard_weight: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # 3 x [B, M]
    """(label loss, soft cross-entropy, top-1 agreement with the target's greedy token)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    soft = -(labels.probs * logq).sum(-1)
    hard = -logq.gather(-1, labels.top.unsqueeze(-1)).squeeze(-1)
    agree = (logits.argmax(-1) == labels.top) & labels.keep
    return (1.0 - hard_weight) * soft + hard_weight * hard, soft, agree


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)
