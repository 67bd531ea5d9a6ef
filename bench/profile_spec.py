"""Where a speculative step's host time goes, in process.

Writes (or reuses) a preset's random checkpoints (target and EAGLE-3 head), builds the
benchmark's in-process ``Engine`` with simulated acceptance, runs a warm-up round, then one
measured round of ``--batch-size`` requests with every phase of the step timed on the host
(the draft's collect and submit, scheduling, input preparation, the forward's launch, the
verification's device work and host read, commit, postprocess) and a ``cProfile`` of the round.
``--policy adaptive`` also prints, per step, the mode the policy chose and the step's time, so
a round's losses can be placed (admissions, the draft's catch-up, exploration windows).
``--draft-service`` runs the draft as the draft service in its own process (loopback) behind a
``RemoteDrafter``, as the target service does, and splits each cycle's wait for the draft into
the client's hand-off and send, the wire, the draft service's own time and the answer's way back.

    python bench/profile_spec.py --preset llama-3.1-8b --device cuda --batch-size 32 [--top 30]
    python bench/profile_spec.py --batch-size 8 --draft-service --no-cprofile
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import pstats
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from profile_decode import PhaseTimer

from tandem.apps.demo import free_port
from tandem.apps.launch import Stack, build_stack
from tandem.bench import idle
from tandem.bench.inprocess import Workload, build_engine, pages_needed, prompts
from tandem.bench.models import write_preset
from tandem.bench.presets import PRESETS
from tandem.draft import drafter as drafter_module
from tandem.link.grpc_transport import GrpcTransport
from tandem.link.local import LocalLink
from tandem.link.remote import RemoteDrafter
from tandem.models.config import ModelConfig
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tandem.target import sync_mode


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/tandem-bench-models"))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=64)
    p.add_argument("--spec-steps", type=int, default=3)
    p.add_argument("--spec-topk", type=int, default=1, help="K (> 1: trees)")
    p.add_argument("--spec-tokens", type=int, default=None, help="N (default S+1)")
    p.add_argument("--simulate-accept-length", type=float, default=3.0)
    p.add_argument("--policy", default="fixed", choices=["fixed", "adaptive", "k0"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: the preset's")
    p.add_argument("--top", type=int, default=30, help="cProfile rows (by own time)")
    p.add_argument("--first-calls", type=int, default=8, help="per phase, calls shown one by one")
    p.add_argument("--no-cprofile", action="store_true", help="phase timers only")
    p.add_argument(
        "--draft-service",
        action="store_true",
        help="the draft as a service in its own process, reached through a RemoteDrafter",
    )
    p.add_argument(
        "--local-stream",
        action="store_true",
        help="with --draft-service: the Speculate stream on the draft's local socket "
        "(tandem.link.local)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="after the measured round, one more of --trace-tokens under torch.profiler: its "
        "chrome trace written here (gzipped) and its busiest host ops printed",
    )
    p.add_argument("--trace-tokens", type=int, default=24)
    args = p.parse_args(argv)

    preset = PRESETS[args.preset]
    dtype = args.dtype or preset.dtype
    root = args.models_dir / f"{preset.name}-{dtype}"
    paths = write_preset(preset, root, device=args.device, dtype=dtype)
    spec = SpecConfig(
        num_steps=args.spec_steps, topk=args.spec_topk, num_draft_tokens=args.spec_tokens
    )
    w = Workload(
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        warmup_tokens=args.warmup_tokens,
        rounds=1,
    )
    bs = args.batch_size
    stack, remote = None, None
    if args.draft_service:
        stack, remote = start_draft_service(paths.target, paths.draft, args, dtype, bs, w)
    try:
        engine = build_engine(
            paths.target,
            paths.draft,
            spec=spec,
            device=args.device,
            dtype=dtype,
            page_size=16,
            num_pages=pages_needed(bs, w, spec.tree_size, 16),
            max_batch=bs,
            simulate_accept_length=args.simulate_accept_length,
            spec_policy=args.policy,
            drafter=remote,
        )
        profile(engine, args, w, remote)
    finally:
        if remote is not None:
            remote.close()
        if stack is not None:
            stack.stop()


def start_draft_service(
    target: Path, draft: Path, args: argparse.Namespace, dtype: str, bs: int, w: Workload
) -> tuple[Stack, RemoteDrafter]:
    """The draft service alone, as ``tandem bench``'s services rows start it, and a client."""
    stack = build_stack(
        target=target,
        draft=draft,
        draft_kind="eagle3",
        mtp_mode="chain",
        spec_args=[],
        page_size=16,
        device=args.device,
        dtype=dtype,
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        local_stream=args.local_stream,
    )
    stack.services = [s for s in stack.services if s.name == "draft"]
    print("starting the draft service ...", flush=True)
    stack.start(log_dir=args.models_dir / "profile-spec-logs")
    layers = ModelConfig.from_pretrained(target).num_layers
    address = f"127.0.0.1:{stack.services[0].port}"
    remote = RemoteDrafter(address, num_target_layers=layers, deadline_s=30.0)
    if not remote.wait_ready(60):
        remote.close()
        stack.stop()
        raise RuntimeError(f"no draft stream to {address}")
    return stack, remote


