"""Device-chain runs through a draft service (``tandem/link/chain_remote.py`` at the target,
``draft_service/chain.py`` at the draft): a real draft server on its own event loop and
worker thread, its local socket, the messages of docs/device-cycle.md, and the ``Outcome`` and
``Chains`` buffers and the prompt buffer in shared memory (the CPU stand-in for CUDA IPC;
buckets run eagerly on their static buffers, Triton interpreted).

Greedy output must equal target-only output while runs start and end with arrivals (sampled
output: the ordinary cycle's, seed for seed); a draft
that stops answering mid-run costs its requests their speculation, never a token.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from draft_service.config import DraftServiceConfig
from kernels.attention import _tree_attention_kernel
from tandem.config import DraftConfig, EngineConfig
from tandem.graphs.base import Bucket
from tandem.link import ipc
from tandem.link.chain_remote import RemoteChain
from tandem.link.remote import RemoteDrafter
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.v1 import draft_pb2
from tests.driving import drive
from tests.helpers.device_chain import (  # noqa: F401 (reference: a fixture)
    BATCH_SIZES,
    MIXED,
    PLAN,
    abort_storm,
    ordinary_engine,
    reference,
    reference_tokens,
    run_in_two_lanes,
    static_target_buckets,
)
from tests.helpers.draft_service import ServerThread
from tests.spec.conftest import LAYERS, Checkpoints

check_mode(_tree_attention_kernel)

NUM_STEPS = 3
PROMPT_MB = 16  # the draft's shared prompt buffer (shared memory here)


def draft_server(tmp_path: Path, ckpts: Checkpoints, batch_sizes: tuple[int, ...]) -> ServerThread:
    config = DraftConfig(
        kind="eagle3",
        path=ckpts.drafts["eagle3"],
        target=ckpts.target,
        device=str(DEVICE),
        page_size=4,
        num_pages=512,
        static_buckets=True,
        cuda_graph_batch_sizes=batch_sizes,
        cuda_graph_steps=(NUM_STEPS,),
    )
    return ServerThread(
        DraftServiceConfig(
            draft=config, local_socket=str(tmp_path / "d.sock"), prompt_buffer_mb=PROMPT_MB
        )
    )


@pytest.fixture
def draft(ckpts: Checkpoints, tmp_path: Path) -> Iterator[ServerThread]:
    server = draft_server(tmp_path, ckpts, BATCH_SIZES)
    yield server
    server.stop()


def remote_chain_engine(ckpts: Checkpoints, address: str, deadline_s: float = 120.0) -> Engine:
    """The target's engine with a ``RemoteDrafter`` on the draft's local stream and its
    buckets run eagerly (as ``tests/spec/test_device_chain.chain_engine``)."""
    drafter = RemoteDrafter(
        address, num_target_layers=LAYERS, deadline_s=deadline_s, device=str(DEVICE)
    )
    assert drafter.wait_ready(60)
    config = EngineConfig(
        model=ckpts.target,
        device=str(DEVICE),
        page_size=4,
        num_pages=1024,
        max_num_seqs=max(BATCH_SIZES),
        max_model_len=128,
        cuda_graphs=False,
    )
    engine = Engine(config, drafter=drafter, spec=SpecConfig(num_steps=NUM_STEPS, topk=1))
    static_target_buckets(engine, NUM_STEPS, drafter.target_layer_ids)
    engine.enable_device_chain()
    return engine


def _remote(engine: Engine) -> RemoteChain:
    chain = engine.chain
    assert chain is not None and isinstance(chain.draft, RemoteChain)
    return chain.draft


def _close(engine: Engine) -> None:
    drafter = engine.drafter
    assert isinstance(drafter, RemoteDrafter)
    drafter.close()


def test_the_hellos_choose_shared_memory(ckpts: Checkpoints, draft: ServerThread) -> None:
    engine = remote_chain_engine(ckpts, draft.address)
    try:
        link = _remote(engine).link()
        assert link is not None and link.chain_transport == draft_pb2.TENSOR_TRANSPORT_SHM
        assert link.ring is not None and link.ring.buffer.numel() == PROMPT_MB << 20
        assert engine.drafter is not None and engine.drafter.shares_prompts
    finally:
        _close(engine)


def test_sampled_requests_through_the_service_sample_as_the_ordinary_cycle(
    ckpts: Checkpoints, draft: ServerThread
) -> None:
    """Seeded sampled requests beside a greedy one and one that opted out (a row the draft
    service never hears of): the tokens of the ordinary cycle in process
    (tests/spec/test_device_chain_sampling.py), the draft's half in the service."""
    expected, _ = drive(ordinary_engine(ckpts, NUM_STEPS), MIXED)
    engine = remote_chain_engine(ckpts, draft.address)
    try:
        outputs, _ = drive(engine, MIXED)
        assert outputs == expected
        chain = engine.chain
        assert chain is not None and chain.target.sampled_steps >= 10, chain.target.sampled_steps
        assert chain.opted_out >= 1
    finally:
        _close(engine)


