"""Device-chain steps (``tandem/target/device_chain.py``): speculative chain steps launched
before the last verdict is read, with every per-step input written on the device.

On CPU the target and draft buckets run eagerly on their static buffers (Triton interpreted);
with CUDA (the ``gpu`` tests) they are captured graphs. Greedy output must equal target-only
output while requests arrive and finish (runs start and end many times, batches pad), both KV
pools must end empty, and a run's host state at its end must be what the ordinary path builds.
"""

from __future__ import annotations

import random

import pytest

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.attention import _tree_attention_kernel
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.spec.types import NoTree, SpecConfig, SpecStats
from tandem.target.device_chain import ChainRead
from tandem.target.engine import Engine, GenerationResult
from tests.driving import Arrival, arrivals, drive
from tests.helpers.device_chain import (  # noqa: F401 (reference: a fixture)
    BATCH_SIZES,
    OPTED_OUT,
    PLAN,
    abort_storm,
    chain_engine,
    check_pools_empty,
    reference,
    reference_tokens,
    run_in_two_lanes,
    static_target_buckets,
)
from tests.spec.conftest import VOCAB, Checkpoints, make_drafter

check_mode(_tree_attention_kernel)


@pytest.mark.parametrize(
    ("kind", "num_steps", "page_size"),
    [("eagle3", 3, 4), ("eagle", 5, 4), ("eagle3", 3, 1), ("model", 3, 16), ("eagle3", 1, 4)],
)
def test_device_chain_output_equals_target_only(
    ckpts: Checkpoints,
    reference: list[list[int]],  # noqa: F811 (the imported fixture)
    kind: str,
    num_steps: int,
    page_size: int,
) -> None:
    engine = chain_engine(ckpts, kind, num_steps, page_size=page_size)
    chain = engine.chain
    assert chain is not None
    # Warming (one step of padding rows per bucket, as before a captured engine's first run)
    # touches no request's state and counts no step.
    assert chain.warm() == len(BATCH_SIZES)
    assert (chain.runs, chain.launches, chain.target.steps) == (0, 0, {})
    outputs, _ = drive(engine, PLAN)
    assert outputs == reference
    assert not chain.active
    assert chain.runs >= 2 and chain.launches >= 12, (chain.runs, chain.launches)
    check_pools_empty(engine)


def test_requests_that_opted_out_run_in_runs_as_plain_rows(
    ckpts: Checkpoints,
    reference: list[list[int]],  # noqa: F811
) -> None:
    """A request that opted out of speculation is a run's row verifying node 0 alone (the
    draft never sees it): the batch keeps its runs, every output equals target-only."""
    engine = chain_engine(ckpts, "eagle3", 3)
    popped: list[SpecStats] = []
    pop = engine.pop_finished

    def pop_and_keep(request_id: str) -> GenerationResult:
        result = pop(request_id)
        popped.append(result.stats)
        return result

    engine.pop_finished = pop_and_keep  # type: ignore[method-assign]
    outputs, _ = drive(engine, OPTED_OUT)
    assert outputs == reference
    chain = engine.chain
    assert chain is not None and chain.runs >= 2 and chain.opted_out >= 2, chain.opted_out
    for arrival, stats in zip(OPTED_OUT, popped, strict=True):
        if arrival.speculate:
            assert stats.draft_tokens > 0
        else:  # every step without a tree, for that reason alone
            assert stats.draft_tokens == 0 and set(stats.without_tree) == {NoTree.OPTED_OUT}
    check_pools_empty(engine)