class RemoteTimeline:
    """Times one RemoteDrafter's cycle: ``submit`` on the engine thread, the client loop's
    build and write, the answer's arrival (with the draft's own times in it), ``collect``."""

    def __init__(self, remote: RemoteDrafter) -> None:
        self.spans: dict[str, list[int]] = defaultdict(list)
        self._t: dict[str, int] = {}
        submit, collect = remote.submit, remote.collect
        # The gRPC stream: the loop's _send is the build + write, _on_response the arrival.
        send, on_response = GrpcTransport._send, GrpcTransport._on_response

        def timed_submit(*a: Any) -> None:
            self._t = {"submit": time.perf_counter_ns()}
            submit(*a)
            self._t["submitted"] = time.perf_counter_ns()

        async def timed_send(transport: GrpcTransport, *a: Any) -> Any:
            self._t["send"] = time.perf_counter_ns()
            out = await send(transport, *a)
            self._t["written"] = time.perf_counter_ns()
            return out

        def answered(response: Any) -> None:
            self._t["answer"] = time.perf_counter_ns()
            self._t["draft_total"] = response.total_ns
            self._t["draft_step"] = response.draft_ns
            self._t["draft_model"] = response.model_ns

        def timed_on_response(transport: GrpcTransport, response: Any) -> None:
            answered(response)
            on_response(transport, response)

        def timed_collect(lane: int) -> Any:
            self._t["collect"] = time.perf_counter_ns()
            out = collect(lane)
            self._record(time.perf_counter_ns())
            return out

        remote.submit = timed_submit  # type: ignore[method-assign]
        remote.collect = timed_collect  # type: ignore[method-assign]
        GrpcTransport._send = timed_send  # type: ignore[method-assign]
        GrpcTransport._on_response = timed_on_response  # type: ignore[method-assign]
        # The local stream: the link's send is the build + write, its _handle the arrival.
        link_send, link_handle = LocalLink.send, LocalLink._handle

        def timed_link_send(link: LocalLink, *a: Any) -> Any:
            self._t["send"] = time.perf_counter_ns()
            out = link_send(link, *a)
            self._t["written"] = time.perf_counter_ns()
            return out

        def timed_link_handle(link: LocalLink, response: Any) -> None:
            if not response.HasField("hello"):
                answered(response)
            link_handle(link, response)

        LocalLink.send = timed_link_send  # type: ignore[method-assign]
        LocalLink._handle = timed_link_handle  # type: ignore[method-assign]

    def _record(self, collected: int) -> None:
        t = self._t
        if not {"submit", "send", "written", "answer"} <= t.keys():
            return  # nothing went out, or no answer (K=0, late)
        for name, ns in (
            ("submit (engine thread)", t["submitted"] - t["submit"]),
            ("hand-off to the sender", t["send"] - t["submit"]),
            ("build + write the message", t["written"] - t["send"]),
            ("written -> answer, less the draft's", t["answer"] - t["written"] - t["draft_total"]),
            ("draft service, receipt to answer", t["draft_total"]),
            ("  of which Drafter.step", t["draft_step"]),
            ("    of which the draft model", t["draft_model"]),
            ("answer -> collect returns", collected - max(t["answer"], t["collect"])),
            ("engine between submit and collect", t["collect"] - t["submitted"]),
            ("submit -> collect returns", collected - t["submit"]),
        ):
            self.spans[name].append(ns)
        self._t = {}

    def print(self) -> None:
        print("draft service cycle, host ms (median, p90, cycles):")
        for name, ns in self.spans.items():
            ns = sorted(ns)
            p90 = ns[int(0.9 * (len(ns) - 1))]
            print(f"  {name:38s} {statistics.median(ns) / 1e6:8.3f} {p90 / 1e6:8.3f} {len(ns):6d}")