def test_output_through_the_service_equals_target_only(
    ckpts: Checkpoints,
    draft: ServerThread,
    reference: list[list[int]],  # noqa: F811
) -> None:
    engine = remote_chain_engine(ckpts, draft.address)
    try:
        # Warming: a run of padding rows alone per bucket, through the service; no request's
        # state is touched and no step counted.
        chain = engine.chain
        assert chain is not None and chain.warm() == len(BATCH_SIZES)
        assert (chain.runs, chain.launches, _remote(engine).steps) == (0, 0, {})
        outputs, _ = drive(engine, PLAN)
        assert outputs == reference
        link = _remote(engine).link()
        assert link is not None and link.ring is not None and link.ring.staged_bytes > 0
        chain = engine.chain
        assert chain is not None and not chain.active
        remote = _remote(engine)
        assert chain.runs >= 2 and chain.launches >= 12, (chain.runs, chain.launches)
        assert sum(remote.steps.values()) == chain.launches
        assert chain.lost == 0
        engine.flush_draft()
        _wait(lambda: draft.num_tracked() == 0)
    finally:
        _close(engine)


def test_trees_through_the_service_run_the_draft_tree_loop(
    ckpts: Checkpoints,
    draft: ServerThread,
    reference: list[list[int]],  # noqa: F811
) -> None:
    """Trees (K=2, N=6) take the ordinary step at the target and the tree loop's buckets at the
    draft service (``tandem/draft/tree_graphs.py``): greedy output equals target-only, and the
    service's draft pool ends empty."""
    drafter = RemoteDrafter(draft.address, num_target_layers=LAYERS, device=str(DEVICE))
    assert drafter.wait_ready(60)
    config = EngineConfig(
        model=ckpts.target, device=str(DEVICE), page_size=4, num_pages=1024, cuda_graphs=False
    )
    spec = SpecConfig(num_steps=NUM_STEPS, topk=2, num_draft_tokens=6)
    engine = Engine(config, drafter=drafter, spec=spec)
    try:
        outputs, _ = drive(engine, PLAN)
        assert outputs == reference
        model = draft.server.engine.model
        assert model is not None and model.graphs is not None
        trees = {b for kind, b in model.graphs.replays if kind == "tree"}
        assert len(trees) >= 2, model.graphs.replays
        engine.flush_draft()
        _wait(lambda: draft.num_tracked() == 0)
    finally:
        drafter.close()


def test_a_run_takes_both_lanes_through_the_service(
    ckpts: Checkpoints, draft: ServerThread
) -> None:
    """Requests in two lanes: the other lane's answer is waited for once, then one run takes
    every request; output target-only's, nothing left on the draft."""
    engine = remote_chain_engine(ckpts, draft.address)
    try:
        sizes = run_in_two_lanes(engine, ckpts)
        chain = engine.chain
        assert chain is not None
        assert 3 in sizes and chain.lost == 0, (sizes, chain.lost)
        _wait(lambda: draft.num_tracked() == 0)
    finally:
        _close(engine)


