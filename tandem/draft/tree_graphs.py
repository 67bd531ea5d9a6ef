"""The draft's tree loop in CUDA graphs (K > 1, one-module drafts): EAGLE-2 selection on the
device.

The host path (``trees.py``) reads every step's top-K back to pick the next frontier and builds
the scratch masks from the pool's parents. Here a whole tree of S steps is one captured region
per bucket ``(batch_size, K)`` and tree shape ``(K, S, N)``:

- step 0 takes the top-K of the module's last committed output: K candidates (pool indices
  ``0..K-1``, parent node 0, score = log-probability);
- step ``s = 1..S-1`` runs the K frontier nodes (depth ``s``) as scratch entries at columns
  ``(s-1)K .. sK-1`` after the committed prefix, each fed its parent's output (the last
  committed one at depth 1) at position ``L - 1 + s - shift``; a row's mask is its parent's
  row (gathered by frontier index) with its own column's bit set. Their top-K children are
  the K*K candidates ``K + (s-1)K^2 + fK + j`` (frontier index ``f``, rank ``j``), scored by
  cumulative log-probability in float64 as the host path adds them; the next frontier is the
  K best of them;
- the tree is node 0 plus the N-1 best candidates.

"Best" is the host path's rule (a stable sort by score: ties to the lower pool index), with
candidates that do not exist on the host ranked last: the children of a row with NaN/inf
logits, and everything drafted after the first step that had one (the host stops drafting a
request there). The host reads the N-1 chosen pool indices with their tokens and parents'
pool indices, and each request's count of candidates, once after the replay; the trees equal
the host path's.

Scratch KV slots for all ``(S-1)K`` entries are reserved before the replay and truncated after
it, as the chain loop does; padding requests run with ``seq_len = prefix_len = 0``.
"""

from __future__ import annotations

import torch

import kernels
from tandem.draft.buffers import PAD_BASE, Staged, TreeEntry
from tandem.draft.plan import LoopPlan
from tandem.draft.state import ModelDraftState
from tandem.models import ForwardContext
from tandem.spec.types import Tree


def tree_values(plan: LoopPlan, entry: TreeEntry, state: ModelDraftState) -> Staged:
    """A tree loop's staged inputs: bases, scratch slots and lengths per step (the masks are
    written on the device), page tables."""
    bs, n = entry.bucket.batch_size, len(plan.request_ids)
    k, words, missing = entry.shape.topk, entry.shape.num_words, bs - n
    alloc = state.kvs[0].allocator
    staged = Staged(ints={"base": [*plan.bases, *[PAD_BASE] * missing]})
    committed = plan.committed[0]
    for t in range(entry.shape.num_steps - 1):
        slots: list[int] = []
        for request_id, c in zip(plan.request_ids, committed, strict=True):
            slots += alloc.slot_mapping(request_id, c + t * k, c + (t + 1) * k)
        staged.ints |= {
            f"slots{t}": [*slots, *[-1] * (missing * k)],
            f"seq{t}": [*(c + (t + 1) * k for c in committed), *[0] * missing],
            f"prefix{t}": [*committed, *[0] * missing],
            f"qsl{t}": list(range(0, bs * k + 1, k)),
            f"mask{t}": [0] * (bs * k * words),
        }
    staged.pages["pages0"] = [alloc.pages(r) for r in plan.request_ids]
    return staged


