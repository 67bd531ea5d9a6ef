"""Speculation through the three services (``tandem.apps.launch.build_stack`` on loopback).

Two measurements per batch size, each its own row:

- ``services``: ``batch_size`` concurrent ``Generate`` streams through the gateway's public
  API (token-id prompts, no detokenisation): tokens/s, TPOT and TTFT from chunk arrival times,
  accept length from each completion's usage.
- ``services-control``: the same requests admitted on the target's Control stream, as the
  gateway does (``bench/cycle_overhead.py``), to read every step's ``StepStats``: the cycle
  split into draft / verify / wire+host and the acceptance per draft position. One lane.

The gateway rows get the same columns from the target's step log
(``tandem.serving.step_log``, ``TANDEM_TARGET_STEP_LOG``): the steps sent while a measured
round ran.

The target runs with its steps logged and its diagnostics on (``TANDEM_TARGET_DIAGNOSTICS``:
GC pauses, GIL stalls, admission bursts in its log; the forward timed by events, as in
process) and, with ``simulate_accept_length``, with ``TANDEM_SIMULATE_ACCEPT_LENGTH`` in its
environment.

With an :class:`IdleProbe` (``tandem bench --profile-idle``) the target's and the draft's
step-window profilers (``tandem.serving.profiling``) wait on an arm file; after a row's measured
rounds one more round runs with them armed, into a fresh directory per batch size and row,
and its GPU idle (``tandem.bench.idle``) joins the row. The measured rounds are never
profiled, so the other columns do not carry the profiler's cost.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import grpc
from google.protobuf import json_format

from tandem.apps.demo import free_port
from tandem.apps.launch import Stack, build_stack
from tandem.bench.inprocess import Workload, fill_latency
from tandem.bench.probe import IdleProbe
from tandem.bench.report import Row, median_ms
from tandem.serving import diagnostics, step_log
from tandem.serving.rpc import channel_options
from tandem.spec import simulate
from tandem.spec.types import SpecConfig
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc


def start_stack(
    target: Path,
    draft: Path,
    *,
    spec: SpecConfig,
    device: str,
    dtype: str,
    page_size: int,
    num_pages: int,
    max_batch: int,
    two_lane_batch: int,
    simulate_accept_length: float | None,
    log_dir: Path,
    spec_policy: str = "fixed",
    draft_device: str | None = None,
    probe: IdleProbe | None = None,
    local_stream: bool = True,
    device_chain: bool = False,
    batch_invariant: bool = False,
) -> Stack:
    stack = build_stack(
        target=target,
        draft=draft,
        draft_kind="eagle3",
        mtp_mode="chain",
        spec_args=[
            *("--spec-steps", str(spec.num_steps), "--spec-topk", str(spec.topk)),
            *("--spec-tokens", str(spec.tree_size)),
        ],
        page_size=page_size,
        device=device,
        dtype=dtype,
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        draft_deadline_s=30.0,  # measure the pipeline, never its fallback
        two_lane_batch=two_lane_batch,
        local_stream=local_stream,
        extra_target_args=[
            *("--num-pages", str(num_pages), "--max-num-seqs", str(max_batch)),
            *("--spec-policy", spec_policy),
            *(["--device-chain"] if device_chain else []),
            *(["--batch-invariant"] if batch_invariant else []),
        ],
    )
    for svc in stack.services:
        if svc.name != "draft":
            continue
        # The draft's pool holds the workload, as in process (inprocess.build_engine).
        svc.args += ["--num-pages", str(max(2048, num_pages))]
        if draft_device is not None:
            svc.args[svc.args.index("--device") + 1] = draft_device
    env = {} if probe is None else probe.env()
    env[step_log.TARGET_ENV] = str(target_steps(log_dir))
    env[step_log.DRAFT_ENV] = str(log_dir / "draft-steps.jsonl")
    env[diagnostics.TARGET_ENV] = "1"
    if simulate_accept_length is not None:
        env[simulate.ENV_VAR] = str(simulate_accept_length)
    with mock.patch.dict(os.environ, env):  # the services inherit it; this process does not
        stack.start(log_dir=log_dir)
    return stack


def target_steps(log_dir: Path) -> Path:
    """Where the benchmark's target logs its steps."""
    return log_dir / "target-steps.jsonl"


def port_of(stack: Stack, name: str) -> int:
    return next(s.port for s in stack.services if s.name == name)