def test_a_run_goes_on_past_a_finished_request_through_the_service(
    ckpts: Checkpoints, draft: ServerThread
) -> None:
    """A request of four finishes mid-run: the draft keeps computing its row until the run
    ends, the others' outputs stay target-only's and the draft forgets every request."""
    engine = remote_chain_engine(ckpts, draft.address)
    prompts = ([5, 9, 17, 4, 250, 31], [8, 8, 40, 3], [77, 12, 9], [61, 2, 33, 5, 6])
    lengths = (40, 40, 40, 10)
    try:
        chain = engine.chain
        assert chain is not None
        ids = [
            engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths, strict=True)
        ]
        dead_steps = 0
        while engine.has_unfinished():
            engine.step()
            dead_steps += chain.active and chain.live < len(chain.reqs)
        assert dead_steps >= 1 and chain.lost == 0, (dead_steps, chain.lost)
        for rid, prompt, n in zip(ids, prompts, lengths, strict=True):
            assert engine.pop_finished(rid).token_ids == reference_tokens(ckpts, list(prompt), n)
        engine.flush_draft()
        _wait(lambda: draft.num_tracked() == 0)
        assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages
    finally:
        _close(engine)


def test_an_abort_storm_mid_run_leaves_both_pools_empty(
    ckpts: Checkpoints, draft: ServerThread
) -> None:
    """Arrivals and random aborts while runs are in flight, through the service: the others'
    outputs stay target-only's, the draft ends tracking nothing with its pool empty, and the
    target's pool is whole."""
    engine = remote_chain_engine(ckpts, draft.address)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(2, 10))] for _ in range(10)]
    lengths = [rng.randint(8, 36) for _ in prompts]
    try:
        chain = engine.chain
        assert chain is not None
        storm = abort_storm(engine, rng, prompts, lengths, max_aborts=4)
        ids, aborted, mid_run = storm.ids, storm.aborted, storm.mid_run
        assert mid_run >= 2 and chain.lost == 0, (mid_run, chain.lost)
        assert len(aborted) < len(ids)
        for rid, prompt, n in zip(ids, prompts, lengths, strict=True):
            tokens = engine.pop_finished(rid).token_ids
            expected = reference_tokens(ckpts, prompt, n)
            assert tokens == (expected[: len(tokens)] if rid in aborted else expected)
        engine.flush_draft()
        _wait(lambda: draft.num_tracked() == 0)
        usage = draft.run(draft.server.engine.kv_usage())
        assert usage.pages_used == 0, usage
        assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages
    finally:
        _close(engine)


def test_a_draft_that_stops_answering_costs_speculation_not_tokens(
    ckpts: Checkpoints, draft: ServerThread
) -> None:
    """The draft service goes away mid-run: the target's step waits no longer than its
    deadline, the run ends with its verdicts read, and the request finishes with target-only's
    tokens, decoding without trees (it would be taken in again by a draft that came back)."""
    engine = remote_chain_engine(ckpts, draft.address, deadline_s=5.0)
    prompt = [5, 9, 17, 4, 250, 31]
    try:
        chain = engine.chain
        assert chain is not None
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
        while not chain.active:
            engine.step()
        engine.step()
        assert chain.active
        draft.stop()
        draft.stop = lambda: None  # type: ignore[method-assign]
        started = time.monotonic()
        engine.step()  # its draft half gets no answer: the run ends
        assert time.monotonic() - started < 30
        assert not chain.active and chain.lost == 1
        req = engine._requests[rid]
        assert req.speculate and not req.in_draft
        while engine.has_unfinished():
            engine.step()
        assert engine.pop_finished(rid).token_ids == reference_tokens(ckpts, prompt, 48)
        assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages
    finally:
        _close(engine)


