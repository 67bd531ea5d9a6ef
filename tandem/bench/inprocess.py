"""Target-only decoding and speculation in one process: ``Engine.step()`` driven directly, each
step's ``StepResult`` (its timing and verifications) recorded.

``forward_ns`` of a step that reads its outcome is the forward's device time on CUDA, from two
timing events (``tandem.clock``), not a synchronisation after it: one would hold back the
verification's host work that runs beside the forward (a large share of a small batch's
speculative step). A step decoding ahead counts its launch and its wait for the step before.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.report import Row, median_ms, percentile
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.models import DecoderLM
from tandem.models.config import ModelConfig
from tandem.sampling import SamplingParams
from tandem.spec.base import Drafter
from tandem.spec.types import SpecConfig, SpecStats
from tandem.target.engine import Engine


@dataclass(frozen=True, kw_only=True)
class Workload:
    prompt_len: int  # tokens per prompt (synthetic ids)
    new_tokens: int  # generated per request (ignore_eos)
    warmup_tokens: int  # a warm-up round at each batch size first; 0 = none
    rounds: int  # measured rounds of batch_size concurrent requests
    # Real prompts (token ids, each at most prompt_len long); empty: synthetic ids.
    token_ids: tuple[tuple[int, ...], ...] = ()
    temperature: float = 0.0  # every request's; > 0: sampled, each request seeded by the engine

    def batch(self, vocab: int, batch_size: int, salt: int = 0) -> list[list[int]]:
        """A round's prompts: the real ones in turn from round ``salt``'s place (cycling
        through them), or synthetic ids (:func:`prompts`)."""
        if not self.token_ids:
            return prompts(vocab, batch_size, self.prompt_len, salt)
        n = len(self.token_ids)
        return [list(self.token_ids[(salt * batch_size + i) % n]) for i in range(batch_size)]


def prompts(vocab: int, batch_size: int, prompt_len: int, salt: int = 0) -> list[list[int]]:
    """Deterministic, distinct prompts of ids in [4, vocab) (specials below 4)."""
    span = vocab - 4
    return [
        [(7919 * (i + 1) + 31 * j + 1009 * salt) % span + 4 for j in range(prompt_len)]
        for i in range(batch_size)
    ]


def real_prompts(path: Path, tokenizer_dir: Path, prompt_len: int) -> tuple[tuple[int, ...], ...]:
    """The prompts of a JSONL file of ``{"text": ...}`` records (a family's
    ``prompts/heldout.jsonl``), tokenised with ``tokenizer_dir``'s tokenizer, each cut to its
    last ``prompt_len`` tokens (the end is what the continuation follows)."""
    from tandem.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"{path}: no prompts")
    return tuple(tuple(tokenizer(t)["input_ids"][-prompt_len:]) for t in texts)


def pages_needed(max_batch: int, w: Workload, tree_size: int, page_size: int) -> int:
    """KV pages for ``max_batch`` requests at full length, with a step's tree reserved."""
    longest = w.prompt_len + max(w.new_tokens, w.warmup_tokens) + tree_size + 1
    return max_batch * -(-longest // page_size) + max_batch + 8


def build_engine(
    target: Path,
    draft: Path | None,
    *,
    spec: SpecConfig | None,
    device: str,
    dtype: str,
    page_size: int,
    num_pages: int,
    max_batch: int,
    simulate_accept_length: float | None,
    model: DecoderLM | None = None,
    draft_kind: str = "eagle3",
    spec_policy: str = "fixed",
    overlap: bool = True,
    drafter: Drafter | None = None,
    device_chain: bool | None = None,
    batch_invariant: bool = False,
) -> Engine:
    """An engine over ``model`` (loaded from ``target`` when None), speculating with
    ``spec`` through ``drafter`` (default: the in-process drafter of ``draft``); ``overlap``
    decodes ahead (``tandem.target.ahead``), ``device_chain`` runs steady chain speculation as
    device-chain steps (``tandem/target/device_chain.py``; needs CUDA graphs; None: where
    they can run), ``batch_invariant``
    runs the target's batch-invariant kernels (EngineConfig.batch_invariant)."""
    config = EngineConfig(
        model=target,
        dtype=dtype,
        device=device,
        page_size=page_size,
        num_pages=num_pages,
        max_num_seqs=max_batch,
        simulate_accept_length=simulate_accept_length if spec is not None else None,
        spec_policy=spec_policy if spec is not None else "fixed",
        overlap=overlap,
        device_chain=device_chain,
        batch_invariant=batch_invariant,
    )
    if spec is not None and drafter is None:
        draft_config = DraftConfig(
            kind=draft_kind,
            path=draft,
            target=target,
            dtype=dtype,
            device=device,
            page_size=page_size,
            num_pages=max(2048, num_pages),
        )
        drafter = build_drafter(draft_config, ModelConfig.from_pretrained(target).num_layers)
    engine = Engine(config, model, drafter=drafter, spec=spec)
    return engine


@dataclass
class _Steps:
    total: list[int]
    forward: list[int]
    draft: list[int]
    log: list[dict[str, Any]] = field(default_factory=list)  # every step (steps_file)


def run(
    engine: Engine,
    mode: str,
    batch_size: int,
    w: Workload,
    num_positions: int,
    steps_file: Path | None = None,
) -> Row:
    """Warm-up, then ``w.rounds`` rounds of ``batch_size`` concurrent requests; with
    ``steps_file``, every measured step as one JSON line (mode, requests, tokens, times)."""
    vocab = engine.model.config.vocab_size
    if w.warmup_tokens:
        _round(engine, w.batch(vocab, batch_size, salt=99), w.warmup_tokens, w.temperature)
    steps = _Steps([], [], [])
    stats: list[SpecStats] = []
    tpots: list[float] = []
    ttfts: list[float] = []
    duration, tokens = 0.0, 0
    for r in range(w.rounds):
        out = _round(engine, w.batch(vocab, batch_size, salt=r), w.new_tokens, w.temperature, steps)
        duration += out.duration
        tokens += out.tokens
        stats += out.stats
        tpots += out.tpots
        ttfts += out.ttfts
    row = Row(
        mode=mode,
        batch_size=batch_size,
        num_requests=batch_size * w.rounds,
        output_tokens=tokens,
        duration_s=duration,
        tokens_per_s=tokens / duration,
        cycle_ms=median_ms(steps.total),
        verify_ms=median_ms(steps.forward),
        wire_host_ms=median_ms(
            [t - f - d for t, f, d in zip(steps.total, steps.forward, steps.draft, strict=True)]
        ),
    )
    fill_latency(row, tpots, ttfts)
    if steps_file is not None:
        steps_file.write_text("".join(json.dumps(step) + "\n" for step in steps.log))
    if engine.spec is not None:
        row.draft_ms = median_ms(steps.draft)
        fill_acceptance(row, stats, num_positions)
    if engine.chain is not None:
        # Device-chain steps: no forward or draft is waited for alone (a step's time is the
        # read's wait for a verdict launched a step ahead), and the host is not in the cycle.
        row.verify_ms = row.draft_ms = row.wire_host_ms = None
    return row


def fill_latency(row: Row, tpots: list[float], ttfts: list[float]) -> None:
    if tpots:
        row.tpot_p50_ms, row.tpot_p99_ms = percentile(tpots, 50), percentile(tpots, 99)
    if ttfts:
        row.ttft_p50_ms = percentile(ttfts, 50)


def fill_acceptance(row: Row, stats: list[SpecStats], num_positions: int) -> None:
    verify_steps = sum(s.verify_steps for s in stats)
    drafts = sum(s.drafts for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    row.accept_length = (accepted + verify_steps) / verify_steps if verify_steps else None
    per_pos = [0] * num_positions
    for s in stats:
        for d, n in enumerate(s.accepted_per_position[:num_positions]):
            per_pos[d] += n
    row.acceptance_per_position = [n / drafts for n in per_pos] if drafts else []
    row.tree_fraction = drafts / verify_steps if verify_steps else None
    causes: dict[str, int] = {}
    for s in stats:
        for cause, n in s.without_tree.items():
            causes[cause.value] = causes.get(cause.value, 0) + n
    row.without_tree = {k: n for k, n in sorted(causes.items()) if n}


@dataclass
class _Round:
    duration: float
    tokens: int
    stats: list[SpecStats]
    tpots: list[float]  # ms per request
    ttfts: list[float]  # ms per request


def _round(
    engine: Engine,
    batch: list[list[int]],
    new_tokens: int,
    temperature: float,
    steps: _Steps | None = None,
) -> _Round:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=temperature)
    clock: Callable[[], float] = time.perf_counter
    start = clock()
    ids = [engine.add_request(p, params) for p in batch]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished():
        result = engine.step()
        now = clock()
        for o in result.outputs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
        t = result.timing
        if steps is not None:
            steps.log.append(
                {
                    "speculated": result.speculated,
                    "running": len(engine.scheduler.running),
                    "verified": result.stats.verify_steps,
                    "tokens": result.num_committed,
                    "total_ms": t.total_ns / 1e6,
                    "forward_ms": t.forward_ns / 1e6,
                    "draft_model_ms": t.draft_model_ns / 1e6,
                }
            )
        if steps is not None and result.stats.verify_steps:  # a decode step
            steps.total.append(t.total_ns)
            steps.forward.append(t.forward_ns)
            steps.draft.append(t.draft_model_ns)
    duration = clock() - start
    engine.flush_draft()
    results = [engine.pop_finished(i) for i in ids]
    tpots = [
        (last[r.request_id] - first[r.request_id]) * 1e3 / (len(r.token_ids) - 1)
        for r in results
        if len(r.token_ids) > 1
    ]
    return _Round(
        duration=duration,
        tokens=sum(len(r.token_ids) for r in results),
        stats=[r.stats for r in results],
        tpots=tpots,
        ttfts=[(first[i] - start) * 1e3 for i in ids if i in first],
    )