def _rank(scores: torch.Tensor, exists: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C]
    """Column order, best first: existing candidates by score (ties to the lower column),
    then the others."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    present = exists.gather(1, order).to(torch.int32)
    return order.gather(1, torch.sort(present, dim=1, descending=True, stable=True).indices)


def tree_forward(state: ModelDraftState, entry: TreeEntry, last_in: torch.Tensor) -> None:
    """The captured region of a tree loop: reads the staged inputs and ``last_in`` ([>= bs,
    H_d], module 0's last committed outputs), writes scratch KV and ``entry.result``."""
    module, kv = state.modules[0], state.kvs[0]
    bs, k = entry.bucket.batch_size, entry.shape.topk
    device = last_in.device
    ops = kernels.ops(device)

    def expand(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, logprobs, valid = ops.topk(module.compute_logits(out), k)
        return module.to_target_ids(ids), logprobs.double(), valid

    tokens, scores, valid = expand(last_in[:bs])  # [bs, K], [bs, K], [bs]
    exists = valid[:, None].expand(bs, k)
    alive = valid
    pool_tokens, pool_scores = [tokens], [scores]
    pool_exists, pool_parents = [exists], [torch.full_like(tokens, -1)]
    order = _rank(scores, exists)  # the frontier: all K, best first
    front_tokens, front_scores, front_pool = tokens.gather(1, order), scores.gather(1, order), order
    hidden = last_in[:bs].repeat_interleave(k, 0) if module.uses_hidden else None
    rows = torch.arange(bs, device=device)[:, None] * k  # [bs, 1]
    mask: torch.Tensor | None = None  # [bs, K, words], the last step's rows
    for t, (backend, offsets) in enumerate(zip(entry.backends, entry.offsets, strict=True)):
        bits = entry.bits[t][None].expand(bs, -1, -1)
        if mask is None:
            mask = bits
        else:
            parents = (order // k)[:, :, None].expand(-1, -1, bits.shape[-1])
            mask = mask.gather(1, parents) | bits
        entry.masks[t].copy_(mask.reshape(bs * k, -1))
        positions = (entry.base[:, None] + offsets[None, :]).reshape(-1)
        ctx = ForwardContext(kv=kv, meta=entry.placeholder, backend=backend)
        out = module(front_tokens.reshape(-1), hidden, positions, ctx)  # [bs * K, H_d]
        ids, logprobs, valid = expand(out)  # [bs * K, K], [bs * K, K], [bs * K]
        valid = valid.view(bs, k)
        tokens = ids.view(bs, k * k)
        scores = (front_scores[:, :, None] + logprobs.view(bs, k, k)).view(bs, k * k)
        exists = (alive[:, None] & valid)[:, :, None].expand(bs, k, k).reshape(bs, k * k)
        parents_pool = front_pool[:, :, None].expand(bs, k, k).reshape(bs, k * k)
        alive = alive & valid.all(1)
        pool_tokens.append(tokens)
        pool_scores.append(scores)
        pool_exists.append(exists)
        pool_parents.append(parents_pool)
        order = _rank(scores, exists)[:, :k]  # [bs, K] columns of this step's children
        front_tokens, front_scores = tokens.gather(1, order), scores.gather(1, order)
        front_pool = order + (k + t * k * k)
        if hidden is not None:
            hidden = out.index_select(0, (rows + order // k).reshape(-1))
    all_exists = torch.cat(pool_exists, 1)
    chosen = _rank(torch.cat(pool_scores, 1), all_exists)[:, : entry.shape.tree_size - 1]
    entry.result.copy_(
        torch.cat(
            [
                chosen,
                torch.cat(pool_tokens, 1).gather(1, chosen),
                torch.cat(pool_parents, 1).gather(1, chosen),
                all_exists.sum(1, keepdim=True),
            ],
            1,
        )
    )


def read_trees(entry: TreeEntry, verified: list[int], result: list[list[int]]) -> list[Tree]:
    """Each request's tree from its row of ``entry.result`` (read back): node 0 plus the best
    ``min(N, count + 1) - 1`` candidates, numbered in pool order (parents before children),
    as ``CandidatePool.to_tree`` numbers them."""
    m = entry.shape.tree_size - 1
    trees = []
    for token, row in zip(verified, result, strict=False):
        n = min(m, row[3 * m])
        picked = sorted(zip(row[:n], row[m : m + n], row[2 * m : 2 * m + n], strict=True))
        node_of = {pool: node for node, (pool, _, _) in enumerate(picked, 1)}
        tokens, parents = [token], [-1]
        for _, tok, parent in picked:
            tokens.append(tok)
            parents.append(node_of[parent] if parent >= 0 else 0)
        trees.append(Tree(tokens=tuple(tokens), parents=tuple(parents)))
    return trees
