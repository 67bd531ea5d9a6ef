"""Engine drivers for the graph tests: requests that arrive and finish over many steps (so the
batch size changes all the time), and a shadow that reruns every graph step eagerly on the same
KV and compares logits, features and KV writes."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tandem.sampling import SamplingParams
from tandem.target.engine import Engine
from tandem.target.graphs import Bucket, TargetGraphRunner
from tandem.target.runner import ModelInputs, ModelOutputs
from tandem.target.scheduler import ScheduledBatch


@dataclass(frozen=True)
class Arrival:
    step: int  # the engine step before which the request is added
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy; else sampled with a seed from the arrival's step
    top_k: int = 0
    top_p: float = 1.0
    speculate: bool = True  # False: the request opts out of speculation


def arrivals(
    num: int, vocab: int, *, every: int, new_tokens: tuple[int, int], seed: int
) -> list[Arrival]:
    """``num`` requests, one every ``every`` steps, ragged prompts and output lengths."""
    rng = random.Random(seed)
    return [
        Arrival(
            step=i * every,
            prompt=[rng.randrange(3, vocab) for _ in range(rng.randint(1, 24))],
            max_new_tokens=rng.randint(*new_tokens),
        )
        for i in range(num)
    ]


def drive(engine: Engine, plan: Sequence[Arrival]) -> tuple[list[list[int]], int]:
    """Adds each request at its step and steps until every one finished: outputs in arrival
    order (greedy unless an arrival has a temperature), and the number of steps taken."""
    pending = deque(sorted(plan, key=lambda a: a.step))
    ids: list[str] = []
    steps = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].step <= steps:
            a = pending.popleft()
            params = SamplingParams(
                max_new_tokens=a.max_new_tokens,
                ignore_eos=True,
                temperature=a.temperature,
                top_k=a.top_k,
                top_p=a.top_p,
                seed=a.step if a.temperature else None,
            )
            ids.append(engine.add_request(a.prompt, params, speculate=a.speculate))
        engine.step()
        steps += 1
    engine.flush_draft()
    alloc = engine.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages, "KV pages leaked"
    return [engine.pop_finished(i).token_ids for i in ids], steps


@dataclass
class Seen:
    """One graph step: its bucket, real batch size and tree sizes."""

    bucket: Bucket
    batch_size: int
    tree_sizes: list[int]
    ahead: bool = False  # decoding ahead: its tokens came from the last step on the device


@dataclass
class Shadow:
    """Wraps ``engine.runner``: every step that runs in a bucket runs again through the eager
    path on the KV as it was before, and both must agree within ``atol``; the bucket's KV writes
    are kept (steps decoding ahead too: their eager twin takes the same device ids). With
    ``twin`` (a capture-free runner over the same model and KV), a graph replay must also match
    the same step run eagerly on static buffers. Prompt chunks run by the prefill graphs
    (``tandem.target.prefill_graphs``) are checked against their eager step the same way and listed
    in ``prefills`` as (width, chunk length, ends the prompt)."""

    engine: Engine
    atol: float
    twin: TargetGraphRunner | None = None
    seen: list[Seen] = field(default_factory=list)
    missed: int = 0  # steps of trees only (no prompt chunk) that ran eagerly all the same
    prefills: list[tuple[int, int, bool]] = field(default_factory=list)
    _batch: ScheduledBatch | None = None

    def __post_init__(self) -> None:
        runner = self.engine.runner
        prepare, prepare_ahead, forward = runner.prepare, runner.prepare_ahead, runner.forward

        def shadow_prepare(batch: ScheduledBatch) -> ModelInputs:
            self._batch = batch
            return prepare(batch)

        def shadow_prepare_ahead(batch: ScheduledBatch, input_ids: torch.Tensor) -> ModelInputs:
            self._batch = batch
            return prepare_ahead(batch, input_ids)

        def eager_inputs(inputs: ModelInputs) -> ModelInputs:
            assert self._batch is not None and inputs.graph is not None
            if inputs.graph.device_ids is None:
                return runner._prepare_eager(self._batch, inputs.trees)
            graphs, runner.graphs = runner.graphs, None  # a step decoding ahead, run eagerly
            try:
                return prepare_ahead(self._batch, inputs.graph.device_ids)
            finally:
                runner.graphs = graphs

        def checked(
            inputs: ModelInputs, layers: Sequence[int], eager: Callable[[], ModelInputs]
        ) -> ModelOutputs:
            """Runs ``inputs`` (a graph step), then its eager twin on the KV as it was."""
            kv = self.engine.kv
            caches = [*kv.k_caches, *kv.v_caches]
            before = [c.clone() for c in caches]
            got = forward(inputs, layers)
            after = [c.clone() for c in caches]
            if self.twin is not None and inputs.graph is not None:
                _restore(caches, before)
                logits, features = self.twin.run(inputs.graph, layers)
                _close(got, ModelOutputs(logits=logits, features=features), caches, after, 1e-6)
            _restore(caches, before)
            _close(got, forward(eager(), layers), caches, after, self.atol)
            _restore(caches, after)
            null_page = range(kv.spec.page_size)  # padding rows never write
            assert all(c[null_page].eq(0).all() for c in caches), "a padding row wrote KV"
            return got

        def shadow_forward(inputs: ModelInputs, layers: Sequence[int] = ()) -> ModelOutputs:
            assert self._batch is not None
            batch = self._batch
            if inputs.prefill is not None:
                p = inputs.prefill
                self.prefills.append((p.width, p.num_tokens, p.last))
                return checked(inputs, layers, lambda: runner._prepare_eager(batch, inputs.trees))
            if inputs.graph is None:
                pairs = zip(inputs.trees, batch.num_new_tokens, strict=True)
                self.missed += all(t is not None and len(t) == n for t, n in pairs)
                return forward(inputs, layers)
            got = checked(inputs, layers, lambda: eager_inputs(inputs))
            sizes = [len(t) for t in inputs.trees if t is not None]
            ahead = inputs.graph.device_ids is not None
            self.seen.append(Seen(inputs.graph.bucket, len(sizes), sizes, ahead))
            return got

        runner.prepare = shadow_prepare  # type: ignore[method-assign]
        runner.prepare_ahead = shadow_prepare_ahead  # type: ignore[method-assign]
        runner.forward = shadow_forward  # type: ignore[method-assign]


def _restore(caches: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    for cache, value in zip(caches, saved, strict=True):
        cache.copy_(value)


def _close(
    got: ModelOutputs,
    want: ModelOutputs,
    caches: list[torch.Tensor],
    written: list[torch.Tensor],
    atol: float,
) -> None:
    """Outputs and KV writes agree: ``got``/``written`` from the bucket, the rest from the
    other run (whose KV writes are in ``caches`` now)."""
    torch.testing.assert_close(got.logits, want.logits, atol=atol, rtol=0)
    assert (got.features is None) == (want.features is None)
    if got.features is not None and want.features is not None:
        torch.testing.assert_close(got.features, want.features, atol=atol, rtol=0)
    for cache, bucket_cache in zip(caches, written, strict=True):
        torch.testing.assert_close(bucket_cache, cache, atol=atol, rtol=0)
