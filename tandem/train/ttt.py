"""Training-time test (EAGLE-3, SpecForge): a draft module unrolled over several draft steps.

The modules are the runtime's own (:class:`Eagle3Module`, :class:`EagleModule`,
:class:`MTPHead`), called through their ``forward`` unchanged: a :class:`ForwardContext` whose
backend, :class:`TTTAttention`, attends over dense ``[B, T]`` batches instead of paged KV. So
what is trained is exactly what the drafter runs.

Step ``k`` (0-based) of a module with ``shift`` s, at pair index ``i`` (``T`` per sequence):

- hidden: step 0 the given ``hidden0[i]`` (target features projected, or the previous MTP head's
  output), later the module's own step ``k-1`` output at ``i``;
- token: ``t[i + s + k]`` at RoPE position ``i + k``; it predicts ``t[i + s + k + 1]``, whose
  target distribution is the target's logits at position ``i + s + k``;
- attention: step-0 keys at indices ``<= i`` (the committed pairs) and the keys of steps
  ``1..k`` at index ``i`` only (its own tree ancestors), as at serving time
  (``docs/architecture.md``, drafters; draft-formats.md section 5).

Pairs whose token lies past the sequence run on padding; their outputs are not scored
(:func:`tandem.train.labels.scored`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention import AttentionMetadata, TorchAttention
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import ForwardContext
from tandem.models.draft import DraftModule


class TTTAttention(TorchAttention):
    """Dense attention over ``[batch, length]`` pairs for one single-layer module, keeping each
    step's keys and values for the later steps. The paged cache arguments are ignored."""

    def __init__(self, batch: int, length: int) -> None:
        super().__init__()
        self.batch, self.length = batch, length
        self.keys: list[torch.Tensor] = []  # per step [B, T, kv_heads, d]
        self.values: list[torch.Tensor] = []

    def forward(
        self,
        q: torch.Tensor,  # [B * T, num_heads, head_dim]
        k: torch.Tensor,  # [B * T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [B * T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [B * T, num_heads, head_dim]
        b, t = self.batch, self.length
        self.keys.append(k.view(b, t, *k.shape[1:]))
        self.values.append(v.view(b, t, *v.shape[1:]))
        out = ttt_attention(q.view(b, t, *q.shape[1:]), self.keys, self.values, scale)
        return out.reshape(q.shape)


def ttt_attention(
    q: torch.Tensor,  # [B, T, h, d] this step's queries
    keys: list[torch.Tensor],  # steps 0..k, each [B, T, h_kv, d]
    values: list[torch.Tensor],  # steps 0..k, each [B, T, h_kv, d]
    scale: float,
) -> torch.Tensor:  # [B, T, h, d]
    group = q.shape[2] // keys[0].shape[2]
    qh = q.transpose(1, 2)  # [B, h, T, d]

    def heads(x: torch.Tensor) -> torch.Tensor:  # [B, T, h_kv, d] -> [B, h, T, d]
        return x.repeat_interleave(group, dim=2).transpose(1, 2)

    k0, v0 = heads(keys[0]), heads(values[0])
    if len(keys) == 1:
        return F.scaled_dot_product_attention(qh, k0, v0, is_causal=True, scale=scale).transpose(
            1, 2
        )
    n = q.shape[1]
    scores = torch.matmul(qh, k0.transpose(-1, -2)) * scale  # [B, h, T, T]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(qh * heads(kj)).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # [B, h, T, 1]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(v0.dtype)
    out = torch.matmul(probs[..., :n], v0)  # [B, h, T, d]
    for j, vj in enumerate(values[1:]):
        out = out + probs[..., n + j : n + j + 1] * heads(vj)
    return out.transpose(1, 2)


def training_context(module: DraftModule, backend: TTTAttention) -> ForwardContext:
    """A context the runtime module accepts; its one-page KV is never read (see the backend)."""
    param = next(module.parameters())
    spec = KVCacheSpec(
        num_layers=module.num_layers,
        num_kv_heads=module.num_kv_heads,
        head_dim=module.head_dim,
        page_size=1,
        dtype=param.dtype,
        device=param.device,
    )
    empty = torch.zeros(0, dtype=torch.int64, device=param.device)
    meta = AttentionMetadata.build(
        page_size=1,
        query_lens=[],
        seq_lens=[],
        page_table=torch.zeros(0, 0, dtype=torch.int32, device=param.device),
        slot_mapping=empty,
    )
    return ForwardContext(kv=KVCache(spec, 1), meta=meta, backend=backend)


def unroll(
    module: DraftModule,
    hidden0: torch.Tensor,  # [B, T, H] step-0 hidden inputs
    tokens: torch.Tensor,  # [B, N] the sequence; T <= N
    steps: int,
) -> list[torch.Tensor]:  # per step [B, T, H] recurrent outputs
    """Runs ``steps`` draft steps of ``module`` over every pair index at once."""
    if module.num_layers != 1:
        raise ValueError(f"module: TTT unrolls single-layer heads, got {module.num_layers} layers")
    b, t, width = hidden0.shape
    pad = module.shift + steps + t - tokens.shape[1]
    padded = F.pad(tokens, (0, max(0, pad)))  # [B, >= T + shift + steps]
    backend = TTTAttention(b, t)
    ctx = training_context(module, backend)
    base = torch.arange(t, device=tokens.device).expand(b, t)
    g = hidden0
    outs = []
    for k in range(steps):
        tok = padded[:, module.shift + k : module.shift + k + t]
        out = module(tok.reshape(-1), g.reshape(-1, width), (base + k).reshape(-1), ctx)
        g = out.view(b, t, -1)
        outs.append(g)
    return outs
