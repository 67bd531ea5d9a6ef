"""``tandem demo``: the whole stack on this machine, one streamed generation, its statistics.

Starts draft, target and gateway (``tandem serve``'s code) on free ports, streams one
generation through the public API to the terminal, prints accept length, draft and accepted
tokens and tokens/s, and stops the three services. Without ``--target`` it writes a small
random-weight Llama and a random EAGLE-3 head first: the pipeline is real, the text is noise
and acceptance is near 1 (the embedded trained model replaces them).
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console

from tandem.apps.embedded import defaults as embedded_defaults
from tandem.apps.embedded import family_dir
from tandem.apps.launch import build_stack
from tandem.serving.rpc import channel_options
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def random_models(root: Path) -> tuple[Path, Path]:
    from tandem.testing.random_drafts import make_eagle3_checkpoint
    from tandem.testing.random_model import make_checkpoint

    target, draft = root / "random-llama", root / "random-eagle3"
    if not (target / "config.json").is_file():
        make_checkpoint(target, "llama", num_hidden_layers=4)
    if not (draft / "config.json").is_file():
        make_eagle3_checkpoint(draft, target, draft_vocab_size=1024)
    return target, draft


async def stream(port: int, prompt: str, max_new_tokens: int, out: Console) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateRequest(
            text=prompt,
            sampling=common_pb2.SamplingParams(
                temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True
            ),
        )
        start = time.perf_counter()
        complete: Any = None
        out.print(prompt, style="bold", end="", markup=False, highlight=False)
        async for response in stub.Generate(request):
            if response.WhichOneof("payload") == "chunk":
                out.print(response.chunk.text, end="", markup=False, highlight=False)
            elif response.WhichOneof("payload") == "complete":
                complete = response.complete
        out.print()
        return {"complete": complete, "seconds": time.perf_counter() - start}


def run_demo(
    *,
    target: Path | None,
    draft: Path | None,
    draft_kind: str | None,
    spec_args: list[str],
    prompt: str,
    max_new_tokens: int,
    work_dir: Path,
    device: str,
) -> None:
    err, out = Console(stderr=True), Console()
    if target is None and (family_dir() / "target" / "config.json").is_file():
        target, draft, draft_kind, _ = embedded_defaults(None, draft, draft_kind)
        err.print(f"the embedded reference model ({target.parent}), {draft_kind} draft")
    elif target is None:
        with err.status("writing random-weight demo checkpoints"):
            target, draft = random_models(work_dir)
        draft_kind = "eagle3"
        prompt = "w10 w20 w30"  # the random model's word-level vocabulary
        err.print("[yellow]random weights[/yellow]: the text is noise, acceptance near 1")
    stack = build_stack(
        target=target,
        draft=draft,
        draft_kind=draft_kind,
        mtp_mode="chain",
        spec_args=spec_args,
        page_size=16,
        device=device,
        dtype="float32",
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        draft_deadline_s=5.0,
    )
    try:
        with err.status("starting draft, target and gateway"):
            stack.start(
                log_dir=work_dir / "logs",
                on_ready=lambda s: err.print(f"[green]ready[/green] {s.name} on port {s.port}"),
            )
        result = asyncio.run(stream(stack.services[-1].port, prompt, max_new_tokens, out))
    finally:
        with err.status("stopping services"):
            stack.stop()
    done = result["complete"]
    usage = done.usage
    rate = usage.completion_tokens / max(done.total_ns / 1e9, 1e-9)
    err.print(
        f"[bold]{usage.completion_tokens} tokens[/bold] in {result['seconds']:.2f} s "
        f"({rate:.1f} tokens/s, first token {done.ttft_ns / 1e6:.0f} ms) | "
        f"accept length {usage.accept_length:.2f} | draft tokens {usage.draft_tokens}, "
        f"accepted {usage.accepted_tokens}, verify steps {usage.verify_steps}"
    )