def profile(
    engine: Any, args: argparse.Namespace, w: Workload, remote: RemoteDrafter | None
) -> None:
    bs = args.batch_size
    vocab = engine.model.config.vocab_size

    def round_(salt: int, tokens: int) -> float:
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        ids = [engine.add_request(q, params) for q in prompts(vocab, bs, args.prompt_len, salt)]
        while engine.has_unfinished():
            step = engine.step()
            if log is not None:
                t = step.timing
                log.append(
                    (
                        step.speculated,
                        step.stats.verify_steps,
                        sum(1 for r in engine.scheduler.running),
                        t.total_ns / 1e6,
                        t.forward_ns / 1e6,
                        t.draft_model_ns / 1e6,
                    )
                )
        engine.flush_draft()
        for i in ids:
            engine.pop_finished(i)
        return time.perf_counter() - start

    log: list[tuple[bool, int, int, float, float, float]] | None = None
    round_(99, w.warmup_tokens)
    timer = PhaseTimer()
    ex = engine.exchange
    assert ex is not None
    graph_runner = getattr(engine.drafter, "graphs", None)
    drafter_phases: list[tuple[Any, str, str]] = [
        (engine.drafter, "step", "  drafter.step"),
        (engine.drafter, "_extend", "    drafter._extend"),
        (engine.drafter, "_draft", "    drafter._draft"),
        (drafter_module, "draft_eagerly", "      draft_eagerly (host loop)"),
    ]
    if graph_runner is not None:
        drafter_phases.append((graph_runner, "draft", "      graphs.draft (chain or tree loop)"))
    timeline = None if remote is None else RemoteTimeline(remote)
    for obj, attr, phase in (
        (ex, "collect_idle", "draft collect_idle"),
        (ex, "collect", "draft collect"),
        (ex, "submit", "draft submit"),
        *(drafter_phases if remote is None else []),
        (engine.scheduler, "schedule", "schedule"),
        (engine.runner, "prepare", "prepare"),
        (engine.runner, "forward", "forward (+sync)"),
        (sync_mode, "verify_rows", "verify (+read)"),
        (sync_mode, "commit", "commit"),
        (engine.scheduler, "postprocess", "postprocess"),
    ):
        timer.wrap(obj, attr, phase)
    graphs = getattr(engine.drafter, "graphs", None)
    extends: list[str] = []  # the first graph extends: updates, left eager, longest run
    if graphs is not None:
        extend = graphs.extend

        def logged(updates: Any, starts: Any) -> Any:
            rest = extend(updates, starts)
            if len(extends) < args.first_calls:
                longest = max((len(u[1]) for u in updates), default=0)
                zero = sum(1 for u in updates if starts[u[0]] == 0)
                extends.append(f"{len(updates)}/{len(rest)}/{longest}/{zero}")
            return rest

        graphs.extend = logged
    log = []
    prof = cProfile.Profile()
    if not args.no_cprofile:
        prof.enable()
    wall = round_(1, w.new_tokens)
    prof.disable()

    spec_steps = [row for row in log if row[0] and row[1]]
    print(
        f"device {torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}, "
        f"bs {bs}, policy {args.policy}, round {wall * 1e3:.1f} ms, {len(log)} steps, "
        f"{len(spec_steps)} speculative"
    )
    if spec_steps:
        for name, col in (("step", 3), ("forward", 4), ("draft model", 5)):
            ms = statistics.median(r[col] for r in spec_steps)
            print(f"median speculative {name:12s} {ms:8.3f} ms")
    print("host ms per call (median, calls, total ms; then the first calls):")
    for phase, ns in timer.ns.items():
        first = " ".join(f"{t / 1e6:.1f}" for t in ns[: args.first_calls])
        print(
            f"  {phase:24s} {statistics.median(ns) / 1e6:8.3f} {len(ns):6d} "
            f"{sum(ns) / 1e6:9.1f}   {first}"
        )
    if graphs is not None:
        print(f"first graph extends (updates/left eager/longest run/admits): {' '.join(extends)}")
        replays = dict(graphs.replays)
        print(f"draft graphs: replays {replays}, eager chain steps {graphs.eager_steps}")
    if timeline is not None:
        timeline.print()
    if args.policy != "fixed":
        print("steps: mode verify_steps running total_ms forward_ms draft_ms")
        for spec_mode, verified, running, total, fwd, draft in log:
            mode = "spec" if spec_mode else "k0  "
            print(f"  {mode} {verified:4d} {running:4d} {total:9.2f} {fwd:8.2f} {draft:8.2f}")
    if args.trace is not None:
        trace_round(args, lambda: round_(2, args.trace_tokens))
    if args.no_cprofile:
        return
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(r"tandem/|kernels/", args.top)
    print(out.getvalue())


def trace_round(args: argparse.Namespace, run: Any) -> None:
    """One round under ``torch.profiler``: the chrome trace, the host ops by own time, and the
    device's busy fraction over the round (kernels and copies merged)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        wall = run()
    args.trace.parent.mkdir(parents=True, exist_ok=True)
    raw = args.trace.with_suffix("")
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(args.trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    print(f"traced round: {wall * 1e3:.1f} ms, trace {args.trace}")
    for key in ("cpu_time_total", "self_cpu_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=args.top))
    spans = idle.union(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if spans:
        window = (spans[0][0], spans[-1][1])
        busy, length = idle.busy_ns(spans, window), window[1] - window[0]
        print(f"device busy {busy / 1e3:.1f} ms of {length / 1e3:.1f} ms ({busy / length:.1%})")


if __name__ == "__main__":
    main()
