"""The ``tandem`` command: common jobs over the engine and the services.

``tandem generate``'s flags and JSON lines are a stable contract. The flags that set an engine,
a draft or speculation are generated from those configs' settings (``tandem.settings``), so they
read as the services' flags do; the rest are this command's own.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.apps.embedded import defaults as embedded_defaults
from tandem.bench.cli import bench
from tandem.config import DraftConfig, EngineConfig
from tandem.settings import (
    DRAFT_DEADLINE,
    FAILOVER_WAIT,
    LOG_LEVEL,
    SMG_PORT,
    TEMPERATURE_HELP,
    TWO_LANE_BATCH,
    Flags,
    Option,
    typer_options,
)
from tandem.spec.types import SpecConfig
from tandem.train.cli import train_draft

# The variables the tandem command reads (the services' are TANDEM_<SERVICE>_*).
TANDEM_ENV = {"model": "TANDEM_TARGET", "dtype": "TANDEM_DTYPE", "device": "TANDEM_DEVICE"}
EMBEDDED = {"model": "the embedded model"}


def engine_flags(*names: str, env: tuple[str, ...] = ("model", "dtype", "device")) -> Flags:
    """The engine's settings ``names``, ``--target`` defaulting to the embedded model."""
    own_env = {name: TANDEM_ENV[name] for name in env}
    return Flags(
        EngineConfig, names, title="Target", defaults={"model": None}, shown=EMBEDDED, env=own_env
    )


DRAFT = Flags(
    DraftConfig,
    ("path", "kind", "mtp_mode"),
    title="Draft",
    defaults={"kind": None},
    shown={"kind": "eagle3 with a --draft"},
)
SPEC = Flags(SpecConfig, ("num_steps", "topk", "num_draft_tokens"), title="Speculation")
MAX_NEW_TOKENS = "Generated tokens per prompt, at most."