def test_a_run_ends_in_the_state_of_ordinary_steps(ckpts: Checkpoints) -> None:
    """After a run ends, the engine's and the drafter's host state (KV lengths, tokens, the
    next tree, the kept feature) is what the ordinary path reads, and its output goes on
    equal to target-only."""
    engine = chain_engine(ckpts, "eagle3", 3)
    chain = engine.chain
    assert chain is not None
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    request_id = engine.add_request([5, 9, 17, 4, 250, 31], params)
    while not chain.active:
        engine.step()
    for _ in range(4):
        engine.step()
    assert chain.active
    engine.add_request([7, 8], SamplingParams(max_new_tokens=3, ignore_eos=True))  # ends the run
    engine.step()
    assert not chain.active
    req = engine._requests[request_id]
    drafter = engine.drafter
    seq = drafter.seqs[request_id]  # type: ignore[union-attr]
    assert seq.tokens == req.tokens
    assert req.num_computed == req.num_tokens - 1
    assert engine.kv.allocator.num_tokens(request_id) == req.num_computed
    assert drafter.kvs[0].allocator.num_tokens(request_id) == len(seq.tokens) - 1  # type: ignore[union-attr]
    assert req.tree is not None and req.tree.tokens[0] == req.tokens[-1]
    assert seq.features is not None and seq.feature_start == len(seq.tokens) - 2
    for _ in range(3):  # the ordinary path goes on from that state, and may start a run again
        engine.step()
    assert req.output_ids == reference_tokens(ckpts, [5, 9, 17, 4, 250, 31], len(req.output_ids))
    for rid in list(engine._requests):
        if not engine._requests[rid].finished:
            engine.abort(rid)
    engine.flush_draft()
    check_pools_empty(engine)


def test_an_abort_during_a_run_loses_nothing_of_the_others(ckpts: Checkpoints) -> None:
    """A request aborted while its steps are in flight: the run ends at the next step, its
    rows of the steps in flight are dropped, its pages go back, and the other request's
    output stays target-only's."""
    engine = chain_engine(ckpts, "eagle3", 3)
    chain = engine.chain
    assert chain is not None
    prompts = ([5, 9, 17, 4, 250, 31], [8, 8, 40, 3])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    kept, aborted = (engine.add_request(p, params) for p in prompts)
    while not chain.active:
        engine.step()
    engine.step()
    assert chain.active and chain.unread
    engine.abort(aborted)
    engine.step()  # reads what is in flight, ends the run
    assert not chain.active and not chain.unread
    while engine.has_unfinished():
        engine.step()
    engine.flush_draft()
    result = engine.pop_finished(kept)
    assert result.token_ids == reference_tokens(ckpts, list(prompts[0]), 40)
    assert engine.pop_finished(aborted).finish_reason.value == "abort"
    check_pools_empty(engine)
    assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages


def test_a_run_takes_both_lanes(ckpts: Checkpoints) -> None:
    """Requests in two lanes (the gateway's split of a large batch): once the other lane's
    trees are in, one run takes them all, and every output stays target-only's."""
    engine = chain_engine(ckpts, "eagle3", 3)
    sizes = run_in_two_lanes(engine, ckpts)
    assert 3 in sizes, sizes
    check_pools_empty(engine)


def test_a_run_goes_on_past_a_finished_request(ckpts: Checkpoints) -> None:
    """One of four requests finishes early (by length) and another is aborted mid-run: their
    rows go on being computed with their pages kept, the run keeps its bucket while the
    others need it, and ends once a smaller bucket would do; every other output stays
    target-only's and no page of either pool is left."""
    engine = chain_engine(ckpts, "eagle3", 3)
    chain = engine.chain
    assert chain is not None
    prompts = ([5, 9, 17, 4, 250, 31], [8, 8, 40, 3], [77, 12, 9], [61, 2, 33, 5, 6])
    lengths = (44, 44, 44, 10)
    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    runs_when_finished = None
    dead_steps = 0  # steps of a run with a finished row in it
    while engine.has_unfinished():
        engine.step()
        if chain.active and chain.live < len(chain.reqs):
            dead_steps += 1
            assert chain.live * 2 > len(chain.reqs)  # a smaller bucket would have ended it
        if runs_when_finished is None and engine._requests[ids[3]].finished:
            runs_when_finished = chain.runs
            engine.abort(ids[2])  # two of four finished: the next step ends the run
    engine.flush_draft()
    assert runs_when_finished is not None and dead_steps >= 1
    for rid, prompt, n in zip(ids[:2], prompts[:2], lengths[:2], strict=True):
        assert engine.pop_finished(rid).token_ids == reference_tokens(ckpts, list(prompt), n)
    assert engine.pop_finished(ids[3]).token_ids == reference_tokens(ckpts, list(prompts[3]), 10)
    assert engine.pop_finished(ids[2]).finish_reason.value == "abort"
    check_pools_empty(engine)
    assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages


