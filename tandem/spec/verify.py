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
import math
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
from tandem.request import Request, TopLogprobs
from tandem.sampling import SamplingBatch, process_logits
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import NoTree, SpecStats, Tree
from tandem.transfer import device_ints, device_segments, read_host


@dataclass
class Verified:
    """The committed outcome of one tree."""

    accept_nodes: list[int]  # accepted path: node 0 then the accepted drafts' nodes
    new_tokens: list[int]  # accepted draft tokens + the bonus token
    logprobs: list[float]  # target log-probability of each new token
    top_logprobs: list[TopLogprobs] | None = None  # per new token, where the request asks


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

    Everything runs on the device and the host reads the outcome once: the accepted paths, the
    bonus tokens and the log-probabilities of every new token. Greedy rows take the target's
    choice and its log-probability from one fused pass (``top1``: argmax and logsumexp, no
    softmax materialised); plain decoding (every tree one node) needs nothing else.

    With ``simulate`` (benchmarks only, ``tandem.spec.simulate``) the verification still runs
    but the accepted paths are drawn, and each bonus is the target's argmax after its path.
    """
    device = logits.device
    sizes = [len(t) for t in trees]
    bs, width = len(trees), max(sizes)
    if coin_block < width:
        raise ValueError(f"coin_block: {coin_block} < tree size {width}")
    ops = _ops(device)
    greedy_only = all(req.params.greedy for req in reqs)
    if all(req.params.plain_greedy for req in reqs):
        processed = logits.float()  # what process_logits returns for these rows
    else:
        processed = _process(logits, trees, reqs)  # [sum(N), V]
    top_ids, top_lp, _ = ops.top1(processed)  # [sum(N)] each: the target's choice per node

    starts = [0, *itertools.accumulate(sizes)][:-1]
    if width == 1 and greedy_only:  # plain decoding: the bonus is the choice at node 0
        accept_index = torch.zeros(bs, 1, dtype=torch.int64, device=device)
        accept_len = torch.ones(bs, dtype=torch.int64, device=device)
        tokens = top_ids[:, None]  # placeholder: with one node every path entry is the bonus
        bonus = top_ids
    else:
        # The trees passed Tree.check where they crossed the draft/target boundary: the
        # kernels need not read them back to validate them (a device sync each).
        with kernels.trusted_values():
            accept_index, accept_len, bonus, tokens = _accept(
                processed, top_ids, trees, reqs, starts, width, coin_block, ops
            )
    if simulate is not None:  # perf only: the verdict above is overridden (its cost is kept)
        paths = simulate.paths(trees, reqs)
        a = accept_index.shape[1]
        accept_index, accept_len, last_rows = device_segments(
            [
                [i for p in paths for i in [*p, *[-1] * (a - len(p))]],
                [len(p) for p in paths],
                [s + p[-1] for s, p in zip(starts, paths, strict=True)],
            ],
            device,
        )
        accept_index = accept_index.view(bs, a)
        bonus = top_ids[last_rows]

    # The new token after each path node, and its log-probability at that node.
    accept_width = accept_index.shape[1]
    node = accept_index.clamp(min=0)  # [bs, A]
    after = torch.cat([node[:, 1:], node[:, :1]], dim=1)  # [bs, A] the next path node
    is_last = torch.arange(accept_width, device=device)[None, :] == (accept_len - 1)[:, None]
    new_ids = torch.where(is_last, bonus[:, None], tokens.gather(1, after))  # [bs, A]
    rows = device_ints(starts, device)[:, None] + node  # [bs, A] flat logits rows
    lse = processed.gather(1, top_ids[:, None])[:, 0] - top_lp  # [sum(N)] logsumexp per row
    picked = processed[rows, new_ids] - lse[rows]  # [bs, A]
    lps = torch.where(new_ids == top_ids[rows], top_lp[rows], picked)

    # The one host read of the step.
    ints_dev = torch.cat([accept_index.flatten(), accept_len, bonus])
    ints_host, lps_host_t = read_host(ints_dev, lps)
    ints, lps_host = ints_host.tolist(), lps_host_t.tolist()
    index_host = [ints[b * accept_width : (b + 1) * accept_width] for b in range(bs)]
    len_host = ints[bs * accept_width : bs * accept_width + bs]
    bonus_host = ints[bs * accept_width + bs :]
    tops = _top_logprobs(processed, lse, rows, len_host, reqs)
    out = []
    for b, tree in enumerate(trees):
        n = len_host[b]
        nodes = index_host[b][:n]
        new = [tree.tokens[i] for i in nodes[1:]] + [bonus_host[b]]
        lp = lps_host[b][:n]
        out.append(Verified(accept_nodes=nodes, new_tokens=new, logprobs=lp, top_logprobs=tops[b]))
    return out


def _top_logprobs(
    processed: torch.Tensor,  # [sum(N), V] float32, what each node's token is drawn from
    lse: torch.Tensor,  # [sum(N)] its logsumexp
    rows: torch.Tensor,  # [bs, A] the flat row of each new token's node
    lens: list[int],  # new tokens per request
    reqs: Sequence[Request],
) -> list[list[TopLogprobs] | None]:
    """Per request that asks (``top_logprobs`` > 0), its most likely tokens at each new token's
    node under the distribution the token was drawn from (tokens it filters out left out)."""
    asking = [b for b, req in enumerate(reqs) if req.params.top_logprobs]
    found: list[list[TopLogprobs] | None] = [None] * len(reqs)
    if not asking:
        return found
    k = min(max(reqs[b].params.top_logprobs for b in asking), processed.shape[1])
    picked = rows[asking]  # [M, A]
    values, ids = torch.topk(processed[picked], k, dim=-1)  # [M, A, k] most likely first
    values = values - lse[picked][..., None]
    values_host, ids_host = values.tolist(), ids.tolist()  # a second read, only when asked
    for m, b in enumerate(asking):
        n, tops = reqs[b].params.top_logprobs, []
        for ids_j, values_j in zip(ids_host[m][: lens[b]], values_host[m][: lens[b]], strict=True):
            kept = [(t, v) for t, v in zip(ids_j[:n], values_j[:n], strict=True) if v > -math.inf]
            tops.append(TopLogprobs([t for t, _ in kept], [v for _, v in kept]))
        found[b] = tops
    return found


def verify_rows(
    logits: torch.Tensor,  # [sum(N_i) over the rows with a tree, V]
    trees: Sequence[Tree | None],  # per row of the batch; None: a prompt chunk, nothing to verify
    reqs: Sequence[Request],
    coin_block: int,
    simulate: AcceptSimulator | None = None,
) -> list[Verified | None]:
    """``verify`` over the rows of a batch that carry a tree; None for the others."""
    rows = [i for i, tree in enumerate(trees) if tree is not None]
    found: list[Verified | None] = [None] * len(trees)
    if rows:
        done = verify(
            logits,
            [trees[i] for i in rows],  # type: ignore[misc]
            [reqs[i] for i in rows],
            coin_block=coin_block,
            simulate=simulate,
        )
        for i, v in zip(rows, done, strict=True):
            found[i] = v
    return found


def commit(
    kv: KVCache,
    reqs: Sequence[Request],
    num_new_tokens: Sequence[int],
    decoding: Sequence[bool],  # per row: the request decoded (its prompt was complete)
    verified: Sequence[Verified | None],
    stats: SpecStats,  # the step's, all requests together (each request keeps its own too)
    plain: NoTree | None = None,  # why the step verified no trees at all, if it did not (K=0)
) -> None:
    """Moves accepted KV into place (``compact``) and advances every request's KV progress,
    counting each decode step without a draft token by its cause."""
    tree_rows = [i for i, req in enumerate(reqs) if req.tree is not None and verified[i]]
    compact(
        kv,
        [reqs[i].request_id for i in tree_rows],
        [reqs[i].num_computed for i in tree_rows],
        [verified[i] for i in tree_rows],  # type: ignore[misc]
    )
    for i, (req, n) in enumerate(zip(reqs, num_new_tokens, strict=True)):
        v = verified[i]
        if req.tree is not None and v is not None:
            req.num_computed += len(v.accept_nodes)
            for s in (req.stats, stats):
                s.record(len(req.tree) - 1, len(v.accept_nodes) - 1, NoTree.CAPACITY)
            req.tree = None
        else:
            req.num_computed += n
            if decoding[i]:
                missed = plain or why_no_tree(req)
                for s in (req.stats, stats):
                    s.record(0, 0, missed)  # a decode step without a draft
        req.miss = None


def why_no_tree(req: Request) -> NoTree:
    """Why a decode step of a speculating batch had no tree for ``req``."""
    if not req.speculate:
        return NoTree.OPTED_OUT
    if not req.in_draft:
        return NoTree.NOT_IN_DRAFT
    return req.miss or NoTree.STALE  # no answer for its state: a catch-up after K=0, say


def decode_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain greedy decoding without penalties, on the device: each row's choice and its
    log-probability ([rows] int64, [rows] float32), exactly what ``verify`` commits for a tree
    of one node (``tandem.target.ahead`` reads them a step later)."""
    ids, logprobs, _ = _ops(logits.device).top1(logits.float())
    return ids, logprobs


