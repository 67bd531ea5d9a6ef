"""``tandem bench``: the command line over ``tandem.bench.run`` (docs/performance.md).

With ``--preset`` it benchmarks random-weight checkpoints, written first (on ``--device``) under
``--models-dir`` and reused by later runs: ``tiny`` for a CPU smoke run, ``llama-3.1-8b``
(bf16, EAGLE-3 head with a 32000-token draft vocabulary) for a GPU. With neither ``--preset``
nor ``--target`` it benchmarks the embedded reference family (``tandem.apps.embedded``: its
target, EAGLE-3 head and standalone draft LM as the assistant) on its held-out prompts, so the
acceptance is real; ``--target`` with ``--prompts`` does the same for any checkpoint pair.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tandem.bench.presets import PRESETS
from tandem.config import DraftConfig, EngineConfig
from tandem.errors import CheckpointError
from tandem.settings import TEMPERATURE_HELP, TWO_LANE_BATCH, Flags, Option, typer_options
from tandem.spec.types import SpecConfig

if TYPE_CHECKING:
    from rich.console import Console

    from tandem.bench.models import PresetPaths


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        message = f"expected comma-separated integers, got {text!r}"
        raise typer.BadParameter(message, param_hint=name) from None


# The settings of every target and draft the benchmark runs (in process and as services).
TARGET = Flags(
    EngineConfig,
    (
        *("model", "device", "dtype", "page_size", "spec_policy", "batch_invariant"),
        "simulate_accept_length",
    ),
    title="Target",
    defaults={"model": None, "dtype": None},
    shown={"model": "a --preset's", "dtype": "the preset's"},
)
DRAFT = Flags(DraftConfig, ("path",), title="Draft")
SPEC = Flags(SpecConfig, ("num_steps", "topk", "num_draft_tokens"), title="Speculation")


@typer_options(TARGET, DRAFT, SPEC, Option.of(TWO_LANE_BATCH, "two_lane_batch", int, 16))
def bench(
    preset: Annotated[
        str | None,
        typer.Option(help=f"Random-weight checkpoints to write and use: {', '.join(PRESETS)}."),
    ] = None,
    assistant: Annotated[
        Path | None,
        typer.Option(help="Standalone LM with the target's tokenizer (transformers' assisted)."),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            help='JSONL of {"text": ...} prompts, tokenised with the target\'s tokenizer and '
            "cut to their last --prompt-len tokens (default: the reference family's held-out "
            "prompts when it is benchmarked, else synthetic ids of --prompt-len)."
        ),
    ] = None,
    models_dir: Annotated[
        Path, typer.Option(help="Where presets are written (reused when present).")
    ] = Path("out/bench/models"),
    modes: Annotated[
        str,
        typer.Option(
            help="Comma-separated: target-only, target-sync (target-only without decoding "
            "ahead), spec, spec-chain (spec with device-chain steps), k0, services, "
            "services-plain (through the services with speculation off per request), "
            "services-chain (the services with the target's --device-chain), services-grpc "
            "(the services with the Speculate stream on gRPC, not the draft's local socket), hf."
        ),
    ] = "target-only,spec,services,hf",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8,32,64",
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 128,
    new_tokens: Annotated[int, typer.Option(help="Generated tokens per request.")] = 128,
    warmup_tokens: Annotated[
        int, typer.Option(help="Tokens of a warm-up round before each measurement (0: none).")
    ] = 16,
    rounds: Annotated[int, typer.Option(help="Measured rounds per mode and batch size.")] = 1,
    temperature: Annotated[float, typer.Option(help=TEMPERATURE_HELP)] = 0.0,
    draft_device: Annotated[
        str | None,
        typer.Option(help="The draft service's device, e.g. cuda:1 (default: --device)."),
    ] = None,
    log_dir: Annotated[Path | None, typer.Option(help="Keep the services' logs here.")] = None,
    profile_idle: Annotated[
        bool,
        typer.Option(
            help="Profile one more round per services row (target + draft) and report each "
            "GPU's idle fraction; the profiles stay under --log-dir/profiles."
        ),
    ] = False,
    profile_start: Annotated[
        int | None,
        typer.Option(
            help="With --profile-idle: steps of the profiled round before its window (default: "
            "the prefill and two more; later to measure only steady decoding)."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (the table goes to stderr).")
    ] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write throughput.png and acceptance.png here.")
    ] = None,
    **settings: Any,
) -> None:
    """Latency and throughput: target-only, speculation in process and through the services,
    transformers' generate and assisted generation, with the speed-of-light ratio.

    The Target settings apply to every target (in process and the target service); --draft is
    an EAGLE-3 head for --target."""
    from rich.console import Console

    from tandem.apps.embedded import defaults, family_dir
    from tandem.bench import report
    from tandem.bench.inprocess import Workload, real_prompts
    from tandem.bench.run import BenchConfig, run_bench

    err = Console(stderr=True)
    engine = TARGET.pick(settings)
    target, draft, dtype, device = (
        engine["model"],
        settings["draft"],
        engine["dtype"],
        engine["device"],
    )
    if target is None and preset is None:  # the reference family, real acceptance
        try:
            target, draft, _, _ = defaults(None, draft, None)
        except CheckpointError as exc:
            raise typer.BadParameter(str(exc), param_hint="--target") from exc
        family = family_dir()
        if assistant is None and (family / "model" / "config.json").is_file():
            assistant = family / "model"
        if prompts is None:
            prompts = family / "prompts" / "heldout.jsonl"
    elif target is None:
        name = preset or "tiny"
        if name not in PRESETS:
            raise typer.BadParameter(
                f"{name!r} is not one of {sorted(PRESETS)}", param_hint="--preset"
            )
        paths = _write_preset(name, models_dir, device, dtype, err)
        target, draft, assistant = paths.target, paths.draft, paths.assistant
        dtype = dtype or PRESETS[name].dtype
    elif preset is not None:
        raise typer.BadParameter("give --preset or --target, not both", param_hint="--preset")
    try:
        token_ids = () if prompts is None else real_prompts(prompts, target, prompt_len)
        config = BenchConfig(
            target=target,
            draft=draft,
            assistant=assistant,
            modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
            batch_sizes=_ints(batch_sizes, "--batch-sizes"),
            workload=Workload(
                prompt_len=prompt_len,
                new_tokens=new_tokens,
                warmup_tokens=warmup_tokens,
                rounds=rounds,
                token_ids=token_ids,
                temperature=temperature,
            ),
            prompts_from=None if prompts is None else _shown(prompts),
            spec_steps=settings["spec_steps"],
            spec_topk=settings["spec_topk"],
            spec_tokens=settings["spec_tokens"],
            simulate_accept_length=engine["simulate_accept_length"],
            device=device,
            dtype=dtype or "float32",
            page_size=engine["page_size"],
            two_lane_batch=settings["two_lane_batch"],
            spec_policy=engine["spec_policy"],
            log_dir=log_dir,
            draft_device=draft_device,
            profile_idle=profile_idle,
            profile_start=profile_start,
            batch_invariant=engine["batch_invariant"],
        )
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if config.simulate_accept_length is not None:
        err.print(
            f"[yellow]simulated acceptance {config.simulate_accept_length}: perf only, "
            "the output is not the target's[/yellow]"
        )
    started = time.monotonic()

    def log(text: str) -> None:  # a log line per phase where a spinner cannot show
        err.print(f"[{time.monotonic() - started:7.1f} s] {text}", highlight=False)

    with err.status("benchmarking") as status:
        say = status.update if err.is_terminal else log
        header, rows = run_bench(config, say=say)
    if plot is not None:
        for path in report.plot(rows, plot):
            err.print(f"wrote {path}")
    text = report.table(rows, header) + "\n"
    if as_json:  # the JSON on stdout, the table on stderr: one run gives both
        sys.stderr.write(text)
        sys.stdout.write(json.dumps(report.to_json(rows, header)) + "\n")
    else:
        sys.stdout.write(text)
    sys.stdout.flush()


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it is under it (the header's width)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _write_preset(
    name: str, root: Path, device: str, dtype: str | None, err: Console
) -> PresetPaths:
    from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn

    from tandem.bench.models import write_preset

    with Progress(
        TextColumn("writing {task.description}"),
        BarColumn(),
        DownloadColumn(),
        console=err,
        transient=True,
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(part: str, done: int, total: int) -> None:
            if part not in tasks:
                tasks[part] = bar.add_task(f"{name}/{part}", total=total)
            bar.update(tasks[part], completed=done)

        started = time.monotonic()
        paths = write_preset(
            PRESETS[name],
            root / f"{name}-{dtype or PRESETS[name].dtype}",
            device=device,
            dtype=dtype,
            progress=progress,
        )
    if tasks:
        err.print(
            f"wrote preset {name} in {time.monotonic() - started:.1f} s to {paths.target.parent}"
        )
    return paths
