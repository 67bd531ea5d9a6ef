"""One benchmark run: every mode at every batch size, in an order that keeps one copy of the
target in device memory at a time (in process, then the services, then transformers)."""

from __future__ import annotations

import gc
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from tandem.bench import hf, inprocess, services
from tandem.bench.inprocess import Workload
from tandem.bench.probe import plan_probe, probe_window
from tandem.bench.report import Row
from tandem.bench.sol import copy_bandwidth, kv_bytes_per_token, t_verify_min, weight_bytes
from tandem.config import DTYPES, SPEC_POLICIES, torch_dtype
from tandem.models import load_model
from tandem.models.config import ModelConfig
from tandem.serving import rpc
from tandem.spec.types import SpecConfig

logger = logging.getLogger(__name__)

ALL_MODES = (
    "target-only",
    "target-sync",
    "spec",
    "spec-chain",
    "k0",
    "services",
    "services-plain",
    "services-chain",
    "services-grpc",
    "hf",
)
# Rows that verify drafts (what simulated acceptance forces).
SPECULATING = (
    "spec",
    "spec-chain",
    "services",
    "services-control",
    "services-chain",
    "services-chain-control",
    "services-grpc",
)
CHAINS_ONLY = "skipped: device-chain steps run chains only (K=1)"


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    target: Path
    draft: Path | None  # an EAGLE-3 head; None: no speculative modes
    assistant: Path | None  # a standalone LM for transformers' assisted generation
    modes: tuple[str, ...] = ALL_MODES
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64)
    workload: Workload
    prompts_from: str | None = None  # where workload.token_ids came from (the header says)
    spec_steps: int = 3  # S
    spec_topk: int = 1  # K: 1 is a chain
    spec_tokens: int | None = None  # N, node 0 included (None: S+1)
    simulate_accept_length: float | None = None  # perf only (tandem.spec.simulate)
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    two_lane_batch: int = 16
    spec_policy: str = "fixed"  # "spec" and "services" rows (EngineConfig.spec_policy)
    log_dir: Path | None = None  # the services' logs (default: a temporary directory)
    draft_device: str | None = None  # the draft service's device (default: ``device``)
    profile_idle: bool = False  # GPU idle of one profiled round per services row
    profile_start: int | None = None  # steps before the profiled window (None: prefill + 2)
    batch_invariant: bool = False  # every target through EngineConfig.batch_invariant (CUDA)

    def __post_init__(self) -> None:
        unknown = set(self.modes) - set(ALL_MODES)
        if unknown:
            raise ValueError(f"modes: {sorted(unknown)} not in {ALL_MODES}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch_sizes: give at least one, each >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.spec_policy not in SPEC_POLICIES:
            raise ValueError(f"spec_policy: {self.spec_policy!r} is not one of {SPEC_POLICIES}")
        if self.batch_invariant and not self.device.startswith("cuda"):
            raise ValueError(f"batch_invariant: needs a CUDA device, not {self.device!r}")
        w = self.workload
        if w.prompt_len < 1 or w.new_tokens < 2 or w.rounds < 1 or w.warmup_tokens < 0:
            raise ValueError("workload: prompt_len >= 1, new_tokens >= 2, rounds >= 1")
        if not w.temperature >= 0.0:
            raise ValueError(f"temperature: must be >= 0 (0: greedy), got {w.temperature}")
        _ = self.spec  # validates S, K and N (InvalidRequest is a ValueError)
        simulated = self.simulate_accept_length
        if simulated is not None and not 1.0 <= simulated <= self.spec_steps + 1:
            raise ValueError(
                f"simulate_accept_length: must be in [1, S+1] = [1, {self.spec_steps + 1}]"
            )

    @cached_property
    def spec(self) -> SpecConfig:
        return SpecConfig(
            num_steps=self.spec_steps, topk=self.spec_topk, num_draft_tokens=self.spec_tokens
        )

    @property
    def chain(self) -> bool:
        """Whether the drafts are chains (K=1): device-chain steps run nothing else."""
        return self.spec.topk == 1

    @cached_property
    def num_pages(self) -> int:
        return inprocess.pages_needed(
            max(self.batch_sizes), self.workload, self.spec.tree_size, self.page_size
        )


def run_bench(
    config: BenchConfig, say: Callable[[str], None] = logger.info
) -> tuple[dict[str, Any], list[Row]]:
    """Runs the configured modes; returns the settings block and the rows."""
    rpc.log_gc_pauses(logger, min_ms=10.0)  # a slow step may be a collection: say so
    rpc.freeze_heap()  # the imports: a full collection would walk them in every row
    model_config = ModelConfig.from_pretrained(config.target)
    dtype = torch_dtype(config.dtype)
    bandwidth = copy_bandwidth(config.device)
    w = config.workload
    header: dict[str, Any] = {
        "Device": _device_name(config.device),
        "Target": str(config.target),
        "Draft (EAGLE-3)": str(config.draft) if config.draft else "-",
        "Dtype": config.dtype,
        "Speculation S / K / N": _shape(config.spec),
        "Prompts": _prompts(config),
        "Prompt / new tokens": f"{w.prompt_len} / {w.new_tokens}",
        "Rounds per batch size": w.rounds,
        "Temperature": f"{w.temperature:g} (sampled, seeded per request)"
        if w.temperature
        else "0 (greedy)",
        "Simulated accept length": _simulated(config.simulate_accept_length, config.chain),
        "Copy bandwidth (GB/s)": round(bandwidth / 1e9, 1),
        "Weights read per step (GB)": round(weight_bytes(model_config, dtype) / 1e9, 3),
        "KV per token (KiB)": round(kv_bytes_per_token(model_config, dtype) / 1024, 1),
        "Speculation policy": config.spec_policy,
        "Draft device (services)": config.draft_device or config.device,
        "GPU idle profile": _profiled(config),
        "Batch-invariant target kernels": "on" if config.batch_invariant else "off",
    }
    rows: list[Row] = []
    speculative = config.draft is not None
    if {"target-only", "target-sync"} & set(config.modes) or (
        {"spec", "spec-chain", "k0"} & set(config.modes) and speculative
    ):
        rows += _in_process(config, say)
    if {"services", "services-plain"} & set(config.modes) and speculative:
        rows += _services(config, model_config, say)
    if "services-chain" in config.modes and speculative:
        if not config.device.startswith("cuda"):
            note = "skipped: device-chain steps need CUDA graphs"
            rows.append(Row(mode="services-chain", batch_size=0, note=note))
        elif not config.chain:
            rows.append(Row(mode="services-chain", batch_size=0, note=CHAINS_ONLY))
        else:
            rows += _services(config, model_config, say, device_chain=True)
    if "services-grpc" in config.modes and speculative:
        rows += _services(config, model_config, say, local_stream=False)
    if "hf" in config.modes:
        rows += _transformers(config, say)
    if not speculative and {
        "spec",
        "services",
        "services-plain",
        "services-chain",
        "services-grpc",
    } & set(config.modes):
        rows.append(Row(mode="spec", batch_size=0, note="skipped: no draft (--draft)"))
    for row in rows:
        if config.simulate_accept_length is not None and row.mode in SPECULATING:
            row.simulated_accept_length = config.simulate_accept_length
        if row.batch_size:
            context = row.batch_size * (w.prompt_len + w.new_tokens // 2)
            row.finish(t_verify_min(model_config, dtype, context, bandwidth))
    return header, rows


def _done(row: Row) -> str:
    accept = f", accept length {row.accept_length:.2f}" if row.accept_length else ""
    return f"{row.mode} bs={row.batch_size}: {row.tokens_per_s or 0:.1f} tok/s{accept}"


def _shape(spec: SpecConfig) -> str:
    kind = "a chain" if spec.topk == 1 else "a tree"
    return f"S={spec.num_steps} K={spec.topk} N={spec.tree_size} ({kind})"


def _prompts(config: BenchConfig) -> str:
    w = config.workload
    if not w.token_ids:
        return f"synthetic ids, {w.prompt_len} tokens"
    lengths = sorted(len(p) for p in w.token_ids)
    return (
        f"{config.prompts_from or 'given'}: {len(lengths)}, {lengths[0]}-{lengths[-1]} tokens "
        f"(median {lengths[len(lengths) // 2]}), {'sampled' if w.temperature else 'greedy'}"
    )


def _simulated(value: float | None, chain: bool) -> str:
    if value is None:
        return "off (acceptance measured)"
    text = f"{value} (perf only: drafts forced, output not the target's"
    # A random draft's trees are wide and shallow: a drawn depth beyond a tree's is cut there.
    return text + (")" if chain else "; at most each tree's depth)")


def _profiled(config: BenchConfig) -> str:
    if not config.profile_idle:
        return "off"
    start, num, new_tokens = probe_window(
        config.workload, max(config.batch_sizes), config.spec_steps, config.profile_start
    )
    return (
        f"steps {start + 1}-{start + num} of one more round per services row "
        f"({new_tokens} new tokens)"
    )


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({torch.get_num_threads()} threads)"


def _free() -> None:
    """Collects what the last engine or model left, then hides the rest from the collector
    again (rpc.freeze_heap): a full collection over the imports alone (hundreds of thousands
    of objects, torch and transformers) would stall a step in a row."""
    gc.unfreeze()  # what freeze_heap hid is collectable again
    rpc.freeze_heap()  # a full collection, then the survivors hidden
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _in_process(config: BenchConfig, say: Callable[[str], None]) -> list[Row]:
    say(f"loading {config.target} in process")
    model = load_model(config.target, dtype=torch_dtype(config.dtype), device=config.device)
    rows = []
    # mode, spec, policy, overlap, device chain (None: the engine's default, on where it runs)
    plans: list[tuple[str, SpecConfig | None, str, bool, bool | None]] = []
    if "target-only" in config.modes:
        plans.append(("target-only", None, "fixed", True, None))
    if "target-sync" in config.modes:  # every step read before the next launch
        plans.append(("target-sync", None, "fixed", False, None))
    if "spec" in config.modes and config.draft is not None:
        plans.append(("spec", config.spec, config.spec_policy, True, None))
    if "spec-chain" in config.modes and config.draft is not None:
        plans.append(("spec-chain", config.spec, config.spec_policy, True, True))
    if "k0" in config.modes and config.draft is not None:
        plans.append(("k0", config.spec, "k0", True, None))  # the draft attached, K=0 always
    for mode, spec, policy, overlap, device_chain in plans:
        if device_chain and not config.device.startswith("cuda"):
            rows.append(Row(mode=mode, batch_size=0, note="skipped: needs CUDA graphs"))
            continue
        if device_chain and not config.chain:
            rows.append(Row(mode=mode, batch_size=0, note=CHAINS_ONLY))
            continue
        engine = inprocess.build_engine(
            config.target,
            config.draft,
            spec=spec,
            device=config.device,
            dtype=config.dtype,
            page_size=config.page_size,
            num_pages=config.num_pages,
            max_batch=max(config.batch_sizes),
            simulate_accept_length=config.simulate_accept_length,
            model=model,
            spec_policy=policy,
            overlap=overlap,
            device_chain=device_chain,
            batch_invariant=config.batch_invariant,
        )
        rpc.freeze_heap()  # as the services do once loaded: no full collection walks it
        for bs in config.batch_sizes:
            say(f"{mode} bs={bs}")
            steps_file = None
            if config.log_dir is not None:  # every measured step, as services-control writes
                config.log_dir.mkdir(parents=True, exist_ok=True)
                steps_file = config.log_dir / f"{mode}-bs{bs}.jsonl"
            rows.append(
                inprocess.run(engine, mode, bs, config.workload, config.spec_steps, steps_file)
            )
            say(_done(rows[-1]))
        del engine
        _free()
    del model
    _free()
    return rows


def _services(
    config: BenchConfig,
    mc: ModelConfig,
    say: Callable[[str], None],
    *,
    local_stream: bool = True,
    device_chain: bool = False,
) -> list[Row]:
    """Rows through a started stack: ``services`` and ``services-control`` with the draft's
    local stream (``tandem.link.local``), ``services-chain`` and ``services-chain-control``
    with device-chain steps over it (the target's ``--device-chain``), or ``services-grpc``
    (gateway only) without it. ``services-plain``, on the local stream's stack before each
    batch size's ``services`` rows: the same gateway rounds with speculation turned off per
    request (``SpeculationParams.enabled``), the baseline that pays what the services pay."""
    assert config.draft is not None
    mode = "services" if local_stream else "services-grpc"
    mode = "services-chain" if device_chain else mode
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = config.log_dir or Path(tmp)
        if not local_stream:
            log_dir = log_dir / "grpc"
        if device_chain:
            log_dir = log_dir / "chain"
        say(f"starting draft, target and gateway services, {mode} (logs: {log_dir})")
        probe = None
        if config.profile_idle:  # one directory per batch size and row under log_dir/profiles
            probe = plan_probe(
                log_dir / "profiles",
                config.workload,
                max(config.batch_sizes),
                config.spec_steps,
                config.profile_start,
            )
        stack = services.start_stack(
            config.target,
            config.draft,
            spec=config.spec,
            device=config.device,
            dtype=config.dtype,
            page_size=config.page_size,
            num_pages=config.num_pages,
            max_batch=max(config.batch_sizes),
            # Device-chain runs need one lane (they overlap draft and target themselves).
            two_lane_batch=0 if device_chain else config.two_lane_batch,
            simulate_accept_length=config.simulate_accept_length,
            spec_policy=config.spec_policy,
            log_dir=log_dir,
            draft_device=config.draft_device,
            probe=probe,
            local_stream=local_stream,
            device_chain=device_chain,
            batch_invariant=config.batch_invariant,
        )
        rows = []
        try:
            gateway, target = services.port_of(stack, "gateway"), services.port_of(stack, "target")
            plain = "services-plain" in config.modes and mode == "services"
            speculating = "services" in config.modes or mode != "services"

            def through_gateway(row_mode: str, bs: int, *, speculate: bool) -> None:
                say(f"{row_mode} bs={bs}")
                rows.append(
                    services.through_gateway(
                        gateway,
                        mc.vocab_size,
                        bs,
                        config.workload,
                        probe if speculate else None,
                        positions=config.spec_steps,
                        log_dir=log_dir,
                        mode=row_mode,
                        speculate=speculate,
                    )
                )
                say(_done(rows[-1]))

            for bs in config.batch_sizes:
                if plain:
                    through_gateway("services-plain", bs, speculate=False)
                if not speculating:
                    continue
                through_gateway(mode, bs, speculate=True)
                if not local_stream:
                    continue
                rows.append(
                    services.through_control(
                        target,
                        mc.vocab_size,
                        bs,
                        config.workload,
                        config.spec_steps,
                        probe,
                        steps_file=log_dir / f"steps-bs{bs}.jsonl",
                        mode=f"{mode}-control",
                    )
                )
                say(_done(rows[-1]))
        finally:
            stack.stop()
    return rows


def _transformers(config: BenchConfig, say: Callable[[str], None]) -> list[Row]:
    say(f"loading {config.target} in transformers")
    model = hf.load(config.target, config.dtype, config.device)
    rows = []
    if config.workload.temperature:
        note = "skipped: transformers' rows are greedy (--temperature 0)"
        return [Row(mode=mode, batch_size=0, note=note) for mode in ("hf-generate", "hf-assisted")]
    for bs in config.batch_sizes:
        say(f"hf-generate bs={bs}")
        rows.append(hf.run(model, bs, config.workload))
        say(_done(rows[-1]))
    assistant = None
    if config.assistant is None:
        rows.append(
            Row(mode="hf-assisted", batch_size=1, note="skipped: no --assistant (a standalone LM)")
        )
    else:
        assistant = hf.load(config.assistant, config.dtype, config.device)
        say("hf-assisted bs=1")
        row = hf.run(
            model, 1, config.workload, assistant=assistant, num_assistant_tokens=config.spec_steps
        )
        notes = ["random draft: acceptance not simulated"] if config.simulate_accept_length else []
        if not config.chain:
            notes.append(f"chains of S={config.spec_steps}: transformers drafts no trees")
        row.note = "; ".join(notes)
        rows.append(row)
        say(_done(row))
        for bs in config.batch_sizes:
            if bs > 1:
                note = "skipped: transformers assists at bs=1 only"
                rows.append(Row(mode="hf-assisted", batch_size=bs, note=note))
    del model, assistant
    _free()
    return rows
