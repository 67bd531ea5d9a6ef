"""``tandem train-draft``: train a draft of any kind for a target checkpoint.

Registered on the ``tandem`` app by :mod:`tandem.apps.cli`; heavy imports happen inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.config import EngineConfig
from tandem.settings import Flags, typer_options

# The target to train for and the device to train on, as the engine's settings.
TARGET = Flags(
    EngineConfig,
    ("model", "device"),
    defaults={"device": None},
    shown={"device": "cuda when available"},
)


@typer_options(TARGET)
def train_draft(
    kind: Annotated[str, typer.Option(help="eagle3, eagle, mtp or model.")],
    out: Annotated[Path, typer.Option(help="Directory to write the draft checkpoint to.")],
    data: Annotated[
        list[Path] | None,
        typer.Option(
            help="Training text: .py/.txt files, directories of them, or .jsonl lines "
            '{"text": ...} / {"token_ids": [...]}; repeatable. Default: this interpreter\'s '
            "Python sources."
        ),
    ] = None,
    steps: Annotated[
        int, typer.Option(help="Optimizer steps (the most, with --max-seconds).")
    ] = 1000,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 32,
    seq_len: Annotated[int, typer.Option(help="Tokens per training sequence.")] = 512,
    lr: Annotated[float, typer.Option(help="Peak learning rate (warm-up, then cosine).")] = 2e-3,
    warmup_steps: Annotated[int, typer.Option(help="Linear warm-up steps.")] = 50,
    max_seconds: Annotated[
        float | None,
        typer.Option(help="Time budget: stop after this long (the cosine runs over time)."),
    ] = None,
    dtype: Annotated[str, typer.Option(help="Saved weights: float32, bfloat16 or float16.")] = (
        "float32"
    ),
    seed: Annotated[int, typer.Option(help="Seeds init, batches and generation.")] = 0,
    ttt_steps: Annotated[
        int, typer.Option(help="Draft depths trained (EAGLE training-time test; MTP chain).")
    ] = 5,
    num_heads: Annotated[int, typer.Option(help="mtp: chained NextN heads.")] = 2,
    draft_vocab_size: Annotated[
        int, typer.Option(help="eagle3: most frequent tokens kept (d2t/t2d).")
    ] = 4096,
    draft_layers: Annotated[int, typer.Option(help="model: decoder layers of the draft LM.")] = 2,
    hard_weight: Annotated[
        float,
        typer.Option(help="Label loss: weight of CE on the target's greedy token vs its softmax."),
    ] = 0.5,
    generate: Annotated[
        int, typer.Option(help="Target-written (greedy) sequences mixed into the batches.")
    ] = 0,
    generated_fraction: Annotated[
        float, typer.Option(help="Share of each batch from target-written sequences.")
    ] = 0.5,
    heldout_fraction: Annotated[
        float, typer.Option(help="Documents held out for evaluation (by path hash).")
    ] = 0.05,
    max_data_mb: Annotated[
        float | None, typer.Option(help="Use at most this much text (documents in hash order).")
    ] = None,
    log_every: Annotated[int, typer.Option(help="Steps between progress lines.")] = 50,
    **engine: Any,
) -> None:
    """Train a draft (EAGLE-3, EAGLE-1, MTP heads or a small LM) on a target's own outputs."""
    import torch

    from tandem.errors import TandemError
    from tandem.train.draft import DraftSettings
    from tandem.train.loop import LoopSettings
    from tandem.train.standalone import StandaloneShape

    target, device = engine["target"], engine["device"]
    chosen = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        settings = DraftSettings(
            kind=kind,
            loop=LoopSettings(
                steps=steps,
                lr=lr,
                warmup_steps=warmup_steps,
                grad_clip=0.5,
                max_seconds=max_seconds,
                log_every=log_every,
            ),
            batch_size=batch_size,
            seq_len=seq_len,
            ttt_steps=ttt_steps,
            num_heads=num_heads,
            draft_vocab_size=draft_vocab_size,
            generated_fraction=generated_fraction,
            hard_weight=hard_weight,
            model_shape=StandaloneShape(num_layers=draft_layers),
            seed=seed,
            save_dtype=dtype,
        )
        run_train_draft(
            target,
            out,
            settings,
            torch.device(chosen),
            data=data or [],
            heldout_fraction=heldout_fraction,
            max_data_mb=max_data_mb,
            generate=generate,
        )
    except (TandemError, ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def run_train_draft(
    target: Path,
    out: Path,
    settings: Any,  # DraftSettings
    device: Any,  # torch.device
    *,
    data: list[Path],
    heldout_fraction: float,
    max_data_mb: float | None,
    generate: int,
) -> dict[str, Any]:
    """Reads and tokenizes the data with the target's tokenizer, optionally has the target
    write sequences, and trains (:func:`tandem.train.draft.train_draft`)."""
    from tandem.models.tokenizer import load_tokenizer
    from tandem.train.blocks import TokenData, token_data
    from tandem.train.corpus import (
        collect_python_sources,
        manifest,
        path_fraction,
        read_documents,
        split,
    )
    from tandem.train.draft import train_draft as train
    from tandem.train.features import FrozenTarget, generate_sequences
    from tandem.train.loop import log_stdout

    docs = read_documents(data) if data else collect_python_sources()
    if max_data_mb is not None:
        budget, kept = int(max_data_mb * 2**20), list[Any]()
        for doc in sorted(docs, key=lambda d: path_fraction(d.source)):
            budget -= len(doc.text.encode())
            if budget < 0 and kept:
                break
            kept.append(doc)
        docs = kept
    if not docs:
        raise ValueError("data: no documents found")
    train_docs, heldout_docs = split(docs, heldout_fraction)
    seq_len = settings.seq_len or 512
    tokens = token_data(train_docs, heldout_docs, load_tokenizer(target), seq_len)
    log_stdout(
        f"[data] {len(train_docs)} train / {len(heldout_docs)} held-out documents -> "
        f"{tokens.train.shape[0]} / {tokens.heldout.shape[0]} blocks of {seq_len} tokens"
    )
    if generate > 0:
        frozen = FrozenTarget(target, device)
        generated = generate_sequences(
            frozen,
            tokens.train,
            generate,
            min(64, seq_len // 4) or 1,
            batch_size=256,
            seed=settings.seed,
        )
        tokens = TokenData(tokens.train, tokens.heldout, generated)
        del frozen
    info = {
        "sources": [str(p) for p in data] or ["python sources of this interpreter"],
        "corpus": manifest(docs, heldout_docs),
        "heldout_fraction": heldout_fraction,
    }
    return train(target, out, tokens, settings, device, data_info=info)
