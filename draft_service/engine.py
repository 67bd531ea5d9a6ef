"""The draft service's engine: owns the in-process drafter and runs every call into it on one
dedicated worker thread, so the servicer's event loop never does model work.

Several Speculate streams may share one drafter (a target that reconnects before its old
stream is noticed dead, say), so request ids are namespaced per stream inside the drafter
(``"<stream>/<request id>"``) and everything the engine reports is mapped back. All state
below is touched on the worker thread only; the servicer talks to it through coroutines that
await that thread.

The engine is also the one owner of a device-chain run while it lasts (``ChainRun``; the runs
themselves are ``chain.py``'s): the drafter's buckets hold the run's inputs, so a step of any
stream meanwhile disturbs it, and no second run may start.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from draft_service.worker import Worker
from tandem import transfer
from tandem.config import DraftConfig, torch_dtype
from tandem.draft.build import build_drafter, build_model_drafter
from tandem.draft.chain_draft import DraftChain
from tandem.draft.drafter import ModelDrafter
from tandem.graphs.base import Bucket
from tandem.models.config import ModelConfig
from tandem.serving import profiling
from tandem.spec.base import Drafter
from tandem.spec.types import DraftAdmit, SpecConfig, Tree, VerifyOutcome

logger = logging.getLogger(__name__)

R = TypeVar("R")
IDLE_TICK_S = 0.25  # profiling on: a worker with no step for this long looks at its window
_WARMUP_ID = "warmup"
_WARMUP_SPEC = SpecConfig(num_steps=2, topk=2)  # a small tree: exercises top-k and scratch KV


@dataclass(frozen=True, kw_only=True)
class DraftInfo:
    """What the loaded draft needs from the target (GetInfo)."""

    kind: str
    model_id: str  # draft checkpoint path; empty for ngram
    target_model_id: str
    vocab_size: int  # the draft's own vocabulary
    target_vocab_size: int
    target_layer_ids: tuple[int, ...]  # draft.proto convention: -1 = last hidden after norm
    hidden_size: int  # the target's; feature_size = len(target_layer_ids) * hidden_size
    hidden_dtype: torch.dtype
    max_model_len: int  # the target's positions: no prompt is longer

    @property
    def feature_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size


@dataclass(frozen=True, kw_only=True)
class KvUsage:
    pages_used: int
    pages_total: int
    page_size: int


@dataclass(frozen=True, kw_only=True)
class StepResult:
    trees: dict[str, Tree]  # request id (the stream's) -> next tree
    dropped: list[str]  # the stream's requests whose draft state was lost
    kv_usage: KvUsage
    draft_ns: int  # time inside Drafter.step (extend + draft: one call)
    model_ns: int  # of which in the draft model (forwards, logits, top-k)


@dataclass
class ChainRun:
    """A stream's device-chain run while it lasts (``DraftEngine.chain_run``)."""

    stream: int
    run_id: int
    half: DraftChain
    request_ids: list[str]  # as the stream names them
    bucket: Bucket
    step: int = 0
    disturbed: str = ""  # why the run's next step fails ('' while it may go on)


