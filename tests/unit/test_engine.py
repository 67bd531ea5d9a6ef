"""The target-only engine: greedy output equals transformers' generate; batching, chunking and
preemption never change it; sampling is seeded per request; no KV page leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem.config import EngineConfig
from tandem.errors import InvalidRequest
from tandem.kv import PageAllocator
from tandem.request import FinishReason, Request
from tandem.sampling import SamplingParams
from tandem.spec.types import Tree
from tandem.target.engine import Engine
from tandem.target.scheduler import ScheduledBatch, Scheduler
from tests.checkpoints import ARCHS, hf_greedy, make_checkpoint
from tests.helpers.engine import ragged_prompts

NEW_TOKENS = 32


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=11)


def engine(path: Path, **overrides: Any) -> Engine:
    return Engine(EngineConfig(model=path, **overrides))


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.slow  # each: the engine and transformers' generate on CPU
@pytest.mark.parametrize(
    "overrides",
    [
        {"page_size": 16},
        {"page_size": 1, "max_num_batched_tokens": 8},  # prompts chunked, mixed with decodes
        {"page_size": 3, "num_pages": 24, "max_num_seqs": 4},  # pool tight: preemptions
        {"page_size": 16, "transposed_weights": True},  # the CUDA default layout
    ],
    ids=["plain", "chunked", "preempting", "transposed"],
)
def test_greedy_batch_equals_transformers_generate(ckpt: Path, overrides: dict[str, Any]) -> None:
    eng = engine(ckpt, **overrides)
    prompts = ragged_prompts(eng.model.config.vocab_size)
    results = eng.generate(prompts, greedy())
    expected = hf_greedy(ckpt, prompts, NEW_TOKENS)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    if "num_pages" in overrides:
        assert sum(r.num_preemptions for r in results) > 0, "the tight pool never preempted"
    alloc = eng.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages and len(alloc) == 0


def test_stop_tokens_eos_and_abort(ckpt: Path) -> None:
    eng = engine(ckpt)
    prompt = ragged_prompts(eng.model.config.vocab_size)[2]
    free_run = eng.generate([prompt], greedy(12))[0].token_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    stopped = eng.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(stop_at,)))
    assert stopped[0].token_ids == free_run[: first + 1]
    assert stopped[0].finish_reason is FinishReason.STOP
    rid = eng.add_request(prompt, greedy(50))
    eng.step()
    eng.abort(rid)
    assert not eng.has_unfinished()
    assert eng.pop_finished(rid).finish_reason is FinishReason.ABORT
    assert eng.kv.allocator.num_free_pages == eng.kv.allocator.num_pages


def test_eos_stops_unless_ignored(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", "llama", seed=2)
    eng = engine(path)
    prompt = ragged_prompts(eng.model.config.vocab_size)[1]
    run = eng.generate([prompt], greedy(8))[0].token_ids
    # Declare the 4th generated token an EOS id: generation must stop there.
    eng.scheduler.eos_token_ids = frozenset({run[3]})
    stopped = eng.generate([prompt], SamplingParams(max_new_tokens=8))[0]
    assert stopped.token_ids == run[: run.index(run[3]) + 1]
    assert stopped.finish_reason is FinishReason.STOP
    assert eng.generate([prompt], greedy(8))[0].token_ids == run


@pytest.mark.slow  # the batch, each request alone and a reseed: six generations on CPU
def test_sampling_is_seeded_per_request_and_batch_independent(ckpt: Path) -> None:
    eng = engine(ckpt)
    prompts = ragged_prompts(eng.model.config.vocab_size)
    params = [
        SamplingParams(
            temperature=0.9, top_k=50, top_p=0.9, seed=100 + i, max_new_tokens=16, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    together = [r.token_ids for r in eng.generate(prompts, params)]
    alone = [eng.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert together == alone
    reseeded = eng.generate(prompts[:1], [SamplingParams(**{**_fields(params[0]), "seed": 7})])
    assert reseeded[0].token_ids != together[0]


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {k: getattr(p, k) for k in p.__dataclass_fields__}


def test_invalid_requests_are_refused(ckpt: Path) -> None:
    eng = engine(ckpt, num_pages=4, page_size=4)
    vocab = eng.model.config.vocab_size
    with pytest.raises(InvalidRequest, match="prompt_ids"):
        eng.add_request([], greedy())
    with pytest.raises(InvalidRequest, match="prompt_ids"):
        eng.add_request([vocab], greedy())
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        eng.add_request([5] * 10, greedy(100))  # 110 tokens never fit in 16 slots
    rid = eng.add_request([5], greedy(2))
    with pytest.raises(InvalidRequest, match="request_id"):
        eng.add_request([5], greedy(2), request_id=rid)


def test_step_full_counts_sequences_and_prompt_tokens() -> None:
    """``Scheduler.step_full`` (an idle target stops gathering a burst there): waiting prompts
    whose tokens reach the step's budget fill it, and so do sequences reaching the cap."""

    def scheduler(max_num_seqs: int) -> Scheduler:
        return Scheduler(
            PageAllocator(64, 4),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=10,
            max_model_len=64,
            eos_token_ids=(),
        )

    def request(i: int, n: int) -> Request:
        return Request(
            request_id=f"r{i}", prompt_ids=list(range(1, n + 1)), params=SamplingParams()
        )

    by_tokens = scheduler(max_num_seqs=8)
    by_tokens.add(request(0, 6))
    assert not by_tokens.step_full()
    by_tokens.add(request(1, 4))  # 10 prompt tokens: the budget
    assert by_tokens.step_full()
    by_seqs = scheduler(max_num_seqs=2)
    by_seqs.add(request(0, 2))
    assert not by_seqs.step_full()
    by_seqs.add(request(1, 2))
    assert by_seqs.step_full()


@pytest.mark.parametrize(("parents", "masked"), [((-1, 0, 1), False), ((-1, 0, 0), True)])
def test_a_prompt_chunk_beside_chains_stays_causal(
    tmp_path: Path, parents: tuple[int, ...], masked: bool
) -> None:
    """A step that verifies a chain beside a prompt chunk has no custom mask (a chain's
    ancestor mask is the causal one), so the chunk keeps the causal attention kernel; a
    branching tree needs its mask."""
    path = make_checkpoint(tmp_path, "llama", seed=3, vocab_size=64)
    eng = engine(path, num_pages=64)
    running = Request(request_id="a", prompt_ids=[5, 6, 7, 8], params=greedy())
    running.num_computed = 3
    running.tree = Tree(tokens=(8, 9, 10), parents=parents)
    prompt = Request(request_id="b", prompt_ids=list(range(3, 23)), params=greedy())
    batch = ScheduledBatch()
    for req, n in ((running, 3), (prompt, 12)):
        eng.kv.allocator.allocate(req.request_id, req.num_computed + n)
        batch.requests.append(req)
        batch.num_new_tokens.append(n)
    inputs = eng.runner.prepare(batch)
    assert inputs.meta is not None
    assert (inputs.meta.custom_mask is not None) == masked
