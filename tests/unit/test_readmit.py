"""Readmission of requests the draft lost (``tandem/target/readmit.py``): recomputed only
while the draft's pool, as it last reported it, has room for them."""

from __future__ import annotations

from tandem.kv import PageAllocator
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.spec.base import DraftState, DraftStatus
from tandem.target.readmit import READMIT_HEADROOM, readmit_lost
from tandem.target.scheduler import Scheduler


class _Reporting:
    """The one thing ``readmit_lost`` asks a drafter: its status (pool as last answered)."""

    def __init__(self, status: DraftStatus) -> None:
        self._status = status

    def status(self) -> DraftStatus:
        return self._status


def _decoding(num: int, prompt_len: int) -> Scheduler:
    """A scheduler with ``num`` requests past their prompts, none of them in the draft."""
    scheduler = Scheduler(
        PageAllocator(4096, 16),
        max_num_seqs=num,
        max_num_batched_tokens=num * prompt_len,
        max_model_len=4096,
        eos_token_ids=(),
    )
    for i in range(num):
        params = SamplingParams(max_new_tokens=1024, ignore_eos=True)
        scheduler.add(Request(request_id=f"r{i}", prompt_ids=[7] * prompt_len, params=params))
    batch = scheduler.schedule()
    for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
        req.num_computed += n
    scheduler.postprocess(batch, [[3]] * num, [[0.0]] * num)
    for req in scheduler.running:
        assert req.decoding and req.speculate and not req.in_draft
    return scheduler


def _pool(free_tokens: int) -> DraftStatus:
    return DraftStatus(
        state=DraftState.HEALTHY,
        kv_pages_total=1000,
        kv_pages_used=1000 - free_tokens // 16,
        kv_page_size=16,
    )


def test_only_what_the_draft_pool_holds_is_recomputed() -> None:
    scheduler = _decoding(4, 500)
    need = 501 + READMIT_HEADROOM
    readmit_lost(scheduler, _Reporting(_pool(2 * need + 16)), 4096)  # type: ignore[arg-type]
    recomputed = list(scheduler.waiting)
    assert len(recomputed) == 2 and all(r.readmissions == 1 for r in recomputed)
    left = scheduler.running
    assert len(left) == 2 and all(r.speculate and r.readmissions == 0 for r in left)


def test_a_full_draft_pool_recomputes_nothing_and_gives_up_on_no_one() -> None:
    scheduler = _decoding(3, 500)
    readmit_lost(scheduler, _Reporting(_pool(0)), 4096)  # type: ignore[arg-type]
    assert not scheduler.waiting and len(scheduler.running) == 3
    assert all(r.speculate for r in scheduler.running)


def test_a_pool_not_reported_recomputes_all() -> None:
    scheduler = _decoding(3, 500)
    readmit_lost(scheduler, _Reporting(DraftStatus(state=DraftState.HEALTHY)), 4096)  # type: ignore[arg-type]
    assert len(scheduler.waiting) == 3