class DraftEngine:
    """Loads the drafter and serialises every call into it on one worker thread."""

    def __init__(self, config: DraftConfig) -> None:
        self.config = config
        self.dtype = torch_dtype(config.dtype)
        # The one thread every drafter call runs on; it also serves local streams' sockets
        # (``draft_service.local``), whose steps run there through ``step_here``.
        self.worker = Worker("draft-engine", transfer.bind_thread, (config.device,))
        self._executor = self.worker
        self._drafter: Drafter | None = None
        # The drafter when its kind runs a model (all but ngram): its vocabulary, KV pool and
        # device-chain halves.
        self._model: ModelDrafter | None = None
        self.info: DraftInfo | None = None  # set once loaded and warmed up
        self._tracked: dict[int, set[str]] = {}  # stream -> its request ids in the drafter
        self._dropped: dict[int, list[str]] = {}  # stream -> dropped ids not yet reported
        self._closed = False
        self._last_kv = (0, 0)  # (pages used, total) after the last step, for gauges
        # The target drives the draft's steps: the draft's window follows the target's.
        self._profile = profiling.step_window("draft", config.device, follow=True)  # None: off
        self._stop_ticks = threading.Event()
        # The device-chain run while it lasts (module docstring; worker thread only).
        self.chain_run: ChainRun | None = None

    @property
    def model(self) -> ModelDrafter | None:
        """The loaded drafter when it runs a model (worker thread only)."""
        return self._model

    def other_streams_tracked(self, stream: int) -> bool:
        """Whether a stream other than ``stream`` holds requests (worker thread only)."""
        return any(ids for s, ids in self._tracked.items() if s != stream)

    def untrack(self, stream: int, request_ids: Sequence[str]) -> None:
        """Requests a device-chain run released itself (worker thread only)."""
        self._tracked.get(stream, set()).difference_update(request_ids)
        self._note_kv()

    def last_kv_usage(self) -> tuple[int, int]:
        """The pool after the last step; readable from any thread without waiting."""
        return self._last_kv

    @property
    def ready(self) -> bool:
        return self.info is not None

    async def _run(self, fn: Callable[..., R], *args: object) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def load(self) -> DraftInfo:
        """Builds the drafter and runs one warm-up step, on the worker thread."""
        return await self._run(self._load)

    async def step(
        self,
        stream: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> StepResult:
        """One `Drafter.step` for ``stream``'s requests (ids as the stream names them)."""
        return await self._run(self.step_here, stream, admits, outcomes, released)

    def release_stream(self, stream: int) -> None:
        """Frees every request of a finished stream. Queued, not awaited: it is called from
        a servicer's ``finally`` that may be running because its task was cancelled."""
        if self._closed:  # the server is stopping: the drafter goes away with it
            return
        self._executor.submit(self._release_stream, stream).add_done_callback(_log_failure)

    async def num_tracked(self) -> int:
        """Requests the drafter holds state for, all streams together (0 when idle)."""
        return await self._run(lambda: self._drafter.num_tracked() if self._drafter else 0)

    async def kv_usage(self) -> KvUsage:
        return await self._run(self._kv_usage)

    def close(self) -> None:
        """Waits for the running step, then stops the worker thread (profiling on: after what
        is queued, and a window still open is written)."""
        if self._closed:
            return
        self._closed = True
        self._stop_ticks.set()
        if self._profile is None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            return
        # The profiler runs on the worker thread, so the window is closed there; cancelling the
        # queue would cancel that too.
        self._executor.submit(self._profile.close)
        self._executor.shutdown(wait=True)

    def _tick(self) -> None:
        """Profiling on, on its own thread from the end of loading: every IDLE_TICK_S the
        worker looks at its window (queued behind any step). A target decoding with K=0 sends
        nothing, so a round may give the worker no step in which to notice an arm or to end
        a window (``StepWindow.wait``)."""
        assert self._profile is not None
        while not self._stop_ticks.wait(IDLE_TICK_S):
            try:
                self._executor.submit(self._profile.wait)
            except RuntimeError:  # shut down meanwhile
                return

    # -- on the worker thread --------------------------------------------------------------

    def _load(self) -> DraftInfo:
        started = time.perf_counter()
        target = ModelConfig.from_pretrained(self.config.target)
        layers = target.num_layers
        model = None if self.config.kind == "ngram" else build_model_drafter(self.config, layers)
        drafter = build_drafter(self.config, layers) if model is None else model
        if self.config.use_cuda_graphs or self.config.static_buckets:
            drafter.use_graphs(
                batch_sizes=self.config.cuda_graph_batch_sizes,
                max_model_len=target.max_position_embeddings,
                num_steps=self.config.cuda_graph_steps,
                capture=self.config.use_cuda_graphs,
            )
        info = DraftInfo(
            kind=self.config.kind,
            model_id="" if self.config.path is None else str(self.config.path),
            target_model_id=str(self.config.target),
            vocab_size=target.vocab_size if model is None else model.vocab_size(),
            target_vocab_size=target.vocab_size,
            target_layer_ids=tuple(
                -1 if i == target.num_layers else i for i in drafter.target_layer_ids
            ),
            hidden_size=target.hidden_size,
            hidden_dtype=self.dtype,
            max_model_len=target.max_position_embeddings,
        )
        self._drafter, self._model = drafter, model
        self._warm_up(info)
        logger.info(
            "draft %s loaded in %.2f s: layers %s, feature size %d",
            info.kind,
            time.perf_counter() - started,
            list(info.target_layer_ids),
            info.feature_size,
        )
        self.info = info
        if self._profile is not None:
            threading.Thread(target=self._tick, name="draft-profile-tick", daemon=True).start()
        return info

    def _warm_up(self, info: DraftInfo) -> None:
        """One admit + release through the real path (lazy inits, allocator, kernels)."""
        assert self._drafter is not None
        tokens = [i % info.target_vocab_size for i in range(8)]
        features = None
        if info.target_layer_ids:
            features = torch.zeros(len(tokens) - 1, info.feature_size, dtype=self.dtype)
        admit = DraftAdmit(
            request_id=_WARMUP_ID, token_ids=tokens, features=features, spec=_WARMUP_SPEC
        )
        self._drafter.step([admit], [], [])
        self._drafter.step([], [], [_WARMUP_ID])
        self._drafter.take_dropped()
        assert self._drafter.num_tracked() == 0, "warm-up left state behind"

    def step_here(
        self,
        stream: int,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> StepResult:
        """``step`` on the worker thread itself (``step`` runs it there; a local stream's
        callback already is there)."""
        assert threading.current_thread().name == "draft-engine", "step_here off the worker"
        assert self._drafter is not None, "step before load"
        if self.chain_run is not None:
            self.chain_run.disturbed = f"stream {stream} stepped the draft during the run"
        prefix = f"{stream}/"
        tracked = self._tracked.setdefault(stream, set())
        tracked.difference_update(released)
        tracked.update(a.request_id for a in admits)
        if self._profile is not None:
            self._profile.begin()
        started, model_before = time.perf_counter_ns(), self._drafter.model_ns
        trees = self._drafter.step(
            [
                replace(a, request_id=prefix + a.request_id, features=self._cast(a.features))
                for a in admits
            ],
            [
                replace(o, request_id=prefix + o.request_id, features=self._cast(o.features))
                for o in outcomes
            ],
            [prefix + r for r in released],
        )
        draft_ns = time.perf_counter_ns() - started
        self._route_dropped()
        dropped = self._dropped.pop(stream, [])
        tracked.difference_update(dropped)
        kv = self._note_kv()
        if self._profile is not None:
            self._profile.step()
        return StepResult(
            trees={k[len(prefix) :]: t for k, t in trees.items() if k.startswith(prefix)},
            dropped=dropped,
            kv_usage=kv,
            draft_ns=draft_ns,
            model_ns=self._drafter.model_ns - model_before,
        )

    def _cast(self, features: torch.Tensor | None) -> torch.Tensor | None:
        return None if features is None else features.to(self.dtype)

    def _route_dropped(self) -> None:
        assert self._drafter is not None
        for key in self._drafter.take_dropped():
            stream, sep, request_id = key.partition("/")
            if sep and stream.isdigit():
                self._dropped.setdefault(int(stream), []).append(request_id)

    def _release_stream(self, stream: int) -> None:
        ids = self._tracked.pop(stream, set())
        self._dropped.pop(stream, None)
        if ids and self._drafter is not None:
            self._drafter.step([], [], [f"{stream}/{r}" for r in ids])
            logger.info("stream %d closed: released %d requests", stream, len(ids))
        self._note_kv()

    def _note_kv(self) -> KvUsage:
        """The pool now, kept for ``last_kv_usage``."""
        kv = self._kv_usage()
        self._last_kv = (kv.pages_used, kv.pages_total)
        return kv

    def _kv_usage(self) -> KvUsage:
        used, total = (0, 0) if self._model is None else self._model.kv_pages()
        return KvUsage(pages_used=used, pages_total=total, page_size=self.config.page_size)


def _log_failure(future: Future[None]) -> None:
    exc = None if future.cancelled() else future.exception()
    if exc is not None:
        logger.error("draft engine task failed", exc_info=exc)
