"""``python -m target_service``: load the target, connect to the draft, serve the gateway.

Every flag has a ``TANDEM_TARGET_<FLAG>`` environment default (e.g. TANDEM_TARGET_PORT).
Health is NOT_SERVING until the model is loaded and a warm-up step ran; SIGTERM drains.
``--tls-cert``/``--tls-key`` (+ ``--tls-client-ca --require-client-cert`` for mutual TLS) secure
the port; ``--draft-tls-*`` the channel to the draft (``tandem.serving.security``).

``TANDEM_SIMULATE_ACCEPT_LENGTH=A`` (environment only, no flag; benchmarks only) forces a mean
accept length A whatever the drafts are (``tandem.spec.simulate``): the output is then NOT the
target's, so never set it on a server that answers users.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tandem import __version__, transfer
from tandem.config import PREFILL_GRAPH_TOKENS, SPEC_POLICIES, EngineConfig
from tandem.sampling import SamplingParams
from tandem.serving import diagnostics, rpc, security, step_log, telemetry
from tandem.serving.step_log import StepLog
from tandem.spec import simulate
from tandem.spec.base import Drafter, DraftState, DraftStatus
from tandem.spec.types import DRAFT_KINDS, SpecConfig
from tandem.target.engine import Engine
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.config import TargetServiceConfig
from target_service.engine import TargetLoop
from target_service.server import TargetServicer

T = TypeVar("T")

logger = logging.getLogger("target_service")

_KINDS = {
    "eagle3": common_pb2.DRAFT_KIND_EAGLE3,
    "eagle": common_pb2.DRAFT_KIND_EAGLE,
    "mtp": common_pb2.DRAFT_KIND_MTP,
    "model": common_pb2.DRAFT_KIND_MODEL,
    "ngram": common_pb2.DRAFT_KIND_NGRAM,
}


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``python -m target_service`` with its TANDEM_TARGET_* default."""
    env = rpc.env_default
    p = argparse.ArgumentParser(prog="python -m target_service", description=__doc__)
    p.add_argument("--target", type=Path, default=env("TANDEM_TARGET_TARGET", None))
    p.add_argument("--host", default=env("TANDEM_TARGET_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("TANDEM_TARGET_PORT", "0")))
    p.add_argument("--draft-addr", default=env("TANDEM_TARGET_DRAFT_ADDR", None))
    p.add_argument(
        "--draft-kind", choices=DRAFT_KINDS, default=env("TANDEM_TARGET_DRAFT_KIND", None)
    )
    p.add_argument("--spec-steps", type=int, default=int(env("TANDEM_TARGET_SPEC_STEPS", "3")))
    p.add_argument("--spec-topk", type=int, default=int(env("TANDEM_TARGET_SPEC_TOPK", "1")))
    p.add_argument("--spec-tokens", type=int, default=env("TANDEM_TARGET_SPEC_TOKENS", None))
    p.add_argument(
        "--draft-deadline", type=float, default=float(env("TANDEM_TARGET_DRAFT_DEADLINE", "0.5"))
    )
    p.add_argument(
        "--draft-local-stream",
        action=argparse.BooleanOptionalAction,
        default=env("TANDEM_TARGET_DRAFT_LOCAL_STREAM", True),
        help="when the draft reports a local socket this host can open, run the Speculate "
        "stream there instead of over gRPC (never with draft TLS; default: on)",
    )
    p.add_argument(
        "--admission-window",
        type=float,
        default=float(env("TANDEM_TARGET_ADMISSION_WINDOW", "0.05")),
        help="seconds an idle target waits at most after a first request for the rest of its "
        "burst, so they prefill together (stops sooner once none came for --admission-gap, or "
        "once the waiting requests fill a step; 0: off; default: 0.05)",
    )
    p.add_argument(
        "--admission-gap",
        type=float,
        default=float(env("TANDEM_TARGET_ADMISSION_GAP", "0.002")),
        help="seconds without a new request that end an idle target's wait for a burst "
        "(default: 0.002)",
    )
    p.add_argument("--page-size", type=int, default=int(env("TANDEM_TARGET_PAGE_SIZE", "16")))
    p.add_argument("--num-pages", type=int, default=env("TANDEM_TARGET_NUM_PAGES", None))
    p.add_argument("--max-num-seqs", type=int, default=int(env("TANDEM_TARGET_MAX_NUM_SEQS", "64")))
    p.add_argument("--device", default=env("TANDEM_TARGET_DEVICE", "cpu"))
    p.add_argument("--dtype", default=env("TANDEM_TARGET_DTYPE", "float32"))
    graphs = None  # unset: on for CUDA devices
    if env("TANDEM_TARGET_CUDA_GRAPHS", None) is not None:
        graphs = env("TANDEM_TARGET_CUDA_GRAPHS", True)
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=graphs,
        help="decode/verify steps through CUDA graphs (default: on for CUDA devices)",
    )
    p.add_argument(
        "--prefill-graph-tokens",
        type=_token_counts,
        # A string default: argparse parses it as it would the flag (errors name the flag).
        default=env("TANDEM_TARGET_PREFILL_GRAPH_TOKENS", ",".join(map(str, PREFILL_GRAPH_TOKENS))),
        help="with CUDA graphs, the token counts at which a prompt chunk alone in its step "
        "replays a CUDA graph, comma-separated, or 'off' (default: "
        f"{','.join(map(str, PREFILL_GRAPH_TOKENS))})",
    )
    p.add_argument(
        "--spec-policy",
        choices=SPEC_POLICIES,
        default=env("TANDEM_TARGET_SPEC_POLICY", "fixed"),
        help="fixed: speculate every step; adaptive: per batch size, speculate only while it "
        "commits more tokens per second than K=0 decoding (default: fixed)",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=env("TANDEM_TARGET_OVERLAP", True),
        help="plain greedy decode steps (no draft, or K=0) launch the next step before the "
        "last one is read (default: on)",
    )
    p.add_argument(
        "--device-chain",
        action=argparse.BooleanOptionalAction,
        default=env("TANDEM_TARGET_DEVICE_CHAIN", False),
        help="steady greedy chain speculation with a draft on this GPU, reached through its "
        "local socket, runs as device-chain steps: both halves queued on the GPU before the "
        "last step is read, handing off through CUDA IPC buffers (needs CUDA graphs; "
        "docs/device-cycle.md; default: off)",
    )
    p.add_argument(
        "--transposed-weights",
        action=argparse.BooleanOptionalAction,
        default=(  # unset: None, on for CUDA devices
            env("TANDEM_TARGET_TRANSPOSED_WEIGHTS", True)
            if "TANDEM_TARGET_TRANSPOSED_WEIGHTS" in os.environ
            else None
        ),
        help="store the target's projection weights transposed, the faster GEMM layout for "
        "decoding on Hopper (default: on for CUDA devices)",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=env("TANDEM_TARGET_BATCH_INVARIANT", False),
        help="batch-invariant kernels (CUDA): a token's logits do not depend on its batch, so "
        "greedy speculation equals target-only decoding in bf16 too; slower at large batches "
        "and in prefill (default: off)",
    )
    p.add_argument("--reflection", action="store_true")
    p.add_argument("--grace", type=float, default=float(env("TANDEM_TARGET_GRACE", "10")))
    p.add_argument("--log-level", default=env("TANDEM_LOG_LEVEL", "INFO"))
    telemetry.add_metrics_argument(p, env("TANDEM_TARGET_METRICS_PORT", None))
    security.add_server_tls_arguments(p, "TANDEM_TARGET_")
    security.add_client_tls_arguments(p, "draft", "TANDEM_TARGET_")
    return p


def _token_counts(raw: str) -> tuple[int, ...]:
    """``--prefill-graph-tokens``: comma-separated counts, or 'off' (EngineConfig checks that
    they increase from 1)."""
    if raw.strip().lower() in ("off", "none", ""):
        return ()
    try:
        return tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{raw!r}: expected counts like 16,32,64 or 'off'"
        ) from None


