"""One host-path forward of a draft module: every request's pairs in one call, appended to its
paged KV (committed pairs, or scratch entries under tree masks). The extend (``extend.py``) and
the tree loop (``trees.py``) run their modules through it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.attention import AttentionMetadata
from tandem.draft.state import ModelDraftState
from tandem.models import ForwardContext
from tandem.transfer import to_device


@dataclass
class Pair:
    """One pair to run through a module: which request, token, position and hidden."""

    request_id: str
    token: int
    position: int
    hidden: torch.Tensor | None  # [H_d]
    node: int | None = None  # pool index when it is a tree node (scratch entry)


@dataclass
class Run:
    """A request's tokens to run through a module in one forward, their positions, and their
    hiddens ([len(tokens), H], or None for a module without hidden input)."""

    request_id: str
    tokens: list[int]
    positions: list[int]
    hidden: torch.Tensor | None


def run_pairs(
    state: ModelDraftState,
    m: int,
    pairs: list[list[Pair]],
    masks: list[torch.Tensor] | None,
) -> list[list[torch.Tensor]]:
    """One forward of module ``m`` over each request's pairs, appended to its KV; with
    ``masks`` ([pairs, scratch entries] per request) they are scratch entries seeing the
    committed prefix plus what their mask row allows. Returns outputs per request."""
    module = state.modules[m]
    runs = []
    for chunk in pairs:
        hidden = None
        if module.uses_hidden and chunk:
            hidden = torch.stack([p.hidden for p in chunk])  # type: ignore[misc]
        runs.append(
            Run(
                chunk[0].request_id if chunk else "",
                [p.token for p in chunk],
                [p.position for p in chunk],
                hidden,
            )
        )
    return [list(rows.unbind(0)) for rows in forward(state, m, runs, masks)]


def forward(
    state: ModelDraftState, m: int, runs: list[Run], masks: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """One forward of module ``m`` over every run's tokens, appended to its request's KV
    (scratch entries under ``masks``, as ``run_pairs``). Returns each run's outputs,
    [n, H_d]."""
    module, kv = state.modules[m], state.kvs[m]
    alloc = kv.allocator
    live = [i for i, run in enumerate(runs) if run.tokens]
    if not live:
        return [torch.empty(0) for _ in runs]
    starts, ends, prefixes = [], [], []
    for i in live:
        run = runs[i]
        start = alloc.num_tokens(run.request_id)
        alloc.extend(run.request_id, len(run.tokens))
        starts.append(start)
        ends.append(start + len(run.tokens))
        scratch = 0 if masks is None else masks[i].shape[1] - len(run.tokens)
        prefixes.append(start - scratch)
    live_ids = [runs[i].request_id for i in live]
    meta = AttentionMetadata.build(
        page_size=alloc.page_size,
        query_lens=[len(runs[i].tokens) for i in live],
        seq_lens=ends,
        page_table=alloc.page_table(live_ids, device=state.device),
        slot_mapping=kv.slot_mapping_tensor(live_ids, starts, ends),
        masks=None if masks is None else [masks[i] for i in live],
        prefix_lens=prefixes,
    )
    token_list = [t for i in live for t in runs[i].tokens]
    position_list = [p for i in live for p in runs[i].positions]
    token_ids, positions = to_device(torch.tensor([token_list, position_list]), state.device)
    hidden = None
    if module.uses_hidden:
        parts = [runs[i].hidden for i in live]
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]
    ctx = ForwardContext(kv=kv, meta=meta, backend=state.backend)
    started = time.perf_counter_ns()
    out = module(token_ids, hidden, positions, ctx)
    state.model_ns += time.perf_counter_ns() - started
    split = iter(out.split([len(runs[i].tokens) for i in live]))
    return [next(split) if run.tokens else out[:0] for run in runs]
