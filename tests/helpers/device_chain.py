"""What the device-chain tests share (in process and through a draft service): the batch
sizes its buckets cover, plans of arrivals that start and end runs (greedy; greedy and sampled
mixed), the engines (the target's buckets run eagerly on their static buffers; the ordinary
cycle with the same draft), and target-only references."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest

from tests.kernels._interpret import DEVICE  # sets Triton's mode: import first

# isort: split
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.target.graphs import graph_widths
from tests.driving import Arrival, arrivals, drive
from tests.spec.conftest import VOCAB, Checkpoints, make_drafter

BATCH_SIZES = (1, 2, 4)
# A request alone first (a long run), then arrivals that end runs and pad batches.
PLAN = [
    Arrival(step=0, prompt=[5, 9, 17, 4, 250, 31], max_new_tokens=56),
    *(
        Arrival(step=a.step + 10, prompt=a.prompt, max_new_tokens=a.max_new_tokens)
        for a in arrivals(3, VOCAB, every=8, new_tokens=(6, 36), seed=3)
    ),
]


# ``PLAN`` with every other request opted out of speculation (the same greedy output).
OPTED_OUT = [replace(a, speculate=n % 2 == 0) for n, a in enumerate(PLAN)]


def static_target_buckets(engine: Engine, num_steps: int, layers: tuple[int, ...]) -> None:
    """The target's graph buckets for chains of ``num_steps``, run eagerly on their static
    buffers (the CPU stand-in for CUDA graphs)."""
    engine.runner.enable_graphs(
        batch_sizes=BATCH_SIZES,
        widths=graph_widths(num_steps + 1),
        max_model_len=engine.max_model_len,
        capture_layers=layers,
        capture=False,
    )


@pytest.fixture(scope="module")
def reference(ckpts: Checkpoints) -> list[list[int]]:
    """Target-only greedy outputs of ``PLAN``."""
    config = EngineConfig(model=ckpts.target, device=str(DEVICE), num_pages=256, cuda_graphs=False)
    return drive(Engine(config), PLAN)[0]


def reference_tokens(ckpts: Checkpoints, prompt: list[int], num: int) -> list[int]:
    """Target-only greedy continuation of ``prompt``."""
    config = EngineConfig(model=ckpts.target, device=str(DEVICE), num_pages=64, cuda_graphs=False)
    params = SamplingParams(max_new_tokens=num, ignore_eos=True)
    return Engine(config).generate([prompt], params)[0].token_ids


def run_in_two_lanes(engine: Engine, ckpts: Checkpoints) -> set[int]:
    """Three requests in alternating lanes (the gateway's split of a large batch), stepped to
    their end with the draft flushed; each output checked against target-only's. Returns the
    sizes the device-chain runs had."""
    chain = engine.chain
    assert chain is not None
    prompts = ([5, 9, 17, 4, 250, 31], [8, 8, 40, 3], [77, 12, 9])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids = [engine.add_request(p, params, lane=n % 2) for n, p in enumerate(prompts)]
    sizes = set()
    while engine.has_unfinished():
        engine.step()
        if chain.active:
            sizes.add(len(chain.reqs))
    engine.flush_draft()
    for rid, prompt in zip(ids, prompts, strict=True):
        assert engine.pop_finished(rid).token_ids == reference_tokens(ckpts, list(prompt), 40)
    return sizes


@dataclass
class Storm:
    """What ``abort_storm`` did: the requests in arrival order, those it aborted, and how many
    aborts came while a run had steps in flight."""

    ids: list[str] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    mid_run: int = 0


def abort_storm(
    engine: Engine,
    rng: random.Random,
    prompts: list[list[int]],
    lengths: list[int],
    max_aborts: int | None = None,
) -> Storm:
    """Admits ``prompts`` one every 8 steps and, before each step, aborts a random running
    request (30% of steps while a run is active, 5% otherwise; at most ``max_aborts``), until
    every request finished."""
    chain = engine.chain
    assert chain is not None
    storm, step = Storm(), 0
    while len(storm.ids) < len(prompts) or engine.has_unfinished():
        if len(storm.ids) < len(prompts) and step % 8 == 0:
            params = SamplingParams(max_new_tokens=lengths[len(storm.ids)], ignore_eos=True)
            storm.ids.append(engine.add_request(prompts[len(storm.ids)], params))
        running = [r.request_id for r in engine.scheduler.running]
        room = max_aborts is None or len(storm.aborted) < max_aborts
        if running and room and rng.random() < (0.3 if chain.active else 0.05):
            victim = rng.choice(running)
            storm.mid_run += chain.active and chain.unread > 0
            engine.abort(victim)
            storm.aborted.add(victim)
        engine.step()
        step += 1
    return storm


def chain_engine(
    ckpts: Checkpoints,
    kind: str,
    num_steps: int,
    *,
    page_size: int = 4,
    simulate: float | None = None,
    capture: bool = False,
    max_model_len: int = 128,  # page tables (and interpreted attention's splits) stay small
    max_num_seqs: int = max(BATCH_SIZES),
) -> Engine:
    drafter = make_drafter(ckpts, kind, str(DEVICE), page_size, 2048 // page_size)
    config = EngineConfig(
        model=ckpts.target,
        device=str(DEVICE),
        page_size=page_size,
        num_pages=4096 // page_size,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        cuda_graphs=capture,
        cuda_graph_batch_sizes=BATCH_SIZES,
        simulate_accept_length=simulate,
        device_chain=capture,
    )
    engine = Engine(config, drafter=drafter, spec=SpecConfig(num_steps=num_steps, topk=1))
    if not capture:  # the same buffers and buckets, run eagerly
        static_target_buckets(engine, num_steps, drafter.target_layer_ids)
        drafter.enable_graphs(
            batch_sizes=BATCH_SIZES,
            max_model_len=engine.max_model_len,
            num_steps=(num_steps,),
            capture=False,
        )
        engine.enable_device_chain()
    return engine


def check_pools_empty(engine: Engine) -> None:
    drafter = engine.drafter
    assert drafter is not None and drafter.num_tracked() == 0
    for kv in getattr(drafter, "kvs"):  # noqa: B009
        assert kv.allocator.num_free_pages == kv.allocator.num_pages, "draft KV leaked"


# Greedy and sampled requests (one opted out of speculation) arriving while others run, so
# runs start and end with each kind; the greedy one runs on alone at the end.
MIXED = [
    Arrival(step=0, prompt=[5, 9, 17, 4, 250, 31], max_new_tokens=30, temperature=0.8),
    Arrival(step=3, prompt=[8, 8, 40, 3], max_new_tokens=64),
    Arrival(step=5, prompt=[60, 7, 7, 1], max_new_tokens=18, temperature=0.9, speculate=False),
    Arrival(step=9, prompt=[77, 12, 9], max_new_tokens=24, temperature=1.0, top_p=0.9),
    Arrival(step=12, prompt=[21, 4, 4, 100, 6], max_new_tokens=20, temperature=0.7, top_k=20),
]


def ordinary_engine(ckpts: Checkpoints, num_steps: int) -> Engine:
    """The same draft and chains, every step an ordinary one."""
    drafter = make_drafter(ckpts, "eagle3", str(DEVICE), 4, 512)
    config = EngineConfig(
        model=ckpts.target, device=str(DEVICE), page_size=4, num_pages=1024, cuda_graphs=False
    )
    return Engine(config, drafter=drafter, spec=SpecConfig(num_steps=num_steps, topk=1))
