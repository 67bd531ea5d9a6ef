"""The ``tandem`` command: common jobs over the engine and (later) the services.

``tandem generate`` runs in-process for now; its flags and JSON lines are a stable contract.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.apps.embedded import defaults as embedded_defaults
from tandem.bench.cli import bench
from tandem.train.cli import train_draft

app = typer.Typer(
    help="Tandem: speculative decoding with draft and target as cooperating services.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("train-draft")(train_draft)
app.command("bench")(bench)


@app.callback()
def main(
    log_level: Annotated[
        str, typer.Option(envvar="TANDEM_LOG_LEVEL", help="Python logging level.")
    ] = "WARNING",
) -> None:
    logging.basicConfig(
        level=log_level.upper(),
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


@app.command()
def generate(
    prompts: Annotated[
        list[str], typer.Argument(help="Prompt texts; @FILE reads a JSON list of prompts.")
    ],
    target: Annotated[
        Path | None,
        typer.Option(
            envvar="TANDEM_TARGET",
            help="Target checkpoint directory (HF format); default: the embedded model.",
        ),
    ] = None,
    page_size: Annotated[int, typer.Option(help="Tokens per KV page.")] = 16,
    max_new_tokens: Annotated[
        int, typer.Option(help="Generated tokens per prompt, at most.")
    ] = 128,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p * max prob.")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option(help="1 = off.")] = 1.0,
    seed: Annotated[
        int | None, typer.Option(help="Seed of prompt 0's random stream; prompt i uses seed+i.")
    ] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past EOS.")] = False,
    dtype: Annotated[
        str, typer.Option(envvar="TANDEM_DTYPE", help="float32, bfloat16 or float16.")
    ] = "float32",
    device: Annotated[str, typer.Option(envvar="TANDEM_DEVICE", help="cpu or cuda[:N].")] = "cpu",
    max_num_seqs: Annotated[int, typer.Option(help="Requests batched at once.")] = 64,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Tokens per forward; longer prompts are prefilled in chunks.")
    ] = 2048,
    num_pages: Annotated[int | None, typer.Option(help="KV pool size in pages.")] = None,
    cuda_graphs: Annotated[
        bool | None,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help="Decode/verify and draft steps through CUDA graphs (default: on for CUDA).",
        ),
    ] = None,
    draft: Annotated[
        Path | None,
        typer.Option(envvar="TANDEM_DRAFT", help="Draft checkpoint directory (speculation on)."),
    ] = None,
    spec_policy: Annotated[
        str,
        typer.Option(
            help="fixed: speculate every step; adaptive: per batch size, only while it beats "
            "K=0 decoding."
        ),
    ] = "fixed",
    overlap: Annotated[
        bool,
        typer.Option(
            help="Plain greedy decode steps launch the next step before the last is read."
        ),
    ] = True,
    device_chain: Annotated[
        bool,
        typer.Option(
            help="Steady greedy chain speculation launches each step before the last is "
            "read, its inputs written on the GPU (needs CUDA graphs and a one-module draft)."
        ),
    ] = False,
    batch_invariant: Annotated[
        bool,
        typer.Option(
            help="Batch-invariant target kernels (CUDA): a token's logits do not depend on "
            "its batch, so greedy speculation equals target-only in bf16 too (slower at large "
            "batches and in prefill)."
        ),
    ] = False,
    draft_kind: Annotated[
        str | None,
        typer.Option(help="eagle3, eagle, mtp, model or ngram (ngram needs no --draft)."),
    ] = None,
    mtp_mode: Annotated[
        str, typer.Option(help="MTP heads fed the previous head's hidden (chain) or the target's.")
    ] = "chain",
    spec_steps: Annotated[int, typer.Option(help="S: draft steps per cycle.")] = 3,
    spec_topk: Annotated[int, typer.Option(help="K: candidates per draft step (1 = chain).")] = 1,
    spec_tokens: Annotated[
        int | None, typer.Option(help="N: tree nodes incl. the verified token (default S+1).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object per prompt, one per line.")
    ] = False,
    server: Annotated[
        str | None,
        typer.Option(envvar="TANDEM_SERVER", help="HOST:PORT of a gateway: generate through it."),
    ] = None,
) -> None:
    """Generate text for PROMPTs, in-process or through a running gateway (--server)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from tandem.config import EngineConfig
    from tandem.draft.build import DraftConfig, build_drafter
    from tandem.errors import CheckpointError, TandemError
    from tandem.models.tokenizer import load_tokenizer
    from tandem.sampling import SamplingParams
    from tandem.spec.types import SpecConfig
    from tandem.target.engine import Engine

    texts = read_prompts(prompts)
    if server is not None:
        from tandem.apps.client import generate_remote

        records = generate_remote(
            server,
            texts,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
        )
        _print_records(records, as_json)
        return
    err = Console(stderr=True)
    try:
        target, draft, draft_kind, embedded = embedded_defaults(target, draft, draft_kind)
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
                seed=None if seed is None else seed + i,
                max_new_tokens=max_new_tokens,
                ignore_eos=ignore_eos,
            )
            for i in range(len(texts))
        ]
        config = EngineConfig(
            model=target,
            dtype=dtype,
            device=device,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_pages=num_pages,
            cuda_graphs=cuda_graphs,
            spec_policy=spec_policy,
            overlap=overlap,
            device_chain=device_chain,
            batch_invariant=batch_invariant,
        )
        drafter = spec = None
        if draft is not None or draft_kind is not None:
            spec = SpecConfig(num_steps=spec_steps, topk=spec_topk, num_draft_tokens=spec_tokens)
        with err.status(f"loading {target}"):
            from tandem.transfer import bind_thread

            bind_thread(device)  # this thread runs the models
            if spec is not None:
                draft_config = DraftConfig(
                    kind=draft_kind or "eagle3",
                    path=draft,
                    target=target,
                    mtp_mode=mtp_mode,
                    dtype=dtype,
                    device=device,
                    page_size=page_size,
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
def serve(
    target: Annotated[
        Path | None,
        typer.Option(
            envvar="TANDEM_TARGET",
            help="Target checkpoint directory (HF format); default: the embedded model.",
        ),
    ] = None,
    draft: Annotated[Path | None, typer.Option(help="Draft checkpoint directory.")] = None,
    draft_kind: Annotated[
        str | None, typer.Option(help="eagle3, eagle, mtp, model or ngram.")
    ] = None,
    mtp_mode: Annotated[str, typer.Option(help="chain or target (mtp only).")] = "chain",
    spec_steps: Annotated[int, typer.Option(help="S: draft steps per cycle.")] = 3,
    spec_topk: Annotated[int, typer.Option(help="K: candidates per draft step.")] = 1,
    spec_tokens: Annotated[int | None, typer.Option(help="N: tree nodes (default S+1).")] = None,
    draft_deadline: Annotated[
        float, typer.Option(help="Seconds a step waits for its trees before decoding without.")
    ] = 1.0,
    two_lane_batch: Annotated[
        int,
        typer.Option(
            help="Running requests from which the gateway splits them into two lanes (the "
            "draft drafts one while the target verifies the other); 0 = always one lane."
        ),
    ] = 16,
    page_size: Annotated[int, typer.Option(help="Tokens per KV page.")] = 16,
    gateway_port: Annotated[int, typer.Option(help="Public gRPC port.")] = 50051,
    target_port: Annotated[int, typer.Option(help="Target service port.")] = 50052,
    draft_port: Annotated[int, typer.Option(help="Draft service port.")] = 50053,
    device: Annotated[str, typer.Option(envvar="TANDEM_DEVICE", help="cpu or cuda[:N].")] = "cpu",
    dtype: Annotated[str, typer.Option(envvar="TANDEM_DTYPE", help="Model dtype.")] = "float32",
    log_dir: Annotated[
        Path | None, typer.Option(help="Write each service's log here instead of the terminal.")
    ] = None,
) -> None:
    """Start draft, target and gateway as three local processes; Ctrl-C stops all three."""
    import signal as signals
    import time

    from rich.console import Console

    from tandem.apps.launch import build_stack
    from tandem.errors import CheckpointError

    try:
        target, draft, draft_kind, embedded = embedded_defaults(target, draft, draft_kind)
    except CheckpointError as exc:
        raise typer.BadParameter(str(exc), param_hint="--target") from None
    if embedded:
        Console(stderr=True).print(f"serving the embedded reference model ({target.parent})")
    spec_args = ["--spec-steps", str(spec_steps), "--spec-topk", str(spec_topk)]
    if spec_tokens is not None:
        spec_args += ["--spec-tokens", str(spec_tokens)]
    stack = build_stack(
        target=target,
        draft=draft,
        draft_kind=draft_kind,
        mtp_mode=mtp_mode,
        spec_args=spec_args,
        page_size=page_size,
        device=device,
        dtype=dtype,
        gateway_port=gateway_port,
        target_port=target_port,
        draft_port=draft_port,
        draft_deadline_s=draft_deadline,
        two_lane_batch=two_lane_batch,
    )
    err = Console(stderr=True)
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
        err.print(f"[bold]serving[/bold] on 127.0.0.1:{gateway_port} (Ctrl-C stops)")
        while not stopping:
            dead = stack.dead()
            if dead:
                names = ", ".join(f"{s.name} (exit {s.proc.returncode})" for s in dead if s.proc)
                err.print(f"[red]stopped:[/red] {names}")
                raise typer.Exit(1)
            time.sleep(0.2)
    except (RuntimeError, TimeoutError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    finally:
        with err.status("stopping services"):
            stack.stop()


@app.command()
def demo(
    target: Annotated[
        Path | None,
        typer.Option(
            envvar="TANDEM_TARGET", help="Target checkpoint (default: the embedded model)."
        ),
    ] = None,
    draft: Annotated[Path | None, typer.Option(help="Draft checkpoint directory.")] = None,
    draft_kind: Annotated[str | None, typer.Option(help="Draft kind (default eagle3).")] = None,
    spec_steps: Annotated[int, typer.Option(help="S: draft steps per cycle.")] = 3,
    prompt: Annotated[str, typer.Option(help="The prompt to stream a completion for.")] = "",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    device: Annotated[str, typer.Option(envvar="TANDEM_DEVICE", help="cpu or cuda[:N].")] = "cpu",
    work_dir: Annotated[Path, typer.Option(help="Demo checkpoints and service logs.")] = Path(
        "out/demo"
    ),
) -> None:
    """Start the three services, stream one generation, print speculation statistics."""
    from tandem.apps.demo import run_demo

    run_demo(
        target=target,
        draft=draft,
        draft_kind=draft_kind,
        spec_args=["--spec-steps", str(spec_steps)],
        prompt=prompt or "def fibonacci(n):",
        max_new_tokens=max_new_tokens,
        work_dir=work_dir,
        device=device,
    )
