"""``tandem generate --server``: a batch through the gateway (``tandem.apps.client``), its
records handed on in prompt order as soon as the ones before them are done (a long batch's
output appears as it goes), a progress bar on stderr, and a one-line error for a prompt that
fails for good."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
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
    emit: Callable[[list[dict[str, Any]]], None],
    progress: bool,
    max_in_flight: int | None,
    attempts: int,
    **sampling: Any,
) -> None:
    """Every prompt through the gateway at ``server``, its records to ``emit`` in order; exits
    2 naming the prompt that failed (the records before it were emitted)."""
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
        redirect_stdout=False,  # stdout stays stdout (records are held while both share a tty)
    )
    task = bar.add_task("generating", total=len(prompts), in_flight="?", retries=0)
    retries = 0

    def on_retry(code: grpc.StatusCode, delay_s: float) -> None:
        nonlocal retries
        retries += 1
        bar.update(task, retries=retries)

    done: dict[int, dict[str, Any]] = {}
    emitted = 0
    # A bar and the records on one terminal: the records come after the bar, unbroken.
    held: list[dict[str, Any]] | None = [] if progress and sys.stdout.isatty() else None

    def on_done(index: int, record: dict[str, Any]) -> None:
        nonlocal emitted
        bar.advance(task)
        done[index] = record
        ready = []
        while emitted in done:
            ready.append(done.pop(emitted))
            emitted += 1
        if held is not None:
            held.extend(ready)
        elif ready:
            emit(ready)

    try:
        try:
            with bar:
                generate_remote(
                    server,
                    prompts,
                    max_in_flight=max_in_flight,
                    retry=RetryPolicy(attempts=attempts),
                    on_start=lambda n: bar.update(task, in_flight=min(n, len(prompts))),
                    on_done=on_done,
                    on_retry=on_retry,
                    **sampling,
                )
        finally:
            if held:
                emit(held)
    except GenerateFailed as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except grpc.aio.AioRpcError as exc:  # the gateway's limits could not be read
        why = escape(f"{server}: {exc.code().name}: {exc.details()}")
        err.print(f"[red]error:[/red] {why}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
