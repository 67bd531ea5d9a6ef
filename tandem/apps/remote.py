"""``tandem generate --server``: a batch through the gateway (``tandem.apps.client``) with a
progress bar on stderr and a one-line error for a prompt that fails for good."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tandem.apps.client import GenerateFailed, RetryPolicy, generate_remote


def generate_through(
    server: str,
    prompts: Sequence[str],
    err: Console,
    *,
    progress: bool,
    max_in_flight: int | None,
    attempts: int,
    **sampling: Any,
) -> list[dict[str, Any]]:
    """Every prompt through the gateway at ``server``; exits 2 naming the prompt that failed."""
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[in_flight]} in flight, {task.fields[retries]} retried"),
        TimeRemainingColumn(),
        # Asked for without a terminal (a log): drawn as on one, the last state left behind.
        console=err if err.is_terminal else Console(stderr=True, force_terminal=True),
        transient=err.is_terminal,
        disable=not progress,
    )
    task = bar.add_task("generating", total=len(prompts), in_flight="?", retries=0)
    retries = 0

    def on_retry(code: grpc.StatusCode, delay_s: float) -> None:
        nonlocal retries
        retries += 1
        bar.update(task, retries=retries)

    try:
        with bar:
            return generate_remote(
                server,
                prompts,
                max_in_flight=max_in_flight,
                retry=RetryPolicy(attempts=attempts),
                on_start=lambda n: bar.update(task, in_flight=n),
                on_done=lambda _: bar.advance(task),
                on_retry=on_retry,
                **sampling,
            )
    except GenerateFailed as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from None
    except grpc.aio.AioRpcError as exc:  # the gateway's limits could not be read
        err.print(f"[red]error:[/red] {escape(f'{server}: {exc.code().name}: {exc.details()}')}")
        raise typer.Exit(2) from None