def parse_args(argv: list[str] | None = None) -> TargetServiceConfig:
    """Flags (and their environment defaults) -> a validated config; exits with usage on an
    invalid value, naming the field (unreadable or mismatched TLS files included)."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.target is None:
        p.error("--target (or TANDEM_TARGET_TARGET) is required")
    rpc.configure_logging(a.log_level)
    try:
        return _config(a)
    except ValueError as exc:
        p.error(str(exc))


def _config(a: argparse.Namespace) -> TargetServiceConfig:
    spec = None
    if a.draft_addr:
        tokens = None if a.spec_tokens is None else int(a.spec_tokens)
        spec = SpecConfig(num_steps=a.spec_steps, topk=a.spec_topk, num_draft_tokens=tokens)
    simulated = rpc.env_default(simulate.ENV_VAR, None)
    accept_length = None
    if simulated is not None:
        accept_length = simulate.parse_accept_length(
            simulated, None if spec is None else spec.num_steps
        )
        logger.warning(
            "%s=%s: simulated acceptance, for benchmarks only; output is NOT the target's",
            simulate.ENV_VAR,
            accept_length,
        )
    return TargetServiceConfig(
        engine=EngineConfig(
            model=Path(a.target),
            page_size=a.page_size,
            num_pages=None if a.num_pages is None else int(a.num_pages),
            max_num_seqs=a.max_num_seqs,
            device=a.device,
            dtype=a.dtype,
            cuda_graphs=a.cuda_graphs,
            prefill_graph_tokens=a.prefill_graph_tokens,
            simulate_accept_length=accept_length,
            spec_policy=a.spec_policy,
            overlap=a.overlap,
            device_chain=a.device_chain,
            transposed_weights=a.transposed_weights,
            batch_invariant=a.batch_invariant,
        ),
        host=a.host,
        port=a.port,
        draft_addr=a.draft_addr or None,
        draft_kind=a.draft_kind,
        spec=spec,
        draft_deadline_s=a.draft_deadline,
        draft_local_stream=a.draft_local_stream,
        admission_window_s=a.admission_window,
        admission_gap_s=a.admission_gap,
        reflection=a.reflection,
        grace_s=a.grace,
        tls=security.server_tls_from_args(a),
        draft_tls=security.client_tls_from_args(a, "draft"),
        metrics_port=a.metrics_port,
    )


async def main(config: TargetServiceConfig) -> None:
    observability = telemetry.setup("target_service", metrics_port=config.metrics_port)
    server = rpc.make_server(max_message_bytes=config.max_message_bytes)
    health = rpc.add_health(server)
    drafter = None
    if config.draft_addr is not None:
        from tandem.link.remote import RemoteDrafter
        from tandem.models.config import ModelConfig

        layers = ModelConfig.from_pretrained(config.model_dir).num_layers
        drafter = RemoteDrafter(
            config.draft_addr,
            num_target_layers=layers,
            deadline_s=config.draft_deadline_s,
            tls=config.draft_tls,
            local_stream=config.draft_local_stream,
            device=config.engine.device,
        )
    engine = await asyncio.to_thread(
        _on_device, config.engine.device, Engine, config.engine, drafter=drafter, spec=config.spec
    )
    loop = TargetLoop(
        engine,
        status=lambda: status(engine, drafter),
        status_interval_s=config.status_interval_s,
        admission_window_s=config.admission_window_s,
        admission_gap_s=config.admission_gap_s,
        step_log=StepLog.from_env(step_log.TARGET_ENV),
    )
    if os.environ.get(diagnostics.TARGET_ENV):
        _diagnose()
    info = get_info(engine, config)
    target_pb2_grpc.add_TargetServiceServicer_to_server(TargetServicer(loop, info), server)
    rpc.maybe_add_reflection(
        server,
        [target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name],
        config.reflection,
    )
    credentials = None if config.tls is None else security.server_credentials(config.tls)
    port = rpc.bind(server, rpc.format_address(config.host, config.port), credentials)
    await server.start()
    await asyncio.to_thread(_on_device, config.engine.device, warm_up, engine)
    rpc.freeze_heap()
    loop.start()
    await health.set("", rpc.SERVING)
    await health.set("tandem.v1.TargetService", rpc.SERVING)
    logger.info("target service ready on %s:%d", config.host, port)
    print(f"READY target {config.host}:{port}", flush=True)

    def shutdown() -> None:
        loop.stop()
        if drafter is not None:
            drafter.close()

    await rpc.serve(server, health, grace=config.grace_s, on_shutdown=shutdown)
    observability.shutdown()


WARM_UP_PARAMS = (  # a greedy and a sampled request: each path's kernels compile here
    SamplingParams(max_new_tokens=2, ignore_eos=True),
    SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=1.0, top_k=20, top_p=0.9, seed=0),
)


def _diagnose() -> None:
    """For benchmarks: log garbage collections and stretches without the GIL long enough to
    stall a step, and each admission burst an idle target gathered."""
    rpc.log_gc_pauses(logger)
    diagnostics.log_stalls(logger)
    logging.getLogger("target_service.engine").setLevel(logging.DEBUG)


def _on_device(device: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn`` on a worker thread bound to ``device`` (``transfer.bind_thread``)."""
    transfer.bind_thread(device)
    return fn(*args, **kwargs)


