"""Plain-torch references for the kernels in `kernels/`: the CPU path and the kernels' oracle.

Each `<op>_ref` has the signature of its Triton twin (`kernels/<op>.py`). Clarity and exactness
come before speed: inputs are validated on the host, and loops run over vocabulary chunks, tree
levels or siblings, vectorised over the batch, never over single tokens.

Trees (docs/design.md section 3) are padded per request: request `b` has `num_nodes[b]` nodes out of
`N`, node 0 is the verified token, and entries at `i >= num_nodes[b]` are padding that is never
linked, followed or accepted. Child lists are in ascending node order.
"""

from __future__ import annotations

import torch
from torch import Tensor

_NEG_INF = float("-inf")
# Slack allowed on the sum of a target distribution (fp32 softmax over a large vocabulary).
_PROB_SUM_TOL = 1e-3


def _expect(t: Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    """Raise ValueError unless `t` is a tensor of `shape` (-1 = any size) and `dtype`."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.ndim != len(shape) or any(s not in (-1, d) for s, d in zip(shape, t.shape, strict=True)):
        raise ValueError(f"{name}: expected shape {shape} (-1 = any), got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def _expect_float(t: Tensor, name: str, shape: tuple[int, ...]) -> None:
    _expect(t, name, shape)
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")


# --------------------------------------------------------------------------- top1 / topk


def _online_top1(x: Tensor, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """One pass over vocabulary chunks (kernels.md section 2): running max, its first index, and
    the running sum of exp(x - max), rescaled whenever the max grows.

    `x` [R, V] is fp32 with NaN and +inf already replaced by -inf. Returns `m` [R] (-inf for an
    all -inf row), `d` [R] (= sum exp(x - m), >= 1 unless the row is all -inf, then 0) and
    `idx` [R] int64 (0 for an all -inf row).
    """
    num_rows, vocab = x.shape
    m = x.new_full((num_rows,), _NEG_INF)  # [R]
    d = x.new_zeros(num_rows)  # [R]
    idx = torch.zeros(num_rows, dtype=torch.int64, device=x.device)  # [R]
    for start in range(0, vocab, chunk_size):
        chunk = x[:, start : start + chunk_size]  # [R, C]
        offs = torch.arange(start, start + chunk.shape[1], device=x.device)  # [C]
        chunk_max = chunk.amax(dim=1)  # [R]
        chunk_arg = torch.where(chunk == chunk_max[:, None], offs, vocab).amin(dim=1)  # [R]
        m_new = torch.maximum(m, chunk_max)
        # While a row is all -inf, exp(-inf - -inf) would be NaN: shift by 0 instead (d stays 0).
        shift = torch.where(m_new > _NEG_INF, m_new, 0.0)  # [R]
        d = d * torch.exp(m - shift) + torch.exp(chunk - shift[:, None]).sum(dim=1)
        # Strictly greater: a later chunk never takes a tie from an earlier one.
        idx = torch.where(chunk_max > m, chunk_arg, idx)
        m = m_new
    return m, d, idx


def _check_logits(logits: Tensor, chunk_size: int) -> None:
    _expect_float(logits, "logits", (-1, -1))
    if logits.shape[1] < 1:
        raise ValueError("logits: the vocabulary must not be empty")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _check_k(k: int, vocab: int) -> None:
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")


def _prepare_logits(logits: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Validate `logits` [R, V]; return it in fp32 with bad entries at -inf, and `valid` [R]."""
    _check_logits(logits, chunk_size)
    x = logits.float()  # [R, V]
    bad = torch.isnan(x) | (x == float("inf"))  # [R, V]
    return x.masked_fill(bad, _NEG_INF), ~bad.any(dim=1)


def top1_ref(logits: Tensor, *, chunk_size: int = 4096) -> tuple[Tensor, Tensor, Tensor]:
    """Fused argmax and log-probability of the top token, without materialising a softmax.

    `logits` [R, V] (any float dtype, computed in fp32) -> `ids` [R] int64, `logprob` [R] fp32
    (= max - logsumexp = -log(sum exp(x - max)) <= 0), `valid` [R] bool. Ties go to the lowest
    index. A row with a NaN or +inf, or with every entry -inf, is invalid: id 0 (always in range),
    logprob -inf. `chunk_size` is the vocabulary chunk of the online pass.
    """
    x, valid = _prepare_logits(logits, chunk_size)  # [R, V], [R]
    m, d, idx = _online_top1(x, chunk_size)
    valid = valid & (m > _NEG_INF)
    ids = torch.where(valid, idx, 0)  # [R]
    logprob = torch.where(valid, -torch.log(d), _NEG_INF)  # [R]
    return ids, logprob, valid


def topk_ref(logits: Tensor, k: int, *, chunk_size: int = 4096) -> tuple[Tensor, Tensor, Tensor]:
    """The `k` most likely tokens per row with their log-softmax values.

    `logits` [R, V] -> `ids` [R, k] int64 (descending, ties toward the lower id), `logprobs`
    [R, k] fp32, `valid` [R] bool. Validity as in `top1_ref`; invalid rows get ids arange(k) and
    logprobs -inf. The normaliser comes from the same online pass, so k == 1 equals `top1_ref`.
    """
    x, valid = _prepare_logits(logits, chunk_size)  # [R, V], [R]
    _check_k(k, x.shape[1])
    m, d, _ = _online_top1(x, chunk_size)
    valid = valid & (m > _NEG_INF)
    # A stable descending sort keeps equal values in ascending id order.
    values, ids = torch.sort(x, dim=1, descending=True, stable=True)  # [R, V]
    logprobs = (values[:, :k] - m[:, None]) - torch.log(d)[:, None]  # [R, k]
    fallback = torch.arange(k, device=x.device).expand(x.shape[0], k)  # [R, k]
    ids = torch.where(valid[:, None], ids[:, :k], fallback)
    logprobs = torch.where(valid[:, None], logprobs, _NEG_INF)
    return ids, logprobs, valid


def _check_sample(logits: Tensor, temperature: Tensor, noise: Tensor) -> None:
    _check_logits(logits, 1)
    _expect_float(temperature, "temperature", (logits.shape[0],))
    _expect_float(noise, "noise", tuple(logits.shape))


def sample_ref(logits: Tensor, temperature: Tensor, noise: Tensor) -> Tensor:
    """The next token of every row from processed logits, without a host sync
    (`tandem.sampling.sample` after `process_logits`).

    `logits` [R, V] (filtered entries -inf; computed in fp32), `temperature` [R] (> 0 samples,
    otherwise greedy; the logits already carry it), `noise` [R, V] Exp(1) samples (read for
    sampled rows only; clamped away from 0 by the caller) -> `ids` [R] int64. Greedy rows take
    the argmax (lowest id among ties; torch ranks NaN highest, so a NaN row gives its first
    NaN). Sampled rows run the exponential race argmax(softmax(x) / noise): P(v) = p(v), and a
    token with p = 0 is never drawn; a row with a NaN or +inf, or all -inf, gives 0.
    """
    _check_sample(logits, temperature, noise)
    x = logits.float()  # [R, V]
    greedy_ids = x.argmax(dim=-1)  # [R]
    race = x.softmax(dim=-1).div_(noise)  # [R, V]
    return torch.where(temperature > 0, race.argmax(dim=-1), greedy_ids)


# --------------------------------------------------------------------------- trees


def _real_nodes(num_nodes: Tensor, n: int) -> Tensor:
    """[bs, n] bool: node i of request b is not padding."""
    return torch.arange(n, device=num_nodes.device)[None, :] < num_nodes[:, None]


def _check_num_nodes(num_nodes: Tensor, bs: int, n: int, *, values: bool = True) -> None:
    """Shapes and dtypes always; with `values`, the entries too (a host read of the tensors)."""
    _expect(num_nodes, "num_nodes", (bs,), torch.int64)
    if n < 1:
        raise ValueError("trees need at least one node (N >= 1)")
    if not values:
        return
    bad = (num_nodes < 1) | (num_nodes > n)
    if bad.any():
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"request {b}: num_nodes = {int(num_nodes[b])} is outside [1, {n}]")


