"""``python -m target_service``: load the target, connect to the draft, serve the gateway.

Every flag has a ``TANDEM_TARGET_*`` environment default, named in its ``--help`` (flags win).
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
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from tandem import __version__, settings, transfer, wire
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.serving import diagnostics, rpc, security, step_log, telemetry
from tandem.serving.step_log import StepLog
from tandem.settings import Flags, SettingsParser
from tandem.spec import simulate
from tandem.spec.base import Drafter, DraftState, DraftStatus
from tandem.spec.types import SpecConfig, StepCounts
from tandem.target.engine import Engine
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service import draft_health
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
_POLICIES = {
    "fixed": common_pb2.SPEC_POLICY_FIXED,
    "adaptive": common_pb2.SPEC_POLICY_ADAPTIVE,
    "k0": common_pb2.SPEC_POLICY_K0,
}


ENV = "TANDEM_TARGET_"
ENGINE = Flags(
    EngineConfig,
    (
        *("model", "device", "dtype", "page_size", "num_pages", "max_num_seqs", "cuda_graphs"),
        *("prefill_graph_tokens", "spec_policy", "overlap", "device_chain"),
        *("transposed_weights", "batch_invariant"),
    ),
    env_prefix=ENV,
)
DRAFT = Flags(
    TargetServiceConfig,
    ("draft_addr", "draft_kind", "draft_deadline_s", "draft_local_stream"),
    env_prefix=ENV,
)
SPEC = Flags(SpecConfig, ("num_steps", "topk", "num_draft_tokens"), env_prefix=ENV)
SERVICE = Flags(
    TargetServiceConfig,
    (
        *("host", "port", "admission_window_s", "admission_gap_s", "reflection", "grace_s"),
        *("log_level", "metrics_port", "served_model_name", "vllm_metric_names"),
    ),
    env_prefix=ENV,
)


def build_parser() -> SettingsParser:
    """Every flag of ``python -m target_service`` with its TANDEM_TARGET_* default (a bad
    variable raises ValueError naming it)."""
    return settings.build_parser(
        "python -m target_service",
        __doc__,
        ENGINE,
        DRAFT,
        SPEC,
        SERVICE,
        security.server_tls_flags(ENV),
        security.client_tls_flags("draft", ENV),
    )


def parse_args(argv: list[str] | None = None) -> TargetServiceConfig:
    """Flags (and their environment defaults) -> a validated config; exits with usage on an
    invalid value, naming the field (unreadable or mismatched TLS files included)."""
    p = build_parser()
    a = p.parse(argv)
    try:
        rpc.configure_logging(a.log_level)  # first: building the config may warn
        return _config(a)
    except ValueError as exc:
        p.error(str(exc))


def _config(a: argparse.Namespace) -> TargetServiceConfig:
    values = vars(a)
    spec = SpecConfig(**SPEC.pick(values)) if a.draft_addr else None
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
        engine=EngineConfig(**ENGINE.pick(values), simulate_accept_length=accept_length),
        spec=spec,
        tls=security.server_tls_from_args(a),
        draft_tls=security.client_tls_from_args(a, "draft"),
        **{**DRAFT.pick(values), "draft_addr": a.draft_addr or None},
        **SERVICE.pick(values),
    )


async def main(config: TargetServiceConfig) -> None:
    observability = telemetry.setup(
        "target_service",
        metrics_port=config.metrics_port,
        metrics_host=config.host,
        vllm_names=config.vllm_metric_names,
    )
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
        model_name=config.model_name,
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
    if drafter is not None:  # the draft's state as a health entry of its own
        state = drafter.status
        mirror = draft_health.mirror(health, lambda: state().state, config.status_interval_s)
        mirroring = asyncio.create_task(mirror)
    logger.info("target service ready on %s:%d", config.host, port)
    print(f"READY target {config.host}:{port}", flush=True)

    def shutdown() -> None:
        if drafter is not None:
            mirroring.cancel()
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
    engine.step_counts = StepCounts()
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
    counts = engine.step_counts
    out.verify_steps = counts.verify_steps
    out.drafted_steps = counts.drafted_steps
    out.steps_without_tree.CopyFrom(wire.without_tree_to_proto(counts.without_tree))
    return out


def get_info(
    engine: Engine, config: TargetServiceConfig
) -> target_pb2.TargetServiceGetInfoResponse:
    mc = engine.model.config
    info = target_pb2.TargetServiceGetInfoResponse(
        model_id=config.model_name,
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
    info.speculation.enabled = config.spec is not None
    info.speculation.draft_kind = info.draft_kind
    if config.spec is not None:  # the configuration in use: what GetServerInfo reports
        info.speculation.num_steps = config.spec.num_steps
        info.speculation.topk = config.spec.topk
        info.speculation.num_draft_tokens = config.spec.tree_size
        info.spec_policy = _POLICIES[config.engine.spec_policy]
    return info


if __name__ == "__main__":
    try:
        _config_from_argv = parse_args()
    except ValueError as exc:  # a bad TANDEM_TARGET_* value
        sys.exit(f"error: {exc}")
    asyncio.run(main(_config_from_argv))
