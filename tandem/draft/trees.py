"""The host path of drafting: every request's next tree, one module forward per depth.

Module ``m`` expands the nodes at depth ``min(d, M-1)``. A tree's pairs go after the committed
ones as scratch entries that each see only their ancestors (exact tree attention) and are
dropped once the trees are built. Step 0 takes the top-K of module 0's last committed output;
each later step reads the previous step's top-K back, picks the frontier (EAGLE-2: the K best
new candidates by cumulative score) and builds the scratch masks here.

With draft graphs, trees of a one-module draft run the same selection on the device
(``tree_graphs.py``) and chains theirs (``graphs.py``); this loop runs what no bucket takes and
every tree of a several-module draft.
"""

from __future__ import annotations

import time

import torch

import kernels
from tandem.draft.forward import Pair, run_pairs
from tandem.draft.state import DraftSeq, ModelDraftState
from tandem.spec.tree import CandidatePool, scratch_mask, softmax_topk
from tandem.spec.types import Tree


def draft_eagerly(state: ModelDraftState, request_ids: list[str]) -> dict[str, Tree]:
    """The next tree of every request in ``request_ids``; their KV is back at the committed
    pairs when it returns."""
    pools: dict[str, CandidatePool] = {}
    for request_id in request_ids:
        seq = state.seqs[request_id]
        pools[request_id] = CandidatePool(verified_token=seq.tokens[-1])
        seq.scratch = [{} for _ in state.modules]
    roots = [r for r in request_ids if state.seqs[r].last_out[0] is not None]
    for r in request_ids:
        if r not in roots:
            pools[r].stopped = True  # too little context for a first pair yet
    if roots:
        outs = torch.stack([state.seqs[r].last_out[0] for r in roots])  # type: ignore[misc]
        _expand(state, 0, roots, [[-1] for _ in roots], outs, pools)
    max_steps = max((state.seqs[r].spec.num_steps for r in request_ids), default=0)
    for step in range(1, max_steps):
        active = [
            r for r in request_ids if not pools[r].stopped and step < state.seqs[r].spec.num_steps
        ]
        if not active:
            break
        _draft_step(state, step, active, pools)
    trees = {}
    for request_id in request_ids:
        seq = state.seqs[request_id]
        for m, kv in enumerate(state.kvs):
            committed = max(0, len(seq.tokens) - state.modules[m].shift)
            kv.allocator.truncate(request_id, committed)
        seq.scratch = []
        pool = pools[request_id]
        n = min(seq.spec.tree_size, len(pool.tokens) + 1)
        trees[request_id] = pool.to_tree(n)
    return trees


def _draft_step(
    state: ModelDraftState, step: int, active: list[str], pools: dict[str, CandidatePool]
) -> None:
    """Expands each active request's frontier (nodes at depth ``step``)."""
    m = min(step, len(state.modules) - 1)
    module = state.modules[m]
    pairs: list[list[Pair]] = []
    masks: list[torch.Tensor] = []
    for request_id in active:
        seq, pool = state.seqs[request_id], pools[request_id]
        base = len(seq.tokens) - 1  # target position of node 0
        scratch = seq.scratch[m]
        chunk: list[Pair] = []
        for x in pool.frontier:
            for y in pool.path(x):
                if y in scratch or any(p.node == y for p in chunk):
                    continue
                position = base + pool.depths[y] - module.shift
                if position < 0:
                    pool.stopped = True
                    break
                hidden = _tree_hidden(state, m, seq, pool, y)
                chunk.append(Pair(request_id, pool.tokens[y], position, hidden, node=y))
        if chunk and not state.kvs[m].allocator.can_extend(request_id, len(chunk)):
            pool.stopped = True  # no room for scratch entries: propose what we have
        if pool.stopped:
            chunk = []
        pairs.append(chunk)
        masks.append(scratch_mask(scratch, [p.node for p in chunk], pool))
    outs = run_pairs(state, m, pairs, masks)
    alloc = state.kvs[m].allocator
    rows: list[str] = []
    parents: list[list[int]] = []
    frontier_outs: list[torch.Tensor] = []
    for request_id, chunk, out in zip(active, pairs, outs, strict=True):
        if not chunk:
            continue
        seq, pool = state.seqs[request_id], pools[request_id]
        end = alloc.num_tokens(request_id)
        for i, (pair, row) in enumerate(zip(chunk, out, strict=True)):
            assert pair.node is not None
            seq.scratch[m][pair.node] = (end - len(chunk) + i, row)
        rows.append(request_id)
        parents.append(list(pool.frontier))
        frontier_outs.extend(seq.scratch[m][x][1] for x in pool.frontier)
    if rows:
        _expand(state, m, rows, parents, torch.stack(frontier_outs), pools)


def _expand(
    state: ModelDraftState,
    m: int,
    request_ids: list[str],
    parents: list[list[int]],
    outs: torch.Tensor,  # [sum(len(parents)), H_d], one row per parent, in order
    pools: dict[str, CandidatePool],
) -> None:
    """Top-K children of every parent; the K best new candidates become the frontier."""
    module = state.modules[m]
    started = time.perf_counter_ns()
    logits = module.compute_logits(outs)
    k = max(state.seqs[r].spec.topk for r in request_ids)
    ops = kernels.ops(logits.device)  # Triton on CUDA, the torch references elsewhere
    if k == 1 and state.fast_top1:
        ids, logprobs, valid = ops.top1(logits)
        ids, logprobs = ids[:, None], logprobs[:, None]
    elif k == 1:
        ids, logprobs, valid = softmax_topk(logits, 1)
    else:
        ids, logprobs, valid = ops.topk(logits, min(k, logits.shape[-1]))
    ids = module.to_target_ids(ids)
    ids_host, logprobs_host, valid_host = ids.tolist(), logprobs.tolist(), valid.tolist()
    state.model_ns += time.perf_counter_ns() - started
    row = 0
    for request_id, request_parents in zip(request_ids, parents, strict=True):
        pool, topk = pools[request_id], state.seqs[request_id].spec.topk
        added: list[int] = []
        for parent in request_parents:
            if not valid_host[row]:
                pool.stopped = True  # NaN/inf logits: nothing from this row is proposed
            else:
                added += pool.add_children(parent, ids_host[row][:topk], logprobs_host[row][:topk])
            row += 1
        pool.select_frontier(added, topk)
        if not added:
            pool.stopped = True


def _tree_hidden(
    state: ModelDraftState, m: int, seq: DraftSeq, pool: CandidatePool, y: int
) -> torch.Tensor | None:
    """Hidden input of module ``m``'s pair that consumes tree node ``y``: the parent's output
    of the same module, or for an MTP head at depth ``d <= m`` head ``m-1``'s output at depth
    ``d-1`` (``chain``) or the target feature there (``target``); depth 0 stands for a
    module's last committed output."""
    if not state.modules[m].uses_hidden:
        return None
    depth = pool.depths[y]
    if m >= 1 and depth <= m:
        if state.mode == "target":
            return state.feature(seq, m, len(seq.tokens) - 2 + depth - m)
        ancestor = pool.path(y)[depth - 2] if depth >= 2 else None
        if ancestor is None:
            return seq.last_out[m - 1]
        return seq.scratch[m - 1][ancestor][1]
    parent = pool.parents[y]
    if parent < 0:
        return seq.last_out[m]
    return seq.scratch[m][parent][1]