def _check_tree(parents: Tensor, num_nodes: Tensor, *, values: bool = True) -> None:
    """Validation of `build_tree_ref`'s arguments (`values` as in `_check_num_nodes`)."""
    _expect(parents, "parents", (-1, -1), torch.int64)
    bs, n = parents.shape
    _check_num_nodes(num_nodes, bs, n, values=values)
    if not values:
        return
    node = torch.arange(n, device=parents.device)  # [N]
    real = _real_nodes(num_nodes, n)  # [bs, N]
    if (parents[:, 0] != -1).any():
        b = int((parents[:, 0] != -1).nonzero()[0, 0])
        raise ValueError(f"request {b}, node 0: parent must be -1, got {int(parents[b, 0])}")
    bad = real & (node > 0) & ((parents < 0) | (parents >= node))
    if bad.any():
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"request {b}, node {i}: parent {int(parents[b, i])} not in [0, {i})")


def build_tree_ref(parents: Tensor, num_nodes: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Depths, ancestor mask and child links of padded trees given by parent indices.

    `parents` [bs, N] int64 (`parents[b, 0] == -1`, `0 <= parents[b, i] < i` for real nodes),
    `num_nodes` [bs] int64 -> `depth` [bs, N] int64 (0 at padding), `mask` [bs, N, N] bool
    (node i sees j iff j == i or j is an ancestor of i; padding rows and columns False),
    `first_child` [bs, N] and `next_sibling` [bs, N] int64 (-1 = none, siblings ascending).
    Raises ValueError naming the request and node of an invalid tree.
    """
    _check_tree(parents, num_nodes)
    bs, n = parents.shape
    real = _real_nodes(num_nodes, n)  # [bs, N]
    rows = torch.arange(bs, device=parents.device)  # [bs]
    depth = torch.zeros(bs, n, dtype=torch.int64, device=parents.device)
    mask = torch.zeros(bs, n, n, dtype=torch.bool, device=parents.device)
    mask[:, 0, 0] = True
    for i in range(1, n):  # parents come before children, so their rows are final
        live = real[:, i]  # [bs]
        parent = torch.where(live, parents[:, i], 0)  # [bs]
        depth[:, i] = torch.where(live, depth[rows, parent] + 1, 0)
        mask[:, i] = mask[rows, parent] & live[:, None]
        mask[:, i, i] = live
    first_child = torch.full((bs, n), -1, dtype=torch.int64, device=parents.device)
    next_sibling = torch.full_like(first_child, -1)
    for i in range(n - 1, 0, -1):  # push children last to first: child lists come out ascending
        reqs = rows[real[:, i]]
        parent = parents[reqs, i]
        next_sibling[reqs, i] = first_child[reqs, parent]
        first_child[reqs, parent] = i
    return depth, mask, first_child, next_sibling


def _link_depths(first_child: Tensor, next_sibling: Tensor, real: Tensor) -> Tensor:
    """[bs, N] depths as a walk in node order over forward links assigns them: node x sets
    depth[first_child[x]] = depth[x] + 1, then depth[next_sibling[x]] = depth[x]; a node linked
    twice keeps its last writer's value, an unlinked one 0.

    Every writer of y is a node below y, so depth[y] = depth[w] + step(w -> y) for y's last
    writer w: a forest walked by pointer jumping in log2(N) batched rounds, not N steps.
    """
    bs, n = first_child.shape
    dev = first_child.device
    node = torch.arange(n, device=dev)  # [N]
    links = torch.stack([first_child, next_sibling], dim=2)  # [bs, N, 2]
    order = torch.stack([2 * node, 2 * node + 1], dim=1).expand(bs, n, 2)  # the walk's order
    live = real[:, :, None] & (links >= 0)  # [bs, N, 2]
    target = torch.where(live, links, n).reshape(bs, 2 * n)  # dead links land in column N
    keys = torch.where(live, order, -1).reshape(bs, 2 * n)
    last = torch.full((bs, n + 1), -1, dtype=torch.int64, device=dev)
    last = last.scatter_reduce_(1, target, keys, "amax")[:, :n]  # [bs, N] last writer's key
    linked = last >= 0
    ptr = torch.where(linked, last // 2, node)  # roots point to themselves
    depth = torch.where(linked, 1 - last % 2, 0)  # first_child adds 1, next_sibling 0
    for _ in range(max(1, (n - 1).bit_length())):
        depth = depth + depth.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    return depth


def _check_links(
    first_child: Tensor,
    next_sibling: Tensor,
    num_nodes: Tensor,
    width: int,
    *,
    values: bool = True,
) -> None:
    """Validate child links as `build_tree_ref` writes them, and the accept width.

    Links of real nodes must point forward inside the request (x < link < num_nodes[b]), which
    also bounds every walk. `width` must be >= max depth + 1 so any accepted path fits.
    Without `values` only shapes, dtypes and width >= 1 are checked.
    """
    _expect(first_child, "first_child", (-1, -1), torch.int64)
    bs, n = first_child.shape
    _expect(next_sibling, "next_sibling", (bs, n), torch.int64)
    _check_num_nodes(num_nodes, bs, n, values=values)
    if not values:
        if width < 1:
            raise ValueError(f"accept_width {width} < max depth + 1 >= 1")
        return
    node = torch.arange(n, device=first_child.device)  # [N]
    real = _real_nodes(num_nodes, n)  # [bs, N]
    for name, link in (("first_child", first_child), ("next_sibling", next_sibling)):
        bad = real & (link != -1) & ((link <= node) | (link >= num_nodes[:, None]))
        if bad.any():
            b, i = (int(v) for v in bad.nonzero()[0])
            link_to, limit = int(link[b, i]), int(num_nodes[b])
            raise ValueError(f"request {b}, node {i}: {name} {link_to} not -1 or in ({i}, {limit})")
    if (next_sibling[:, 0] != -1).any():
        raise ValueError("node 0 cannot have a next sibling")
    depth = _link_depths(first_child, next_sibling, real)  # [bs, N]
    max_depth = int(depth.max()) if bs else 0
    if width < max_depth + 1:
        raise ValueError(f"accept_width {width} < max depth + 1 = {max_depth + 1}")


def _check_greedy(
    tokens: Tensor,
    target_ids: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    num_nodes: Tensor,
    accept_width: int,
    *,
    values: bool = True,
) -> None:
    """Validation of `verify_greedy_ref`'s arguments (`values` as in `_check_num_nodes`)."""
    _expect(tokens, "tokens", (-1, -1), torch.int64)
    bs, n = tokens.shape
    _expect(target_ids, "target_ids", (bs, n), torch.int64)
    _expect(first_child, "first_child", (bs, n), torch.int64)
    _check_links(first_child, next_sibling, num_nodes, accept_width, values=values)


def verify_greedy_ref(
    tokens: Tensor,
    target_ids: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    num_nodes: Tensor,
    accept_width: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy tree verification (kernels.md 3.2).

    `tokens` [bs, N] int64 (node 0 = verified token), `target_ids` [bs, N] int64 (the target's
    choice at each node), links and `num_nodes` as from `build_tree_ref` -> `accept_index`
    [bs, accept_width] int64 (the accepted path from node 0, -1 padded), `accept_len` [bs] int64
    (accepted drafts + 1), `bonus` [bs] int64 (`target_ids` at the last accepted node). From node
    0, accept the first child (ascending) whose token equals the target's choice at its parent.
    """
    _check_greedy(tokens, target_ids, first_child, next_sibling, num_nodes, accept_width)
    bs, n = tokens.shape
    rows = torch.arange(bs, device=tokens.device)  # [bs]
    accept_index = torch.full((bs, accept_width), -1, dtype=torch.int64, device=tokens.device)
    accept_index[:, 0] = 0
    accept_len = torch.ones(bs, dtype=torch.int64, device=tokens.device)
    last = torch.zeros(bs, dtype=torch.int64, device=tokens.device)  # [bs]
    active = torch.ones(bs, dtype=torch.bool, device=tokens.device)  # [bs]
    for level in range(1, accept_width):
        want = target_ids[rows, last]  # [bs]
        child = torch.where(active, first_child[rows, last], -1)  # [bs]
        for _ in range(n):  # walk the siblings to the first match (links point forward)
            at = child.clamp(min=0)
            miss = (child >= 0) & (tokens[rows, at] != want)
            if not miss.any():
                break
            child = torch.where(miss, next_sibling[rows, at], child)
        active = child >= 0
        if not active.any():
            break
        accept_index[active, level] = child[active]
        accept_len += active
        last = torch.where(active, child, last)
    return accept_index, accept_len, target_ids[rows, last]


def _check_sampling(
    tokens: Tensor,
    target_probs: Tensor,
    coins: Tensor,
    residual_noise: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    num_nodes: Tensor,
    accept_width: int,
    *,
    values: bool = True,
) -> None:
    """Validation of `verify_sampling_ref`'s arguments (`values` as in `_check_num_nodes`)."""
    _expect(tokens, "tokens", (-1, -1), torch.int64)
    bs, n = tokens.shape
    _expect(target_probs, "target_probs", (bs, n, -1), torch.float32)
    vocab = target_probs.shape[2]
    _expect_float(coins, "coins", (bs, n))
    _expect_float(residual_noise, "residual_noise", (bs, vocab))
    _expect(first_child, "first_child", (bs, n), torch.int64)
    _check_links(first_child, next_sibling, num_nodes, accept_width, values=values)
    if not values:
        return
    real = _real_nodes(num_nodes, n)  # [bs, N]
    drafts = real & (torch.arange(n, device=real.device) > 0)  # [bs, N]
    if ((tokens < 0) | (tokens >= vocab))[drafts].any():
        raise ValueError(f"tokens: a draft token is outside [0, {vocab})")
    # Row reductions first: no copy of the real rows (GB-sized at batch 64, N 64, V 128K).
    sums = target_probs.sum(dim=2)[real]  # [real nodes]
    lowest = target_probs.amin(dim=2)[real] if vocab else sums  # NaN stays NaN
    if not (lowest >= 0).all() or not ((sums - 1).abs() <= _PROB_SUM_TOL).all():
        raise ValueError("target_probs: rows of real nodes must be >= 0 and sum to 1")
    if not ((coins[real] >= 0) & (coins[real] < 1)).all():
        raise ValueError("coins: must lie in [0, 1)")
    if not (residual_noise >= 0).all():
        raise ValueError("residual_noise: must be >= 0 (Exp(1) samples)")


def verify_sampling_ref(
    tokens: Tensor,
    target_probs: Tensor,
    coins: Tensor,
    residual_noise: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    num_nodes: Tensor,
    accept_width: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Lossless tree speculative sampling for a deterministic draft (kernels.md 3.3, thresholds 1).

    `tokens` [bs, N] int64, `target_probs` [bs, N, V] fp32 (the target's processed distribution
    at each node), `coins` [bs, N] uniform in [0, 1), `residual_noise` [bs, V] Exp(1) samples;
    links, `num_nodes` and the outputs as in `verify_greedy_ref`.

    At node x with children c_1..c_m (ascending; a child repeating an earlier sibling's token is
    skipped), u = coins[b, x]: accept the first c_k with u < sum_{i<=k} p_x(token(c_i)), an
    inverse-CDF draw, so each child is accepted with exactly its probability. If none is, the
    bonus is drawn from the residual (p_x with the children's tokens zeroed; p_x itself at a
    leaf) by the exponential race argmax(residual / residual_noise[b]); zero-probability tokens
    are never drawn. Rounding: when the children hold all the mass, their fp32 sum can still end
    below u, leaving the residual all zero; exact arithmetic would accept the last child with
    positive probability, and so does this function.
    """
    _check_sampling(
        tokens,
        target_probs,
        coins,
        residual_noise,
        first_child,
        next_sibling,
        num_nodes,
        accept_width,
    )
    bs, n, vocab = target_probs.shape
    dev = tokens.device
    rows = torch.arange(bs, device=dev)  # [bs]
    accept_index = torch.full((bs, accept_width), -1, dtype=torch.int64, device=dev)
    accept_index[:, 0] = 0
    accept_len = torch.ones(bs, dtype=torch.int64, device=dev)
    bonus = torch.zeros(bs, dtype=torch.int64, device=dev)
    last = torch.zeros(bs, dtype=torch.int64, device=dev)  # [bs]
    active = torch.ones(bs, dtype=torch.bool, device=dev)  # [bs]
    for level in range(1, accept_width + 1):  # the node at `last` has depth level - 1
        if not active.any():
            break
        p = target_probs[rows, last]  # [bs, V]
        u = coins[rows, last]  # [bs]
        residual = p.clone()  # [bs, V]
        seen = torch.zeros(bs, vocab, dtype=torch.bool, device=dev)  # children's tokens
        cum = torch.zeros(bs, dtype=torch.float32, device=dev)  # [bs]
        accepted = torch.full((bs,), -1, dtype=torch.int64, device=dev)
        last_positive = torch.full((bs,), -1, dtype=torch.int64, device=dev)
        child = torch.where(active, first_child[rows, last], -1)  # [bs]
        for _ in range(n):  # siblings in ascending order (links point forward)
            live = child >= 0
            if not live.any():
                break
            at = child.clamp(min=0)
            tok = torch.where(live, tokens[rows, at], 0)  # [bs]; node 0's token is never read
            take = live & ~seen[rows, tok]  # a repeated sibling token is skipped
            p_tok = p[rows, tok]
            cum = torch.where(take, cum + p_tok, cum)
            seen[rows, tok] |= take
            residual[rows, tok] = torch.where(take, 0.0, residual[rows, tok])
            last_positive = torch.where(take & (p_tok > 0), child, last_positive)
            hit = take & (u < cum)
            accepted = torch.where(hit, child, accepted)
            child = torch.where(live & ~hit, next_sibling[rows, at], -1)
        stuck = (accepted < 0) & (residual.amax(dim=1) <= 0)  # the rounding case above
        accepted = torch.where(stuck, last_positive, accepted)
        stop = active & (accepted < 0)
        race = torch.where(residual > 0, residual / residual_noise, -1.0)  # [bs, V]
        bonus = torch.where(stop, race.argmax(dim=1), bonus)
        active &= accepted >= 0
        assert level < accept_width or not active.any(), "the width check bounds the walk"
        if active.any():
            accept_index[active, level] = accepted[active]
            accept_len += active
            last = torch.where(active, accepted, last)
    return accept_index, accept_len, bonus


# --------------------------------------------------------------------------- KV compaction


def _check_compact(
    caches: list[Tensor], src_slots: Tensor, dst_slots: Tensor, *, values: bool = True
) -> None:
    """Validation of `compact_accepted_ref`'s arguments (`values` as in `_check_num_nodes`)."""
    _expect(src_slots, "src_slots", (-1,), torch.int64)
    _expect(dst_slots, "dst_slots", tuple(src_slots.shape), torch.int64)
    slots = None  # [2 M'] the slots of the pairs that move
    if values:
        if torch.unique(dst_slots).numel() != dst_slots.numel():
            raise ValueError("dst_slots: destinations must be distinct")
        moved = src_slots != dst_slots  # [M]
        slots = torch.cat([src_slots[moved], dst_slots[moved]])
    for layer, cache in enumerate(caches):
        if not isinstance(cache, Tensor) or cache.ndim < 1:
            raise ValueError(f"caches[{layer}]: expected a tensor [num_slots, ...]")
        if slots is not None and slots.numel() and (slots.min() < 0 or slots.max() >= len(cache)):
            raise ValueError(f"caches[{layer}]: a slot is outside [0, {len(cache)})")


def compact_accepted_ref(caches: list[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """Move the accepted nodes' KV to contiguous slots, in place (kernels.md section 4).

    `caches`: every K and V tensor of every layer, each [num_slots, ...]; `src_slots`,
    `dst_slots` [M] int64. For every pair, `cache[dst] = cache[src]` with load-all-then-store
    semantics, so sources and destinations may overlap (path [0, 2, 3] moves 2->1 and 3->2).
    Pairs with src == dst are skipped; destinations must be distinct.
    """
    _check_compact(caches, src_slots, dst_slots)
    moved = src_slots != dst_slots  # [M]
    src, dst = src_slots[moved], dst_slots[moved]  # [M']
    for cache in caches:
        cache[dst] = cache[src]  # the gather copies every source row before any store


def _check_accepted_slots(
    page_table: Tensor,
    base_lens: Tensor,
    accept_index: Tensor,
    accept_len: Tensor,
    page_size: int,
    *,
    values: bool = True,
) -> None:
    """Validation of `accepted_slots_ref`'s arguments (`values` as in `_check_num_nodes`)."""
    _expect(page_table, "page_table", (-1, -1), torch.int32)
    bs, max_pages = page_table.shape
    _expect(base_lens, "base_lens", (bs,), torch.int64)
    _expect(accept_index, "accept_index", (bs, -1), torch.int64)
    _expect(accept_len, "accept_len", (bs,), torch.int64)
    width = accept_index.shape[1]
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not values:
        return
    if ((accept_len < 1) | (accept_len > width)).any():
        raise ValueError(f"accept_len: must lie in [1, {width}]")
    if (base_lens < 0).any():
        raise ValueError("base_lens: must be >= 0")
    j = torch.arange(width, device=accept_index.device)  # [W]
    used = j[None, :] < accept_len[:, None]  # [bs, W]
    if (accept_index[used] < 0).any():
        raise ValueError("accept_index: the first accept_len entries must be node indices >= 0")
    src_pos = (base_lens[:, None] + accept_index)[used]  # [M]
    dst_pos = (base_lens[:, None] + j[None, :])[used]  # [M]
    if src_pos.numel() and int(torch.maximum(src_pos, dst_pos).max()) >= max_pages * page_size:
        raise ValueError("accept_index: a KV index is past the end of its page table")


def accepted_slots_ref(
    page_table: Tensor,
    base_lens: Tensor,
    accept_index: Tensor,
    accept_len: Tensor,
    page_size: int,
) -> tuple[Tensor, Tensor]:
    """Source and destination KV slots of the accepted nodes, for `compact_accepted_ref`.

    `page_table` [bs, max_pages] int32, `base_lens` [bs] int64 (KV index of node 0, i.e. L-1),
    `accept_index` [bs, W] int64, `accept_len` [bs] int64 -> `src_slots`, `dst_slots`
    [sum(accept_len)] int64, request by request: node `accept_index[b, j]` lives at KV index
    `base + accept_index[b, j]` and moves to `base + j`. A KV index `pos` is at slot
    `page_table[b, pos // page_size] * page_size + pos % page_size`.
    """
    _check_accepted_slots(page_table, base_lens, accept_index, accept_len, page_size)
    bs, width = accept_index.shape
    j = torch.arange(width, device=accept_index.device)  # [W]
    used = j[None, :] < accept_len[:, None]  # [bs, W]
    req = torch.arange(bs, device=accept_index.device)[:, None].expand(bs, width)[used]  # [M]
    src_pos = (base_lens[:, None] + accept_index)[used]  # [M]
    dst_pos = (base_lens[:, None] + j[None, :])[used]  # [M]

    def slot(pos: Tensor) -> Tensor:
        return page_table[req, pos // page_size].long() * page_size + pos % page_size

    return slot(src_pos), slot(dst_pos)


# --------------------------------------------------------------------------- KV writes


def _check_store_kv(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    _expect_float(k, "k", (-1, -1, -1))
    num_tokens, num_kv_heads, head_dim = k.shape
    _expect_float(v, "v", (num_tokens, num_kv_heads, head_dim))
    _expect_float(k_cache, "k_cache", (-1, num_kv_heads, head_dim))
    _expect(v_cache, "v_cache", tuple(k_cache.shape), k_cache.dtype)
    _expect(slot_mapping, "slot_mapping", (num_tokens,), torch.int64)


def store_kv_ref(
    k: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_mapping: Tensor,  # [num_tokens] int64
) -> None:
    """Writes each token's K/V into its slot, in the caches' dtype
    (`tandem.attention.torch_ref.store_kv`). Slots must lie in [0, num_slots)."""
    _check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