def through_gateway(
    port: int,
    vocab: int,
    batch_size: int,
    w: Workload,
    probe: IdleProbe | None = None,
    *,
    positions: int = 0,
    log_dir: Path | None = None,
    mode: str = "services",
    speculate: bool = True,
) -> Row:
    """``batch_size`` Generate streams a round. With ``log_dir`` (the stack's), the target's
    steps during the measured rounds fill the cycle columns and ``steps-bsN-gateway.jsonl``
    (``-gateway-plain`` for rounds whose requests opt out of speculation: ``speculate``)."""
    windows: list[tuple[int, int]] = []  # each measured round's monotonic start and end

    async def main() -> Row:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        async with channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            if w.warmup_tokens:
                await _gateway_round(stub, w.batch(vocab, batch_size, 99), w, speculate=speculate)
            rounds = []
            for r in range(w.rounds):
                start = time.monotonic_ns()
                batch = w.batch(vocab, batch_size, r)
                rounds.append(await _gateway_round(stub, batch, w, True, speculate=speculate))
                windows.append((start, time.monotonic_ns()))
            if probe is not None:
                out_dir = probe.arm(f"bs{batch_size}-{mode}")
                batch = w.batch(vocab, batch_size, 98)
                profiled = replace(w, new_tokens=probe.new_tokens)
                await _gateway_round(stub, batch, profiled, True, speculate=speculate)
        row = Row(mode=mode, batch_size=batch_size, num_requests=batch_size * w.rounds)
        if probe is not None:
            probe.collect(out_dir, row)
        tpots, ttfts, accepted, verify_steps, drafted = [], [], 0, 0, 0
        for duration, records in rounds:
            row.duration_s += duration
            for ttft, tpot, tokens, usage in records:
                row.output_tokens += tokens
                ttfts.append(ttft)
                if tpot is not None:
                    tpots.append(tpot)
                accepted += usage.accepted_tokens
                verify_steps += usage.verify_steps
                drafted += usage.drafted_steps
                _add_causes(row, usage.steps_without_tree)
        row.tokens_per_s = row.output_tokens / row.duration_s
        row.accept_length = (accepted + verify_steps) / verify_steps if verify_steps else None
        row.tree_fraction = drafted / verify_steps if verify_steps else None
        fill_latency(row, tpots, ttfts)
        return row

    row = asyncio.run(main())
    if log_dir is not None:
        time.sleep(0.2)  # the target's writer thread is a step or so behind
        records = step_log.read_steps(target_steps(log_dir), windows)
        steps = [json_format.ParseDict(r, target_pb2.StepStats()) for r in records]
        _fill_steps(row, steps, positions)
        suffix = "gateway" if speculate else "gateway-plain"
        _write_steps(log_dir / f"steps-bs{batch_size}-{suffix}.jsonl", steps)
    return row


_Record = tuple[float, float | None, int, common_pb2.Usage]  # ttft ms, tpot ms, tokens, usage


async def _gateway_round(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    batch: list[list[int]],
    w: Workload,
    measured: bool = False,
    *,
    speculate: bool = True,
) -> tuple[float, list[_Record]]:
    new_tokens = w.new_tokens if measured else w.warmup_tokens
    start = time.perf_counter()

    async def one(ids: list[int]) -> _Record:
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(
                temperature=w.temperature, max_new_tokens=new_tokens, ignore_eos=True
            ),
            stream_options=gateway_pb2.StreamOptions(detokenize=False),
        )
        if not speculate:
            request.speculation.enabled = False
        first = last = 0.0
        tokens = 0
        usage = common_pb2.Usage()
        async for response in stub.Generate(request):
            which = response.WhichOneof("payload")
            if which == "chunk" and response.chunk.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += len(response.chunk.token_ids)
            elif which == "complete":
                usage = response.complete.usage
            elif which == "error":
                raise RuntimeError(f"gateway: {response.error.message}")
        tpot = (last - first) * 1e3 / (tokens - 1) if tokens > 1 else None
        return (first - start) * 1e3, tpot, tokens, usage

    records = await asyncio.gather(*(one(ids) for ids in batch))
    return time.perf_counter() - start, list(records)


