"""The host path of the draft's extend: the committed pairs an update completed, through every
module into its KV (what no graph bucket takes; ``graphs.py`` runs the rest).

Head ``m`` consumes token ``t_j`` at position ``j - 1 - m`` (``shift``) with, as hidden, the
target feature of that position (module 0, and every head in ``target`` mode) or head
``m-1``'s output there (``chain`` mode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.draft.forward import Run, forward
from tandem.draft.state import DraftSeq, ModelDraftState, Update

# Per request, module m-1's outputs of this extend: (first, output before, outputs).
_Outs = tuple[int, torch.Tensor | None, torch.Tensor]


def extend_eagerly(
    state: ModelDraftState, updates: Sequence[Update], starts: dict[str, int]
) -> None:
    """Runs every module over the pairs ``updates`` completed (their tokens and features
    appended already; ``starts``: each request's token count before them)."""
    prev_outs: dict[str, _Outs] = {}
    for m, module in enumerate(state.modules):
        runs: list[Run] = []
        firsts: list[int] = []
        for request_id, _, _ in updates:
            seq = state.seqs[request_id]
            first = max(starts[request_id], module.shift)
            firsts.append(first)
            hidden = _committed_hiddens(state, m, seq, first, prev_outs.get(request_id))
            positions = list(range(first - module.shift, len(seq.tokens) - module.shift))
            runs.append(Run(request_id, seq.tokens[first:], positions, hidden))
        outs = forward(state, m, runs)
        for run, first, out in zip(runs, firsts, outs, strict=True):
            seq = state.seqs[run.request_id]
            prev_outs[run.request_id] = (first, seq.last_out[m], out)
            if out.shape[0]:
                seq.last_out[m] = out[-1]


def _committed_hiddens(
    state: ModelDraftState, m: int, seq: DraftSeq, first: int, prev: _Outs | None
) -> torch.Tensor | None:
    """Hidden inputs ([n, H]) of module ``m``'s committed pairs consuming ``t_first ...``,
    as one tensor: target features go through ``project_target`` once for the whole run (a
    long catch-up after K=0 steps is one matmul and no per-token work on the host)."""
    module, n = state.modules[m], len(seq.tokens) - first
    if n <= 0 or not module.uses_hidden:
        return None
    if m == 0 or state.mode == "target":
        assert seq.features is not None, "a hidden-consuming draft got no target features"
        row = first - 1 - m - seq.feature_start
        assert row >= 0 and row + n <= seq.features.shape[0], "features are not kept"
        return module.project_target(seq.features[row : row + n])
    # Chain mode: pair t_j feeds on module m-1's output of the pair before it.
    assert prev is not None, "chain head extended before the head it feeds on"
    prev_first, before, outs = prev  # before: module m-1's output preceding prev_first
    start = first - prev_first  # index into [before, *outs]
    if start > 0:
        return outs[start - 1 : start - 1 + n]
    assert before is not None, "chain head has no output to feed on"
    return torch.cat([before[None], outs[: n - 1]])