def test_an_abort_storm_mid_run_leaks_nothing(ckpts: Checkpoints) -> None:
    """Requests arrive and are aborted at random while runs are in flight (rows finished,
    aborted and live in one run; runs ending and starting): every request that was not
    aborted ends with target-only's tokens, and neither pool keeps a page."""
    engine = chain_engine(ckpts, "eagle3", 3)
    chain = engine.chain
    assert chain is not None
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))] for _ in range(12)]
    lengths = [rng.randint(8, 40) for _ in prompts]
    storm = abort_storm(engine, rng, prompts, lengths)
    ids, aborted, mid_run = storm.ids, storm.aborted, storm.mid_run
    engine.flush_draft()
    assert mid_run >= 2 and chain.runs >= 3, (mid_run, chain.runs)
    assert len(aborted) < len(ids)
    for rid, prompt, n in zip(ids, prompts, lengths, strict=True):
        result = engine.pop_finished(rid)
        if rid in aborted:
            assert result.finish_reason.value == "abort"
            expected = reference_tokens(ckpts, prompt, n)[: len(result.token_ids)]
            assert result.token_ids == expected  # what it had committed was right
        else:
            assert result.token_ids == reference_tokens(ckpts, prompt, n)
    check_pools_empty(engine)
    assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages


def test_a_prompt_that_cannot_start_yet_leaves_the_run_going(ckpts: Checkpoints) -> None:
    """Two requests run (max_num_seqs 2) when a third arrives: it could not be scheduled
    before one finishes, so the run goes on; once one finishes the run ends and the prompt
    prefills. Every output is target-only's."""
    engine = chain_engine(ckpts, "eagle3", 3, max_num_seqs=2)
    chain = engine.chain
    assert chain is not None
    prompts = ([5, 9, 17, 4, 250, 31], [8, 8, 40, 3], [77, 12, 9])
    lengths = (40, 16, 20)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:2], params, strict=False)]
    while not chain.active:
        engine.step()
    runs = chain.runs
    ids.append(engine.add_request(prompts[2], params[2]))
    steps_while_waiting = 0
    while engine.scheduler.waiting:
        engine.step()
        steps_while_waiting += chain.active and chain.runs == runs
    assert steps_while_waiting >= 2
    while engine.has_unfinished():
        engine.step()
    engine.flush_draft()
    for rid, prompt, n in zip(ids, prompts, lengths, strict=True):
        assert engine.pop_finished(rid).token_ids == reference_tokens(ckpts, list(prompt), n)
    check_pools_empty(engine)


def test_a_run_that_cannot_start_says_why(ckpts: Checkpoints) -> None:
    """The reasons the engine logs while no run starts: a prompt waiting, then a prompt cut
    into chunks by the step's token budget still prefilling; then the run starts."""
    engine = chain_engine(ckpts, "eagle3", 3)
    chain = engine.chain
    assert chain is not None
    engine.scheduler.max_num_batched_tokens = 8  # a 6-token prompt beside a 4-token chain
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    engine.add_request([5, 9, 17, 4, 250, 31], params)
    assert chain.start_problem(engine.scheduler) == "a prompt is waiting"
    while not chain.active:
        engine.step()
    rid = engine.add_request([8, 8, 40, 3, 77, 12], params)
    problems = []
    while chain.active or not problems or problems[-1]:
        engine.step()
        if not chain.active:
            problems.append(chain.start_problem(engine.scheduler))
    assert problems[0] == "a prompt is waiting"
    assert any(f"prefilling: 1 ({rid}, ...)" in problem for problem in problems)
    assert problems[-1] == ""


