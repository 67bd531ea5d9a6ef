"""Decoding ahead (tandem/target/ahead.py): the target-only engine launches each plain decode step
before reading the last one. Outputs equal the synchronous engine and transformers whatever
happens while a step is in flight: a stop token (the request's next row is computed and
dropped), a length limit (known at launch), an abort, a new arrival, a full pool; sampled
requests decode ahead too, seed for seed as synchronously; a penalised one holds the batch."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.config import EngineConfig
from tandem.request import FinishReason, Request
from tandem.sampling import SamplingParams, make_generator
from tandem.target import ahead
from tandem.target.engine import Engine
from tests.checkpoints import hf_greedy, make_checkpoint

VOCAB = 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ahead"), "llama", seed=11, vocab_size=VOCAB)


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def engine(path: Path, **overrides: Any) -> Engine:
    return Engine(EngineConfig(model=path, page_size=4, **overrides))


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def run(
    eng: Engine, work: list[tuple[list[int], SamplingParams]], *, late: int, abort: int
) -> tuple[list[list[int]], list[FinishReason]]:
    """The first half of ``work`` at once, the rest added at step ``late``; request 1 aborted
    at step ``abort``. Token ids and finish reasons in ``work`` order."""
    half = len(work) // 2
    ids = [eng.add_request(p, sp) for p, sp in work[:half]]
    steps = 0
    while eng.has_unfinished() or steps <= late:
        eng.step()
        steps += 1
        if steps == late:
            ids += [eng.add_request(p, sp) for p, sp in work[half:]]
        if steps == abort:
            eng.abort(ids[1])
    results = [eng.pop_finished(i) for i in ids]
    alloc = eng.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages and len(alloc) == 0, "KV pages leaked"
    return [r.token_ids for r in results], [r.finish_reason for r in results]  # type: ignore[misc]


@pytest.mark.slow  # transformers' generate and several engines on CPU
def test_ahead_equals_synchronous_and_transformers(ckpt: Path) -> None:
    ps = prompts(8)
    free = hf_greedy(ckpt, ps, 40)
    work = []
    for i, (p, out) in enumerate(zip(ps, free, strict=True)):
        if i % 3 == 0:  # stops on a token it meets mid-run: its next row is in flight
            sp = SamplingParams(max_new_tokens=40, stop_token_ids=(out[10 + i],))
        else:
            sp = greedy(12 + 3 * i)
        work.append((p, sp))
    sync = run(engine(ckpt, overlap=False), work, late=15, abort=9)
    eng = engine(ckpt)
    ahead = run(eng, work, late=15, abort=9)
    # The abort lands one token earlier decoding ahead (the host reads a step late).
    aborted_sync, aborted_ahead = sync[0].pop(1), ahead[0].pop(1)
    assert aborted_ahead == aborted_sync[: len(aborted_ahead)] and aborted_ahead
    assert sync[1][1] is ahead[1][1] is FinishReason.ABORT
    assert ahead == sync
    for i, (tokens, reason) in enumerate(zip(ahead[0], ahead[1][:1] + ahead[1][2:], strict=True)):
        j = i if i == 0 else i + 1
        assert tokens == free[j][: len(tokens)]
        assert reason is (FinishReason.STOP if j % 3 == 0 else FinishReason.LENGTH)
    # Most decode steps decoded ahead: chains break only at arrivals, the abort and the end.
    assert eng.ahead.launches >= 40, eng.ahead.launches
    flight = eng.ahead.in_flight
    assert flight is None or all(r.finished for r in flight.batch.requests)


def test_sampled_requests_decode_ahead_with_their_own_random_streams(ckpt: Path) -> None:
    """Seeded sampled requests (temperature, top-k, top-p) beside greedy ones: the tokens of
    the synchronous engine, most steps launched ahead."""
    ps = prompts(4, seed=5)
    work = [
        (ps[0], greedy(16)),
        (ps[1], SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, ignore_eos=True)),
        (ps[2], SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=8)),
        (ps[3], SamplingParams(max_new_tokens=14, temperature=0.6, top_k=20, seed=9)),
    ]
    outs = []
    for overlap in (False, True):
        eng = engine(ckpt, overlap=overlap)
        res = eng.generate([p for p, _ in work], [sp for _, sp in work])
        outs.append([r.token_ids for r in res])
    assert eng.ahead.launches >= 8, eng.ahead.launches
    assert outs[0] == outs[1]
    assert len(set(map(tuple, outs[1][1:]))) == 3


def test_penalised_requests_step_synchronously(ckpt: Path) -> None:
    ps = prompts(3, seed=5)
    penalised = greedy(16, repetition_penalty=1.3)
    work = [(ps[0], greedy(16)), (ps[1], penalised), (ps[2], greedy(16))]
    outs = []
    for overlap in (False, True):
        eng = engine(ckpt, overlap=overlap)
        res = eng.generate([p for p, _ in work], [sp for _, sp in work])
        outs.append([r.token_ids for r in res])
        assert eng.ahead.launches == 0  # one request that cannot decode ahead holds the batch
    assert outs[0] == outs[1]


@pytest.mark.slow  # the engine and transformers' generate on CPU
def test_full_pool_takes_the_ordinary_step(ckpt: Path) -> None:
    """With a pool too small for everyone, decoding ahead never preempts: the step that
    cannot reserve a slot reads the one in flight and the scheduler preempts as usual."""
    ps = prompts(4, seed=9)
    eng = engine(ckpt, num_pages=14, max_num_seqs=4)
    results = eng.generate(ps, greedy(24))
    assert [r.token_ids for r in results] == hf_greedy(ckpt, ps, 24)
    assert sum(r.num_preemptions for r in results) > 0, "the pool never ran out"
    assert eng.ahead.launches > 0
    alloc = eng.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages


@pytest.mark.gpu
def test_a_sampled_step_queues_without_waiting_for_the_stream() -> None:
    """Sampling a decode-ahead step (its inputs built, filters, coins and race) waits for
    nothing queued before it: a copy from pageable memory waits for the step in flight, which
    made sampled target-only steps slower than greedy ones (docs/performance.md)."""
    device = torch.device("cuda")
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=1),
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=2),
    ]
    reqs = [
        Request(
            request_id=f"r{i}",
            prompt_ids=[1, 2],
            params=p,
            generator=None if p.greedy else make_generator(i, device),
        )
        for i, p in enumerate(params)
    ]
    logits = torch.randn(len(reqs), 32000, device=device)
    ahead._sample(logits, reqs, 4)  # kernels compiled, pinned blocks cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, logprobs = ahead._sample(logits, reqs, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.shape == logprobs.shape == (len(reqs),)