def warm_up(engine: Engine) -> None:
    """Tiny generations, greedy and sampled, so the first real request does not pay for lazy
    initialisation or a kernel compile (tests/spec/test_cuda_compiles.py); the speculation
    policy then starts measuring afresh (those steps compiled kernels)."""
    engine.generate([[0]] * len(WARM_UP_PARAMS), list(WARM_UP_PARAMS))
    if engine.policy is not None:
        engine.policy.reset()


def status(engine: Engine, drafter: Drafter | None) -> target_pb2.TargetStatus:
    alloc = engine.kv.allocator
    out = target_pb2.TargetStatus(
        num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting)
    )
    out.kv_usage.pages_total = alloc.num_pages
    out.kv_usage.pages_used = alloc.num_pages - alloc.num_free_pages
    out.kv_usage.page_size = alloc.page_size
    draft = DraftStatus(state=DraftState.DISABLED) if drafter is None else drafter.status()
    out.draft_state = int(draft.state)  # type: ignore[assignment]
    if draft.kv_pages_total:  # the draft's pool after its last answer
        out.draft_kv_usage.pages_total = draft.kv_pages_total
        out.draft_kv_usage.pages_used = draft.kv_pages_used
        out.draft_kv_usage.page_size = draft.kv_page_size
    return out


def get_info(
    engine: Engine, config: TargetServiceConfig
) -> target_pb2.TargetServiceGetInfoResponse:
    mc = engine.model.config
    info = target_pb2.TargetServiceGetInfoResponse(
        model_id=str(config.model_dir),
        vocab_size=mc.vocab_size,
        max_model_len=engine.max_model_len,
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        eos_token_ids=list(mc.eos_token_ids),
        max_batch_size=config.engine.max_num_seqs,
        version=__version__,
    )
    if config.draft_kind is not None:
        info.draft_kind = _KINDS[config.draft_kind]
    return info


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