def _accept(
    processed: torch.Tensor,  # [sum(N), V] float32
    top_ids: torch.Tensor,  # [sum(N)] the greedy choice per node
    trees: Sequence[Tree],
    reqs: Sequence[Request],
    starts: list[int],
    width: int,
    coin_block: int,
    ops: kernels.Ops,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walks every tree on the device: ``accept_index`` [bs, A], ``accept_len`` [bs],
    ``bonus`` [bs] and the padded node tokens [bs, width]."""
    device = processed.device
    bs = len(trees)
    flat_tokens: list[int] = []
    flat_parents: list[int] = []
    for tree in trees:
        pad = width - len(tree)
        flat_tokens += [*tree.tokens, *[0] * pad]
        flat_parents += [*tree.parents, *[-1] * pad]
    # The accept width is known on the host: the deepest node, plus node 0.
    accept_width = max(max(tree.depths) for tree in trees) + 1
    tokens, parents, num_nodes, offsets = device_segments(
        [flat_tokens, flat_parents, [len(t) for t in trees], starts], device
    )
    tokens, parents = tokens.view(bs, width), parents.view(bs, width)
    _, _, first_child, next_sibling = ops.build_tree(parents, num_nodes)
    # Flat logits row per node; padding nodes repeat the tree's last row (never accepted).
    rows = offsets[:, None] + torch.minimum(
        torch.arange(width, device=device)[None, :], (num_nodes - 1)[:, None]
    )  # [bs, width]

    greedy = [b for b, req in enumerate(reqs) if req.params.greedy]
    sampled = [b for b, req in enumerate(reqs) if not req.params.greedy]
    if not sampled:
        accept_index, accept_len, bonus = ops.verify_greedy(
            tokens, top_ids[rows], first_child, next_sibling, num_nodes, accept_width
        )
        return accept_index, accept_len, bonus, tokens
    accept_index = torch.full((bs, accept_width), -1, dtype=torch.int64, device=device)
    accept_len = torch.ones(bs, dtype=torch.int64, device=device)
    bonus = torch.zeros(bs, dtype=torch.int64, device=device)
    if greedy:
        idx = device_ints(greedy, device)
        accept_index[idx], accept_len[idx], bonus[idx] = ops.verify_greedy(
            tokens[idx], top_ids[rows[idx]], first_child[idx], next_sibling[idx],
            num_nodes[idx], accept_width,
        )  # fmt: skip
    idx = device_ints(sampled, device)
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
    return accept_index, accept_len, bonus, tokens


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
    for req in reqs:
        assert req.generator is not None, "a sampled request without its random stream"
    draw_randomness([req.generator for req in reqs], coins, noise)
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


def draw_randomness(
    generators: Sequence[torch.Generator | None],
    coins: torch.Tensor,  # [bs, coin_block] float32
    noise: torch.Tensor,  # [bs, V] float32
) -> None:
    """One verify step's randomness for each sampled row (``generators[row]``; None: a greedy
    row, left as it is): ``coin_block`` coins, then one Exp(1) vector, from the row's own
    generator. Every path that verifies a step (this module, decoding ahead, device-chain
    runs) draws through here, so a seeded request's stream does not depend on the path."""
    for row, generator in enumerate(generators):
        if generator is not None:
            coins[row].uniform_(generator=generator)
            noise[row].exponential_(generator=generator)
    # A draw of exactly 0 would make p / E inf and win the race.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _process(
    logits: torch.Tensor,  # [sum(N_i), V]
    trees: Sequence[Tree],
    reqs: Sequence[Request],
) -> torch.Tensor:  # [sum(N_i), V] float32
    """Every node's processed logits: each node is a row with its request's parameters, the
    tokens before it (committed, then the tree path) and, while its request has fewer generated
    tokens than ``min_tokens`` at that node, its EOS and stop tokens blocked."""
    device = logits.device
    params, blocked, prompt_lens = [], [], []
    for tree, req in zip(trees, reqs, strict=True):
        generated = len(req.output_ids)
        for depth in tree.depths:
            params.append(req.params)
            below = generated + depth < req.params.min_tokens
            blocked.append(req.min_tokens_block if below else ())
            prompt_lens.append(len(req.prompt_ids))
    # process_logits never draws: the generators only satisfy build's check.
    unused = torch.Generator(device=device)
    generators = [None if p.greedy else unused for p in params]
    batch = SamplingBatch.build(params, generators, device, blocked)
    history = _node_history(trees, reqs, device) if batch.uses_history else None
    lens = None
    if batch.any_counts:  # only presence and frequency read where the prompt ends
        lens = torch.tensor(prompt_lens, dtype=torch.int64, device=device)
    return process_logits(logits, batch, history, lens)


def _node_history(
    trees: Sequence[Tree], reqs: Sequence[Request], device: torch.device | str
) -> torch.Tensor:  # [sum(N), T] int64 padded with -1
    """Per node: the committed tokens plus the tree path down to it (the penalties)."""
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
        paths = [accepted[i].accept_nodes for i in moving]
        device = kv.k_caches[0].device
        ops = _ops(device)
        index, lens, bases = device_segments(
            [
                [n for p in paths for n in [*p, *[-1] * (width - len(p))]],  # [M, width]
                [len(p) for p in paths],
                [base_lens[i] for i in moving],
            ],
            device,
        )
        with kernels.trusted_values():  # paths this module computed from checked trees
            src, dst = ops.accepted_slots(
                kv.allocator.page_table(ids, device=device),
                bases,
                index.view(len(moving), width),
                lens,
                kv.spec.page_size,
            )
            ops.compact_accepted([*kv.k_caches, *kv.v_caches], src, dst)
    for request_id, base, v in zip(request_ids, base_lens, accepted, strict=True):
        kv.allocator.truncate(request_id, base + len(v.accept_nodes))