app = typer.Typer(
    help="Tandem: speculative decoding with draft and target as cooperating services.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("train-draft")(train_draft)
app.command("bench")(bench)


@app.callback()
@typer_options(Option.of(LOG_LEVEL, "log_level", str, "WARNING", env="TANDEM_LOG_LEVEL"))
def main(**settings: Any) -> None:
    logging.basicConfig(
        level=settings["log_level"].upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def read_prompts(args: list[str]) -> list[str]:
    """Each argument is a prompt, or ``@FILE`` naming a JSON list of prompt strings."""
    prompts: list[str] = []
    for arg in args:
        if not arg.startswith("@"):
            prompts.append(arg)
            continue
        path = Path(arg[1:])
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise typer.BadParameter(f"{arg}: {exc}", param_hint="PROMPT") from exc
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise typer.BadParameter(f"{arg}: expected a JSON list of strings", param_hint="PROMPT")
        prompts.extend(data)
    if not prompts:
        raise typer.BadParameter("no prompts given", param_hint="PROMPT")
    return prompts


GENERATE_TARGET = engine_flags(
    *("model", "page_size", "dtype", "device", "max_num_seqs", "max_num_batched_tokens"),
    *("num_pages", "cuda_graphs", "spec_policy", "overlap", "device_chain", "batch_invariant"),
)
GENERATE_DRAFT = replace(DRAFT, env={"path": "TANDEM_DRAFT"})


@app.command()
@typer_options(GENERATE_TARGET, GENERATE_DRAFT, SPEC)
def generate(
    prompts: Annotated[
        list[str], typer.Argument(help="Prompt texts; @FILE reads a JSON list of prompts.")
    ],
    max_new_tokens: Annotated[int, typer.Option(help=MAX_NEW_TOKENS)] = 128,
    temperature: Annotated[float, typer.Option(help=TEMPERATURE_HELP)] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p * max prob.")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option(help="1 = off.")] = 1.0,
    presence_penalty: Annotated[
        float, typer.Option(help="Minus this on every token generated so far, in [-2, 2].")
    ] = 0.0,
    frequency_penalty: Annotated[
        float, typer.Option(help="Minus this per time a token was generated, in [-2, 2].")
    ] = 0.0,
    min_tokens: Annotated[
        int, typer.Option(help="No EOS or stop token before this many new tokens.")
    ] = 0,
    seed: Annotated[
        int | None, typer.Option(help="Seed of prompt 0's random stream; prompt i uses seed+i.")
    ] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past EOS.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object per prompt, one per line.")
    ] = False,
    server: Annotated[
        str | None,
        typer.Option(envvar="TANDEM_SERVER", help="HOST:PORT of a gateway: generate through it."),
    ] = None,
    max_in_flight: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="With --server: requests open at once [default: the gateway's --max-running].",
        ),
    ] = None,
    attempts: Annotated[
        int,
        typer.Option(
            min=1,
            help="With --server: tries per prompt while the gateway refuses it for load "
            "(RESOURCE_EXHAUSTED) or is unavailable, waiting as its RetryInfo asks.",
        ),
    ] = 8,
    progress: Annotated[
        bool | None,
        typer.Option(help="A progress bar on stderr [default: when stderr is a terminal]."),
    ] = None,
    **settings: Any,
) -> None:
    """Generate text for PROMPTs, in-process or through a running gateway (--server)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from tandem.draft.build import build_drafter
    from tandem.errors import CheckpointError, TandemError
    from tandem.models.tokenizer import load_tokenizer
    from tandem.sampling import SamplingParams
    from tandem.target.engine import Engine

    engine_settings = GENERATE_TARGET.pick(settings)
    drafting = GENERATE_DRAFT.pick(settings)
    texts = read_prompts(prompts)
    err = Console(stderr=True)
    if server is not None:
        from tandem.apps.remote import generate_through

        generate_through(
            server,
            texts,
            err,
            emit=lambda records: _print_records(records, as_json),
            progress=err.is_terminal if progress is None else progress,
            max_in_flight=max_in_flight,
            attempts=attempts,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            min_tokens=min_tokens,
            seed=seed,
            max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
        )
        return
    try:
        target, draft, draft_kind, embedded = embedded_defaults(
            engine_settings.pop("model"), drafting["path"], drafting["kind"]
        )
        if embedded:
            err.print(f"using the embedded reference model ({target.parent}, {draft_kind} draft)")
        if not (target / "config.json").is_file():
            raise CheckpointError(f"{target}: no config.json (not a Hugging Face checkpoint dir)")
        tokenizer = load_tokenizer(target)
        params = [
            SamplingParams(
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                min_tokens=min_tokens,
                seed=None if seed is None else seed + i,
                max_new_tokens=max_new_tokens,
                ignore_eos=ignore_eos,
            )
            for i in range(len(texts))
        ]
        config = EngineConfig(model=target, **engine_settings)
        drafter = spec = None
        if draft is not None or draft_kind is not None:
            spec = SpecConfig(**SPEC.pick(settings))
        with err.status(f"loading {target}"):
            from tandem.transfer import bind_thread

            bind_thread(config.device)  # this thread runs the models
            if spec is not None:
                draft_config = DraftConfig(
                    kind=draft_kind or "eagle3",
                    path=draft,
                    target=target,
                    mtp_mode=drafting["mtp_mode"],
                    dtype=config.dtype,
                    device=config.device,
                    page_size=config.page_size,
                )
                layers = _num_layers(target)
                drafter = build_drafter(draft_config, layers)
            engine = Engine(config, drafter=drafter, spec=spec)
        prompt_ids = [tokenizer(t)["input_ids"] for t in texts]
        total = sum(p.max_new_tokens for p in params)
        with Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            console=err,
            transient=True,
            disable=progress is False,
        ) as bar:
            task = bar.add_task("generate", total=total)
            results = engine.generate(prompt_ids, params, lambda n: bar.advance(task, n))
    except (TandemError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    records = []
    for text, result in zip(texts, results, strict=True):
        record: dict[str, Any] = {
            "prompt": text,
            "token_ids": result.token_ids,
            "text": tokenizer.decode(result.token_ids, skip_special_tokens=True),
            "finish_reason": result.finish_reason.value,
            "prompt_tokens": len(result.prompt_ids),
            "completion_tokens": len(result.token_ids),
            "accept_length": round(result.stats.accept_length, 4),
            "draft_tokens": result.stats.draft_tokens,
            "accepted_tokens": result.stats.accepted_tokens,
            "verify_steps": result.stats.verify_steps,
        }
        records.append(record)
    _print_records(records, as_json)


def _print_records(records: list[dict[str, Any]], as_json: bool) -> None:
    from rich.console import Console

    out, err = Console(soft_wrap=True), Console(stderr=True)
    for record in records:
        if as_json:
            sys.stdout.write(json.dumps(record) + "\n")
            continue
        out.print(record["prompt"], highlight=False, markup=False, style="bold")
        out.print(record["text"], highlight=False, markup=False)
        err.print(
            f"[dim]({record['completion_tokens']} tokens, {record['finish_reason']}, "
            f"accept length {record['accept_length']:.2f})"
        )
    sys.stdout.flush()


def _num_layers(target: Path) -> int:
    from tandem.models.config import ModelConfig

    return ModelConfig.from_pretrained(target).num_layers


@app.command()
@typer_options(
    engine_flags("model", "page_size", "device", "dtype"),
    DRAFT,
    SPEC,
    Option.of(DRAFT_DEADLINE, "draft_deadline_s", float, 1.0),
    Option.of(TWO_LANE_BATCH, "two_lane_batch", int, 16),
    Option.of(FAILOVER_WAIT, "failover_wait_s", float, 60.0),
    Option.of(SMG_PORT, "smg_port", int, None),
)
def serve(
    gateway_port: Annotated[int, typer.Option(help="Public gRPC port.")] = 50051,
    gateway_host: Annotated[
        str | None,
        typer.Option(
            help="Interface the gateway listens on (0.0.0.0: every one) "
            "[default: TANDEM_GATEWAY_HOST, else 127.0.0.1]."
        ),
    ] = None,
    target_port: Annotated[int, typer.Option(help="Target service port.")] = 50052,
    draft_port: Annotated[int, typer.Option(help="Draft service port.")] = 50053,
    log_dir: Annotated[
        Path | None,
        typer.Option(help="Each service's log goes here (default: a new temporary directory)."),
    ] = None,
    max_restarts: Annotated[
        int,
        typer.Option(
            envvar="TANDEM_MAX_RESTARTS",
            help="Restarts in a row of a service that keeps dying, before it is left down.",
        ),
    ] = 5,
    **settings: Any,
) -> None:
    """Start draft, target and gateway as three local processes and restart any that dies;
    Ctrl-C stops all three."""
    import signal as signals
    import tempfile
    import time

    from rich.console import Console

    from tandem.apps.launch import build_stack, resolve_gateway_host
    from tandem.apps.supervise import RestartPolicy, Supervisor
    from tandem.errors import CheckpointError

    drafting = DRAFT.pick(settings)
    smg_port = settings["smg_port"]
    try:
        target, draft, draft_kind, embedded = embedded_defaults(
            settings["target"], drafting["path"], drafting["kind"]
        )
        policy = RestartPolicy(max_restarts=max_restarts)
    except CheckpointError as exc:
        raise typer.BadParameter(str(exc), param_hint="--target") from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-restarts") from None
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if embedded:
        err.print(f"serving the embedded reference model ({target.parent})")
    stack = build_stack(
        target=target,
        draft=draft,
        draft_kind=draft_kind,
        mtp_mode=drafting["mtp_mode"],
        spec_args=SPEC.argv(SPEC.pick(settings)),
        page_size=settings["page_size"],
        device=settings["device"],
        dtype=settings["dtype"],
        gateway_port=gateway_port,
        target_port=target_port,
        draft_port=draft_port,
        draft_deadline_s=settings["draft_deadline"],
        two_lane_batch=settings["two_lane_batch"],
        gateway_env={"TANDEM_GATEWAY_FAILOVER_WAIT": str(settings["failover_wait"])},
        gateway_host=gateway_host,
        extra_gateway_args=() if smg_port is None else ("--smg-port", str(smg_port)),
    )
    if log_dir is None:  # a start-up error is then one line naming its log, not a traceback
        log_dir = Path(tempfile.mkdtemp(prefix="tandem-serve-"))
    err.print(f"logs in {log_dir}")
    stopping = False

    def stop(signum: int, _: object) -> None:
        nonlocal stopping
        stopping = True

    signals.signal(signals.SIGTERM, stop)
    signals.signal(signals.SIGINT, stop)
    try:
        with err.status("starting services"):
            stack.start(
                log_dir=log_dir,
                on_ready=lambda s: err.print(f"[green]ready[/green] {s.name} on port {s.port}"),
            )
        host = resolve_gateway_host(gateway_host)
        if smg_port is not None:
            err.print(f"SMG worker protocol on {host}:{smg_port}")
        err.print(f"[bold]serving[/bold] on {host}:{gateway_port} (Ctrl-C stops)")
        supervisor = Supervisor(
            stack, policy, log_dir=log_dir, report=lambda line: typer.echo(line, err=True)
        )
        while not stopping and supervisor.serving:
            supervisor.tick()
            time.sleep(0.2)
        if not stopping:
            raise typer.Exit(1)
    except (RuntimeError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)  # one line, however wide the terminal
        raise typer.Exit(1) from None
    finally:
        with err.status("stopping services"):
            stack.stop()


DEMO_SPEC = Flags(SpecConfig, ("num_steps",), title="Speculation")


@app.command()
@typer_options(
    engine_flags("model", "device", env=("model", "device")),
    replace(DRAFT, names=("path", "kind")),
    DEMO_SPEC,
)
def demo(
    prompt: Annotated[str, typer.Option(help="The prompt to stream a completion for.")] = "",
    max_new_tokens: Annotated[int, typer.Option(help=MAX_NEW_TOKENS)] = 64,
    work_dir: Annotated[Path, typer.Option(help="Demo checkpoints and service logs.")] = Path(
        "out/demo"
    ),
    **settings: Any,
) -> None:
    """Start the three services, stream one generation, print speculation statistics."""
    from tandem.apps.demo import run_demo

    run_demo(
        target=settings["target"],
        draft=settings["draft"],
        draft_kind=settings["draft_kind"],
        spec_args=DEMO_SPEC.argv(DEMO_SPEC.pick(settings)),
        prompt=prompt or "def fibonacci(n):",
        max_new_tokens=max_new_tokens,
        work_dir=work_dir,
        device=settings["device"],
    )