def test_simulated_acceptance_runs_on_the_device(ckpts: Checkpoints) -> None:
    """Perf only: the accept length is drawn on the device; requests still finish at their
    lengths and nothing leaks."""
    engine = chain_engine(ckpts, "eagle3", 3, simulate=3.0)
    plan = [Arrival(step=0, prompt=[5, 9, 17], max_new_tokens=48)]
    outputs, _ = drive(engine, plan)
    assert len(outputs[0]) == 48
    chain = engine.chain
    assert chain is not None and chain.launches >= 5
    check_pools_empty(engine)


def test_simulated_draws_are_the_ordinary_steps(ckpts: Checkpoints) -> None:
    """A draw is a function of the prompt and the position (tandem.spec.simulate): requests
    arriving at different steps commit the same tokens (the draft's, as simulation commits
    them) and accept the same drafts through device-chain runs as through ordinary steps."""
    plan = [
        Arrival(step=0, prompt=[5, 9, 17], max_new_tokens=40),
        Arrival(step=2, prompt=[8, 8, 40, 3], max_new_tokens=33),
        Arrival(step=5, prompt=[77, 12], max_new_tokens=26),
    ]
    chained = chain_engine(ckpts, "eagle3", 3, simulate=3.0)
    outputs, _ = drive(chained, plan)
    assert chained.chain is not None and chained.chain.launches >= 10
    config = EngineConfig(
        model=ckpts.target,
        device=str(DEVICE),
        page_size=4,
        num_pages=1024,
        cuda_graphs=False,
        simulate_accept_length=3.0,
    )
    drafter = make_drafter(ckpts, "eagle3", str(DEVICE), 4, 512)
    ordinary = Engine(config, drafter=drafter, spec=SpecConfig(num_steps=3, topk=1))
    expected, _ = drive(ordinary, plan)
    assert outputs == expected
    assert len({tuple(o) for o in outputs}) == 3


def _run_to_finish(
    engine: Engine, params: SamplingParams
) -> tuple[list[int], tuple[bool, int] | None, str]:
    """Steps one request to its end: its tokens, the run's (active, unread) when the output
    that finished it came back, and the request's id."""
    chain = engine.chain
    assert chain is not None
    request_id = engine.add_request([5, 9, 17], params)
    tokens: list[int] = []
    finished_with: tuple[bool, int] | None = None
    while engine.has_unfinished():
        for out in engine.step().outputs:
            assert finished_with is None, "tokens after the request finished"
            tokens += out.new_token_ids
            if out.finished:
                finished_with = (chain.active, chain.unread)
    assert not chain.active and not chain.unread
    return tokens, finished_with, request_id


