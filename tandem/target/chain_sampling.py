"""Sampled rows of a device-chain step (``tandem/target/chain_verify.py``).

A run may mix greedy and sampled requests (temperature, top-k, top-p, min-p; no processor that
reads the tokens so far, no bias, no ``min_tokens`` left, no top log-probabilities:
``SamplingParams.plain``). A sampled row is verified as the ordinary step verifies it
(``tandem.spec.verify``): the drafts are deterministic proposals, node i's draft is accepted
when node i's coin falls below its probability under the target's processed distribution, and
the bonus is drawn from the residual (the distribution at the last accepted node with the
rejected draft removed, or whole after the last draft) by the exponential race. On a chain the
walk is a prefix: no loop over nodes, no host read.

The randomness is the request's own generator, drawn on the host's stream before each launch
(outside the captured graph) in the blocks the ordinary step draws: ``coin_block`` coins, then
one Exp(1) vector over the vocabulary. A seeded request's tokens are the same whichever path
verifies each step.

The processed logits (``tandem.sampling.process_logits``) need their filters known when a
bucket's graph is captured: a run's ``Filters`` pick the graph, and the per-node parameters
live in tensors that each run of those filters overwrites in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tandem.request import Request
from tandem.sampling import SamplingBatch, SamplingParams

_GREEDY = SamplingParams()
# The fields of a SamplingBatch a run of plain parameters reads (process_logits).
_FIELDS = ("temperature", "top_k", "top_p", "top_p_cutoff", "min_p")


@dataclass(frozen=True)
class Filters:
    """The processors a run's sampled rows apply: one captured graph per bucket and value."""

    max_top_k: int  # 0: no row filters by top-k
    top_p: bool
    min_p: bool


class ChainSampling:
    """Per bucket and ``Filters``, the node rows' parameters as tensors the graph reads."""

    def __init__(self, device: torch.device, coin_block: int) -> None:
        self.device = device
        self.coin_block = coin_block
        self._batches: dict[tuple[int, Filters], SamplingBatch] = {}
        self._unused = torch.Generator(device=device)  # process_logits never draws

    def stage(
        self, reqs: Sequence[Request], batch_size: int, width: int
    ) -> tuple[Filters, SamplingBatch] | None:
        """The run's filters and node-row parameters (one row per chain node, padding rows
        greedy), written into the tensors of their graph; None when every row is greedy."""
        if all(req.params.greedy for req in reqs):
            return None
        params = [req.params for req in reqs for _ in range(width)]
        params += [_GREEDY] * ((batch_size - len(reqs)) * width)
        generators = [None if p.greedy else self._unused for p in params]
        batch = SamplingBatch.build(params, generators, self.device)
        if batch.any_top_k:
            # torch.topk's k rounded up to a power of two: the k-th value of each row is the
            # same, and requests with other top-k share a graph.
            batch = replace(batch, max_top_k=1 << (batch.max_top_k - 1).bit_length())
        filters = Filters(
            max_top_k=batch.max_top_k if batch.any_top_k else 0,
            top_p=batch.any_top_p,
            min_p=batch.any_min_p,
        )
        kept = self._batches.setdefault((batch_size, filters), batch)
        if kept is not batch:
            for name in _FIELDS:
                getattr(kept, name).copy_(getattr(batch, name))
        return filters, kept


def sampled_verdict(
    processed: torch.Tensor,  # [bs * (S+1), V] float32: every node's processed logits
    drafts: torch.Tensor,  # [bs, S] int64
    valid: torch.Tensor,  # [bs, S] bool
    coins: torch.Tensor,  # [bs, >= S] float32 uniform in [0, 1)
    noise: torch.Tensor,  # [bs, V] float32 Exp(1)
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [bs] int64, bonus [bs] int64
    """Tree speculative sampling of a deterministic draft on chains, as
    ``kernels.reference.verify_sampling_ref`` walks a tree of one child per node."""
    bs, s = drafts.shape
    vocab = processed.shape[-1]
    probs = processed.softmax(dim=-1).view(bs, s + 1, vocab)
    at_parents = probs[:, :s]  # [bs, S, V]
    p_draft = at_parents.gather(2, drafts[..., None])[..., 0]  # [bs, S]
    # The residual's largest probability once the draft is removed: the rounding case where
    # the draft holds all the mass but its probability still ends below the coin accepts it.
    top = at_parents.topk(2, dim=-1)
    rest = torch.where(top.indices[..., 0] == drafts, top.values[..., 1], top.values[..., 0])
    hit = (coins[:, :s] < p_draft) | ((rest <= 0) & (p_draft > 0))
    accepted = torch.cumprod((hit & valid).long(), 1).sum(1)  # [bs]
    depth = torch.cumprod(valid.long(), 1).sum(1)  # [bs]
    rows = torch.arange(bs, device=probs.device)
    residual = probs[rows, accepted]  # [bs, V]
    rejected = drafts.gather(1, accepted.clamp(max=s - 1)[:, None])  # [bs, 1]
    ids = torch.arange(vocab, device=probs.device)[None, :]
    residual = residual.masked_fill((accepted < depth)[:, None] & (ids == rejected), 0.0)
    race = torch.where(residual > 0, residual / noise, -1.0)
    return accepted, race.argmax(dim=1)