def through_control(
    port: int,
    vocab: int,
    batch_size: int,
    w: Workload,
    positions: int,
    probe: IdleProbe | None = None,
    *,
    steps_file: Path | None = None,
    mode: str = "services-control",
) -> Row:
    """The requests admitted on the target's Control stream; per-step StepStats (with
    ``steps_file``, also written there, one JSON object per measured step)."""

    async def main() -> Row:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        async with channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            outbox: asyncio.Queue[target_pb2.ControlRequest] = asyncio.Queue()

            async def requests():  # type: ignore[no-untyped-def]
                while True:
                    yield await outbox.get()

            call = stub.Control(requests())
            row = Row(mode=mode, batch_size=batch_size)
            log = _ControlLog()
            if w.warmup_tokens:
                await _control_round(call, outbox, batch_size, vocab, w, 99, None)
            for r in range(w.rounds):
                await _control_round(call, outbox, batch_size, vocab, w, r, (row, log))
            if probe is not None:
                out_dir = probe.arm(f"bs{batch_size}-{mode}")
                # An unmeasured round (as the warm-up is) of the probe's length.
                profiled = replace(w, warmup_tokens=probe.new_tokens)
                await _control_round(call, outbox, batch_size, vocab, profiled, 98, None)
            call.cancel()
        if probe is not None:
            probe.collect(out_dir, row)
        row.tokens_per_s = row.output_tokens / row.duration_s
        fill_latency(row, log.tpots, log.ttfts)
        _fill_steps(row, log.steps, positions)
        if log.steps:
            verify_steps = sum(s.batch_size for s in log.steps)
            row.accept_length = sum(s.num_committed_tokens for s in log.steps) / verify_steps
            row.tree_fraction = sum(s.num_speculating for s in log.steps) / verify_steps
            for step in log.steps:
                _add_causes(row, step.without_tree)
        if steps_file is not None:
            _write_steps(steps_file, log.steps)
        return row

    return asyncio.run(main())


class _ControlLog:
    """What the measured rounds saw beyond the row's totals."""

    def __init__(self) -> None:
        self.steps: list[target_pb2.StepStats] = []  # every step that verified something
        self.tpots: list[float] = []  # ms per request
        self.ttfts: list[float] = []  # ms per request


async def _control_round(
    call: grpc.aio.StreamStreamCall,
    outbox: asyncio.Queue[target_pb2.ControlRequest],
    batch_size: int,
    vocab: int,
    w: Workload,
    salt: int,
    measured: tuple[Row, _ControlLog] | None,
) -> None:
    """Admits a batch and reads steps until all of it finished; ``measured`` collects."""
    new_tokens = w.new_tokens if measured is not None else w.warmup_tokens
    start = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i, ids in enumerate(w.batch(vocab, batch_size, salt)):
        admit = target_pb2.AdmitCommand(
            request_id=f"bench-{salt}-{i}",
            prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(
                temperature=w.temperature, max_new_tokens=new_tokens, ignore_eos=True
            ),
        )
        admit.speculation.enabled = True
        await outbox.put(target_pb2.ControlRequest(admit=admit))
    finished = 0
    while finished < batch_size:
        response = await call.read()
        if response is grpc.aio.EOF:
            raise RuntimeError("the target ended the control stream")
        if response.WhichOneof("event") != "step":
            continue
        now = time.perf_counter()
        for commit in response.step.commits:
            if commit.finish_reason == common_pb2.FINISH_REASON_ERROR:
                raise RuntimeError(f"the target refused a request: {commit.error.message}")
            if commit.token_ids:
                first.setdefault(commit.request_id, now)
                last[commit.request_id] = now
                counts[commit.request_id] = counts.get(commit.request_id, 0) + len(commit.token_ids)
            finished += commit.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        if measured is not None and response.step.stats.batch_size:
            measured[1].steps.append(response.step.stats)
    if measured is None:
        return
    row, log = measured
    row.duration_s += time.perf_counter() - start
    row.num_requests += batch_size
    row.output_tokens += sum(counts.values())
    for rid, n in counts.items():
        log.ttfts.append((first[rid] - start) * 1e3)
        if n > 1:
            log.tpots.append((last[rid] - first[rid]) * 1e3 / (n - 1))


def _add_causes(row: Row, counts: common_pb2.StepsWithoutTree) -> None:
    """Adds a usage's or a step's decode steps without a tree, by cause, to the row's."""
    for f in common_pb2.StepsWithoutTree.DESCRIPTOR.fields:
        n = getattr(counts, f.name)
        if n:
            row.without_tree[f.name] = row.without_tree.get(f.name, 0) + n


def _fill_steps(row: Row, steps: list[target_pb2.StepStats], positions: int) -> None:
    """The cycle columns (medians) and the acceptance per draft position of ``steps``."""
    if not steps:
        return
    row.cycle_ms = median_ms([s.step_ns for s in steps])
    row.verify_ms = median_ms([s.verify_ns for s in steps])
    row.draft_ms = median_ms([s.draft_ns for s in steps])
    row.wire_host_ms = median_ms([s.wire_ns + s.host_ns for s in steps])
    drafts = sum(s.num_speculating for s in steps)
    per_pos = [0] * positions
    for s in steps:
        for d, n in enumerate(list(s.num_accepted_per_pos)[:positions]):
            per_pos[d] += n
    row.acceptance_per_position = [n / drafts for n in per_pos] if drafts else []


def _write_steps(path: Path, steps: list[target_pb2.StepStats]) -> None:
    lines = (json_format.MessageToJson(s, indent=None) for s in steps)
    path.write_text("".join(f"{line}\n" for line in lines))