def test_a_step_the_draft_refuses_ends_the_run(ckpts: Checkpoints, draft: ServerThread) -> None:
    """Another stream steps the draft during a run (its hello is a step): the draft refuses
    the run's next step, the target reads what it launched, launches nothing more, and the
    request finishes with target-only's tokens; the draft releases it."""
    engine = remote_chain_engine(ckpts, draft.address)
    prompt = [8, 8, 40, 3, 77]
    other = None
    try:
        chain = engine.chain
        assert chain is not None
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        while not chain.active:
            engine.step()
        other = RemoteDrafter(draft.address, num_target_layers=LAYERS)
        assert other.wait_ready(60)
        engine.step()
        assert not chain.active and chain.lost == 1
        assert "stepped the draft" in _remote(engine).failed
        while engine.has_unfinished():
            engine.step()
        assert engine.pop_finished(rid).token_ids == reference_tokens(ckpts, prompt, 40)
        _wait(lambda: draft.num_tracked() == 0)
    finally:
        if other is not None:
            other.close()
        _close(engine)


def test_a_run_the_target_never_started_is_dropped(ckpts: Checkpoints, draft: ServerThread) -> None:
    """A ChainBegin the draft accepted after the target stopped waiting (posted here by hand,
    its answer taken but no step sent): the stream's next ordinary message drops the run on
    the draft, its reservation goes back, and later runs start and keep target-only's output."""
    engine = remote_chain_engine(ckpts, draft.address)
    prompt = [5, 9, 17, 4, 250, 31]
    try:
        chain = engine.chain
        assert chain is not None
        remote = _remote(engine)
        remote._quiet_until = float("inf")  # no run of the engine's own for now
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        for _ in range(3):
            engine.step()
        link = remote.link()
        assert link is not None and not chain.active
        bucket = Bucket(1, NUM_STEPS + 1)
        chains = chain.target.chains_for(bucket)
        begin = draft_pb2.ChainBegin(
            run_id=100,
            batch_size=1,
            num_steps=NUM_STEPS,
            request_ids=[rid],
            committed_lens=[link.stream.tracked[rid]],
            chains=[ipc.describe(chains.tokens), ipc.describe(chains.valid)],
        )
        answer = link.call(
            draft_pb2.SpeculateRequest(chain_begin=begin),
            time.monotonic() + 60,
            lambda a: a.HasField("chain_ready"),
        )
        assert answer is not None and not answer.chain_ready.refused
        features = chain.target_graphs.features
        width = None if features is None else features.shape[1]
        remote._map(answer.chain_ready, bucket, width)  # as if the engine's begin had taken it
        remote._described.add(bucket)
        remote._run_id = 100
        engine.step()  # an ordinary step: the draft drops run 100
        remote._quiet_until = 0.0
        while engine.has_unfinished():
            engine.step()
        assert chain.runs >= 1 and chain.lost == 0
        assert engine.pop_finished(rid).token_ids == reference_tokens(ckpts, prompt, 40)
        engine.flush_draft()
        _wait(lambda: draft.num_tracked() == 0)
    finally:
        _close(engine)


def _wait(condition: object, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_warming_skips_a_bucket_the_draft_lacks(ckpts: Checkpoints, tmp_path: Path) -> None:
    """A draft service with fewer buckets than the target: warming captures the ones it has
    and refuses the rest (a run there is refused too), and the engine's output stays
    target-only's."""
    server = draft_server(tmp_path, ckpts, BATCH_SIZES[:-1])
    engine = remote_chain_engine(ckpts, server.address)
    try:
        chain = engine.chain
        assert chain is not None
        assert chain.warm() == len(BATCH_SIZES) - 1
        assert _remote(engine).refusals == 1
        prompt = [5, 9, 17, 4, 250, 31]
        out = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert out[0].token_ids == reference_tokens(ckpts, prompt, 24)
    finally:
        _close(engine)
        server.stop()