def test_a_finished_request_goes_out_before_its_run_ends(ckpts: Checkpoints) -> None:
    """A request that a stop token finishes (not foreseeable): the step that reads its last
    tokens returns them while the step launched ahead is still unread (not a step's time
    later); the next step reads it and ends the run, and ``has_unfinished`` holds until
    then."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    tokens, _, _ = _run_to_finish(chain_engine(ckpts, "eagle3", 3, simulate=3.0), params)
    stop = tokens[20]
    first = tokens.index(stop)
    engine = chain_engine(ckpts, "eagle3", 3, simulate=3.0)  # the same draws again
    stopped = SamplingParams(max_new_tokens=30, ignore_eos=True, stop_token_ids=(stop,))
    got, finished_with, request_id = _run_to_finish(engine, stopped)
    assert got == tokens[: first + 1]
    assert finished_with == (True, 1)  # its run was still to end
    assert engine.pop_finished(request_id).token_ids == got
    check_pools_empty(engine)


def test_a_run_launches_nothing_past_the_length_limit(ckpts: Checkpoints) -> None:
    """A request that ``max_new_tokens`` finishes: once the unread step may reach it, the
    engine reads before it launches (``DeviceChain.may_all_finish``), so the run ends at the
    read that finishes the request, with no step launched for nobody."""
    engine = chain_engine(ckpts, "eagle3", 3, simulate=3.0)
    chain = engine.chain
    assert chain is not None
    rows_read: list[int] = []  # per read step, the rows someone was waiting for
    read = chain.read

    def counted() -> list[ChainRead]:
        reads = read()
        rows_read.append(len(reads))
        return reads

    chain.read = counted  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    tokens, finished_with, request_id = _run_to_finish(engine, params)
    assert finished_with == (False, 0)  # ended at the read: nothing was launched ahead
    assert len(tokens) == 30
    assert engine.pop_finished(request_id).token_ids == tokens
    assert len(rows_read) == chain.launches >= 5 and 0 not in rows_read, rows_read
    check_pools_empty(engine)


GPU_PLAN = [
    Arrival(step=0, prompt=[5, 9, 17, 4, 250, 31], max_new_tokens=200),
    *(
        Arrival(step=a.step + 40, prompt=a.prompt, max_new_tokens=a.max_new_tokens)
        for a in arrivals(16, VOCAB, every=12, new_tokens=(16, 120), seed=13)
    ),
]


@pytest.mark.gpu
def test_captured_device_chain_equals_target_only(ckpts: Checkpoints) -> None:
    """Captured graphs written on the device: greedy output equals target-only (float32)
    over hundreds of launches while the batch moves between buckets."""
    config = EngineConfig(model=ckpts.target, device="cuda", num_pages=1024, cuda_graphs=False)
    expected = drive(Engine(config), GPU_PLAN)[0]
    engine = chain_engine(ckpts, "eagle3", 3, page_size=16, capture=True, max_model_len=512)
    outputs, _ = drive(engine, GPU_PLAN)
    assert outputs == expected
    chain = engine.chain
    assert chain is not None and chain.launches >= 100, (chain.runs, chain.launches)
    target = engine.runner.graphs
    assert target is not None and target.captured
    steps = chain.target.steps  # device-chain steps per bucket, each one captured graph
    assert len({b.batch_size for b in steps}) >= 2, steps
    # Every bucket was captured before the first run (``DeviceChain.warm``), none in a run.
    assert chain.warmed == len(BATCH_SIZES) == chain.target.captures, chain.target.captures
    check_pools_empty(engine)


def test_an_engine_that_cannot_says_why(ckpts: Checkpoints) -> None:
    """device_chain without CUDA graphs is refused at construction, naming what is missing."""
    drafter = make_drafter(ckpts, "eagle3", "cpu")
    config = EngineConfig(model=ckpts.target, device="cpu", num_pages=64, device_chain=True)
    with pytest.raises(ValueError, match="needs CUDA graphs"):
        Engine(config, drafter=drafter, spec=SpecConfig(num_steps=3, topk=1))


def test_a_warming_that_fails_turns_device_chain_steps_off(
    ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture that fails while an idle engine warms (out of memory, say) is logged and
    turns device-chain steps off; it does not escape the idle loop's call, and requests then
    take the ordinary cycle with target-only's output."""
    engine = chain_engine(ckpts, "eagle3", 3)
    chain = engine.chain
    assert chain is not None

    def fail() -> int:
        raise RuntimeError("CUDA out of memory during capture")

    monkeypatch.setattr(chain, "needs_warming", lambda: True)
    monkeypatch.setattr(chain, "warm", fail)
    engine.flush_draft()
    assert engine.chain is None
    prompt = [5, 9, 17, 4, 250, 31]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert out[0].token_ids == reference_tokens(ckpts, prompt, 24)
    check_pools_empty(engine)
