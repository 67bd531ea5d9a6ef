"""Target side of the cycle: choose tokens at every tree node, walk the accepted path, and move
the accepted nodes' KV to contiguous positions.

Every token the target commits goes through here, including the first token after a prompt
and plain decoding: those are trees of one node. Greedy rows accept a child whose token equals
the target's argmax at its parent. Sampled rows use lossless tree speculative sampling
(``verify_sampling_ref``): one coin per node over the ordered children, then the bonus from the
residual distribution, so each committed token is distributed exactly as target-only sampling.
Coins and the residual race come from the request's own generator, a fixed block per step
(``coin_block`` coins and one Exp(1) vector), so the target's randomness never depends on the
draft.

The tree ops run as Triton kernels on CUDA and as their torch references elsewhere
(``kernels.ops``); the CPU path calls the references through this module's names, which tests
wrap.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

import kernels
from kernels.reference import (
    accepted_slots_ref,
    build_tree_ref,
    compact_accepted_ref,
    verify_greedy_ref,
    verify_sampling_ref,
)
from tandem.kv import KVCache
from tandem.request import Request
from tandem.sampling import SamplingBatch, process_logits
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import Tree


@dataclass
class Verified:
    """The committed outcome of one tree."""

    accept_nodes: list[int]  # accepted path: node 0 then the accepted drafts' nodes
    new_tokens: list[int]  # accepted draft tokens + the bonus token
    logprobs: list[float]  # target log-probability of each new token


def _ops(device: torch.device) -> kernels.Ops:
    """The kernels on CUDA; elsewhere the references as this module names them (looked up at
    call time, so a test that replaces one here sees its replacement called)."""
    if kernels.uses_triton(device):
        return kernels.triton_ops()
    return replace(
        kernels.REFERENCE,
        build_tree=build_tree_ref,
        verify_greedy=verify_greedy_ref,
        verify_sampling=verify_sampling_ref,
        accepted_slots=accepted_slots_ref,
        compact_accepted=compact_accepted_ref,
    )


def verify(
    logits: torch.Tensor,  # [sum(N_i), V] target logits at every node, trees concatenated
    trees: Sequence[Tree],
    reqs: Sequence[Request],
    *,
    coin_block: int,
    simulate: AcceptSimulator | None = None,
) -> list[Verified]:
    """Verifies one tree per request (node 0's logits predict the token after node 0).

    With ``simulate`` (benchmarks only, ``tandem.spec.simulate``) the verification still runs
    but the accepted paths are drawn, and each bonus is the target's argmax after its path.
    """
    device = logits.device
    sizes = [len(t) for t in trees]
    bs, width = len(trees), max(sizes)
    if coin_block < width:
        raise ValueError(f"coin_block: {coin_block} < tree size {width}")
    params = [req.params for req, n in zip(reqs, sizes, strict=True) for _ in range(n)]
    # process_logits never draws: the generators only satisfy build's check for sampled rows.
    unused = torch.Generator(device=device)
    batch = SamplingBatch.build(params, [None if p.greedy else unused for p in params], device)
    history = _node_history(trees, reqs, device) if batch.any_penalty else None
    processed = process_logits(logits, batch, history)  # [sum(N), V]
    logprobs = processed.log_softmax(dim=-1)  # [sum(N), V]

    tokens = torch.zeros(bs, width, dtype=torch.int64)
    parents = torch.full((bs, width), -1, dtype=torch.int64)
    for b, tree in enumerate(trees):
        tokens[b, : len(tree)] = torch.tensor(tree.tokens)
        parents[b, : len(tree)] = torch.tensor(tree.parents)
    tokens, parents = tokens.to(device), parents.to(device)
    num_nodes = torch.tensor(sizes, dtype=torch.int64, device=device)
    ops = _ops(device)
    depth, _, first_child, next_sibling = ops.build_tree(parents, num_nodes)
    accept_width = int(depth.max().item()) + 1

    rows = torch.zeros(bs, width, dtype=torch.int64, device=device)  # flat logits row per node
    offsets = torch.tensor([0, *sizes], device=device).cumsum(0)[:-1]
    rows += offsets[:, None] + torch.arange(width, device=device)
    rows = torch.minimum(rows, torch.tensor(logits.shape[0] - 1, device=device))

    greedy = [b for b, req in enumerate(reqs) if req.params.greedy]
    sampled = [b for b, req in enumerate(reqs) if not req.params.greedy]
    accept_index = torch.full((bs, accept_width), -1, dtype=torch.int64, device=device)
    accept_len = torch.ones(bs, dtype=torch.int64, device=device)
    bonus = torch.zeros(bs, dtype=torch.int64, device=device)
    if greedy:
        idx = torch.tensor(greedy, device=device)
        target_ids = processed.argmax(dim=-1)[rows[idx]]  # [bs_greedy, W]
        accept_index[idx], accept_len[idx], bonus[idx] = ops.verify_greedy(
            tokens[idx], target_ids, first_child[idx], next_sibling[idx], num_nodes[idx],
            accept_width,
        )  # fmt: skip
    if sampled:
        idx = torch.tensor(sampled, device=device)
        accept_index[idx], accept_len[idx], bonus[idx] = _sampling(
            processed.softmax(dim=-1)[rows[idx]],
            tokens[idx],
            first_child[idx],
            next_sibling[idx],
            num_nodes[idx],
            accept_width,
            [reqs[b] for b in sampled],
            coin_block,
        )

    out = []
    host_index, host_len, host_bonus = accept_index.tolist(), accept_len.tolist(), bonus.tolist()
    if simulate is not None:  # perf only: the verdict above is overridden (its cost is kept)
        host_index = simulate.paths(trees)
        host_len = [len(nodes) for nodes in host_index]
        starts = [0, *itertools.accumulate(sizes)]
        last = torch.tensor([starts[b] + nodes[-1] for b, nodes in enumerate(host_index)])
        host_bonus = processed[last.to(device)].argmax(dim=-1).tolist()
    for b, tree in enumerate(trees):
        nodes = host_index[b][: host_len[b]]
        new = [tree.tokens[n] for n in nodes[1:]] + [host_bonus[b]]
        lp_rows = [int(rows[b, n]) for n in nodes]
        lps = logprobs[lp_rows, torch.tensor(new, device=device)].tolist()
        out.append(Verified(accept_nodes=nodes, new_tokens=new, logprobs=lps))
    return out


def _sampling(
    probs: torch.Tensor,  # [bs, W, V] the target's distribution at every node
    tokens: torch.Tensor,  # [bs, W]
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    num_nodes: torch.Tensor,
    accept_width: int,
    reqs: list[Request],
    coin_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs, width, vocab = probs.shape
    coins = torch.empty(bs, coin_block, device=probs.device)
    noise = torch.empty(bs, vocab, device=probs.device)
    for b, req in enumerate(reqs):
        assert req.generator is not None, "a sampled request without its random stream"
        coins[b].uniform_(generator=req.generator)
        noise[b].exponential_(generator=req.generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return _ops(probs.device).verify_sampling(
        tokens,
        probs,
        coins[:, :width],
        noise,
        first_child,
        next_sibling,
        num_nodes,
        accept_width,
    )


def _node_history(
    trees: Sequence[Tree], reqs: Sequence[Request], device: torch.device | str
) -> torch.Tensor:  # [sum(N), T] int64 padded with -1
    """Per node: the committed tokens plus the tree path down to it (repetition penalty)."""
    rows: list[list[int]] = []
    for tree, req in zip(trees, reqs, strict=True):
        committed = req.tokens
        paths: list[list[int]] = [[]]
        for i in range(1, len(tree)):
            paths.append([*paths[tree.parents[i]], tree.tokens[i]])
        rows.extend(committed + path for path in paths)
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out.to(device)


def compact(
    kv: KVCache,
    request_ids: Sequence[str],
    base_lens: Sequence[int],  # KV index of node 0 per request (L - 1)
    accepted: Sequence[Verified],
) -> None:
    """Moves each accepted node's K/V to KV index ``base + j`` in every layer (a no-op for a
    chain's accepted prefix), then frees what lies past the accepted path."""
    moving = [
        i for i, v in enumerate(accepted) if v.accept_nodes != list(range(len(v.accept_nodes)))
    ]
    if moving:
        ids = [request_ids[i] for i in moving]
        width = max(len(accepted[i].accept_nodes) for i in moving)
        index = torch.full((len(moving), width), -1, dtype=torch.int64)
        for r, i in enumerate(moving):
            nodes = accepted[i].accept_nodes
            index[r, : len(nodes)] = torch.tensor(nodes)
        lens = torch.tensor([len(accepted[i].accept_nodes) for i in moving])
        device = kv.k_caches[0].device
        ops = _ops(device)
        src, dst = ops.accepted_slots(
            kv.allocator.page_table(ids, device=device),
            torch.tensor([base_lens[i] for i in moving], device=device),
            index.to(device),
            lens.to(device),
            kv.spec.page_size,
        )
        ops.compact_accepted([*kv.k_caches, *kv.v_caches], src, dst)
    for request_id, base, v in zip(request_ids, base_lens, accepted, strict=True):
        kv.allocator.truncate(request_id, base + len(v.accept_nodes))
