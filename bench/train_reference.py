"""Trains the Tandem reference model family in one command: corpus -> tokenizer -> target ->
target-written data -> EAGLE-3 head, two chained MTP heads, standalone draft LM.

    python bench/train_reference.py [--out checkpoints/tandem-code-ref] [--time-budget SECONDS]
        [--quick] [--source DIR ...] [--device cuda|cpu] [--seed 0] [--STAGE-steps N ...]

OUT receives ``target/`` (Hugging Face Llama + tokenizer), ``eagle3/``, ``mtp/``, ``model/`` (the
drafts in the formats ``tandem --draft-kind`` loads), each with ``training.json``;
``prompts/heldout.jsonl`` (prompts cut from held-out files: source, file hash, offsets);
``README.md`` (provenance: corpus, settings, steps run, figures, how to reproduce) and
``family.json`` (the same for ``bench/accept_table.py``). Weights are saved in bf16.

Deterministic given the seed and the corpus (the interpreter's Python sources, or ``--source``
directories) when step counts are fixed (the default): bit for bit on a CPU; CUDA kernels add
run-to-run noise. ``--time-budget`` instead gives each
stage a share of the time (at least 10 s): its cosine runs over that time and it stops when the
time is up, so the whole run fits; the steps it ran are recorded and the README's reproduce
line fixes them. ``--quick`` is a CPU smoke of the same
code at toy sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tandem.train.blocks import TokenData, token_data  # noqa: E402
from tandem.train.corpus import collect_python_sources, manifest, python_roots, split  # noqa: E402
from tandem.train.draft import DraftSettings, train_draft  # noqa: E402
from tandem.train.family import describe, file_sha256, readme, sizes, summary, versions  # noqa: E402
from tandem.train.features import FrozenTarget, generate_sequences  # noqa: E402
from tandem.train.loop import LoopSettings, log_stdout, seed_everything  # noqa: E402
from tandem.train.prompts import cut_prompts, read_prompts, write_prompts  # noqa: E402
from tandem.train.standalone import StandaloneShape  # noqa: E402
from tandem.train.target import TargetSettings, save_target, train_target  # noqa: E402
from tandem.train.tokenizer import sample_texts, train_tokenizer  # noqa: E402

DRAFTS = ("eagle3", "mtp", "model")
# Shares of the training time when a budget is given: the target, then the drafts.
TARGET_SHARE = 0.45
DRAFT_WEIGHTS = {"eagle3": 0.5, "mtp": 0.25, "model": 0.25}
RESERVE_S = 25.0  # prompts, README, evaluation and saving after the last loop
STAGE_OVERHEAD_S = 10.0  # loading, evaluation and saving around each draft's loop


@dataclass(frozen=True, kw_only=True)
class Recipe:
    vocab_size: int
    tokenizer_mb: float  # text the BPE is trained on (train documents in hash order)
    seq_len: int
    heldout_fraction: float
    max_corpus_mb: float | None
    target: TargetSettings
    generate: int  # target-written sequences for the drafts
    generate_prompt: int  # tokens of each such sequence cut from a training block
    generate_batch: int
    drafts: dict[str, DraftSettings]
    num_prompts: int
    save_dtype: str = "bfloat16"


def draft_loop(steps: int) -> LoopSettings:
    return LoopSettings(steps=steps, lr=2e-3, warmup_steps=100, grad_clip=0.5, log_every=100)


FULL = Recipe(
    vocab_size=8192,
    tokenizer_mb=16,
    seq_len=512,
    heldout_fraction=0.03,
    max_corpus_mb=256,  # bounds tokenization time; files taken in hash order
    target=TargetSettings(
        loop=LoopSettings(steps=4000, lr=3e-3, warmup_steps=200, weight_decay=0.1, log_every=100)
    ),
    generate=4096,
    generate_prompt=64,
    generate_batch=1024,
    drafts={
        "eagle3": DraftSettings(kind="eagle3", loop=draft_loop(2000), batch_size=64, ttt_steps=5),
        "mtp": DraftSettings(kind="mtp", loop=draft_loop(1500), batch_size=64, ttt_steps=5),
        "model": DraftSettings(
            kind="model", loop=draft_loop(1500), batch_size=64, model_shape=StandaloneShape()
        ),
    },
    num_prompts=256,
)

QUICK = Recipe(
    vocab_size=512,
    tokenizer_mb=1,
    seq_len=64,
    heldout_fraction=0.2,
    max_corpus_mb=1,
    target=TargetSettings(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        batch_size=8,
        loop=LoopSettings(steps=30, lr=3e-3, warmup_steps=5, log_every=10),
        eval_blocks=8,
    ),
    generate=8,
    generate_prompt=16,
    generate_batch=8,
    drafts={
        kind: DraftSettings(
            kind=kind,
            loop=LoopSettings(steps=8, lr=3e-3, warmup_steps=2, log_every=4),
            batch_size=4,
            ttt_steps=3,
            draft_vocab_size=256,
            model_shape=StandaloneShape(num_layers=1),
            eval_blocks=4,
        )
        for kind in DRAFTS
    },
    num_prompts=16,
)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    clock = time.perf_counter()
    recipe = customise(QUICK if args.quick else FULL, args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(args.seed)
    log_stdout(
        f"[recipe] {'quick' if args.quick else 'full'} recipe on {describe(device)} -> {out}"
    )
    corpus, data, tokenizer = prepare(recipe, args, out)
    target_budget = None
    if args.time_budget:
        target_budget = TARGET_SHARE * (args.time_budget - (time.perf_counter() - clock))
    target = train_and_save_target(recipe, data, tokenizer, out / "target", device, target_budget)
    frozen = FrozenTarget(out / "target", device)  # drafts learn the saved (bf16) target
    generated = generate_sequences(
        frozen,
        data.train,
        recipe.generate,
        recipe.generate_prompt,
        batch_size=recipe.generate_batch,
        seed=args.seed,
    )
    del frozen
    draft_data = TokenData(data.train, data.heldout, generated)
    info = {
        "corpus": corpus,
        "generated": {"sequences": recipe.generate, "prompt_tokens": recipe.generate_prompt},
    }
    drafts: dict[str, Any] = {}
    for i, kind in enumerate(DRAFTS):
        settings = replace(recipe.drafts[kind], seed=args.seed, save_dtype=recipe.save_dtype)
        if args.time_budget:
            left = args.time_budget - (time.perf_counter() - clock) - RESERVE_S
            weight = DRAFT_WEIGHTS[kind] / sum(DRAFT_WEIGHTS[k] for k in DRAFTS[i:])
            seconds = max(10.0, left * weight - STAGE_OVERHEAD_S)
            settings = replace(settings, loop=replace(settings.loop, max_seconds=seconds))
        drafts[kind] = train_draft(
            out / "target", out / kind, draft_data, settings, device, data_info=info
        )
    family = {
        "recipe": "quick" if args.quick else "full",
        "command": " ".join(sys.argv),
        "reproduce": reproduce(args, target, drafts),
        "seed": args.seed,
        "device": describe(device),
        "versions": versions(),
        "corpus": corpus,
        "tokenizer": {"vocab_size": len(tokenizer)},
        "target": target,
        "drafts": drafts,
        "prompts": {
            "count": len(read_prompts(out / "prompts" / "heldout.jsonl")),
            "sha256": file_sha256(out / "prompts" / "heldout.jsonl"),
        },
        "sizes_mb": sizes(out),
        "seconds": round(time.perf_counter() - clock, 1),
    }
    (out / "family.json").write_text(json.dumps(family, indent=2) + "\n")
    (out / "README.md").write_text(readme(family))
    log_stdout(summary(family))


def prepare(
    recipe: Recipe, args: argparse.Namespace, out: Path
) -> tuple[dict[str, Any], TokenData, Any]:
    """Corpus, its split, the tokenizer, the packed blocks and the held-out prompts."""
    roots = {p.name or str(p): p.resolve() for p in args.source} if args.source else python_roots()
    docs = cap(collect_python_sources(roots), recipe.max_corpus_mb)
    train_docs, heldout_docs = split(docs, recipe.heldout_fraction)
    corpus = manifest(docs, heldout_docs) | {"roots": {k: str(v) for k, v in roots.items()}}
    log_stdout(
        f"[corpus] {corpus['files']} files, {corpus['bytes'] / 2**20:.1f} MiB "
        f"({corpus['heldout_files']} held out), sha256 {corpus['sha256'][:16]}"
    )
    texts = sample_texts((d.text for d in hash_order(train_docs)), int(recipe.tokenizer_mb * 2**20))
    tokenizer = train_tokenizer(texts, vocab_size=recipe.vocab_size)
    corpus["tokenizer_trained_on_files"] = len(texts)
    data = token_data(train_docs, heldout_docs, tokenizer, recipe.seq_len)
    log_stdout(
        f"[tokens] BPE of {len(tokenizer)} tokens trained on {len(texts)} files; "
        f"{data.train.shape[0]} train / {data.heldout.shape[0]} held-out blocks of "
        f"{recipe.seq_len} ({data.num_tokens / 1e6:.1f} M train tokens)"
    )
    prompts = cut_prompts(heldout_docs, tokenizer, recipe.num_prompts, seed=args.seed)
    write_prompts(prompts, out / "prompts" / "heldout.jsonl")
    log_stdout(f"[prompts] {len(prompts)} held-out prompts -> {out / 'prompts' / 'heldout.jsonl'}")
    return corpus, data, tokenizer


def train_and_save_target(
    recipe: Recipe,
    data: TokenData,
    tokenizer: Any,
    path: Path,
    device: torch.device,
    max_seconds: float | None,
) -> dict[str, Any]:
    """Trains the target, saves it in bf16 with ``training.json``; returns that record."""
    settings = recipe.target
    if max_seconds is not None:
        settings = replace(
            settings, loop=replace(settings.loop, max_seconds=max(10.0, max_seconds))
        )
    trained = train_target(data, settings, device)
    save_target(trained.model, tokenizer, path, torch.bfloat16)
    record = {
        "settings": settings.record(),
        "data": {
            "seq_len": data.seq_len,
            "train_blocks": int(data.train.shape[0]),
            "heldout_blocks_evaluated": min(settings.eval_blocks, int(data.heldout.shape[0])),
        },
        "parameters": trained.num_params,
        "steps": trained.loop.steps,
        "seconds": round(trained.loop.seconds, 1),
        "tokens": trained.loop.tokens,
        "train_loss": trained.loop.final_loss,
        "heldout_loss": trained.heldout_loss,
    }
    (path / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "checkpoints" / "tandem-code-ref")
    parser.add_argument("--quick", action="store_true", help="toy sizes: a CPU smoke run")
    parser.add_argument(
        "--source",
        type=Path,
        action="append",
        default=[],
        help="corpus directory (repeatable); default: this interpreter's sources",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds for the whole run, shared among the stages",
    )
    parser.add_argument("--max-corpus-mb", type=float, default=None)
    parser.add_argument("--target-steps", type=int, default=None)
    for kind in DRAFTS:
        parser.add_argument(f"--{kind}-steps", type=int, default=None)
    return parser.parse_args(argv)


def customise(recipe: Recipe, args: argparse.Namespace) -> Recipe:
    target = recipe.target
    if args.target_steps:
        target = replace(target, loop=replace(target.loop, steps=args.target_steps))
    target = replace(target, seed=args.seed)
    drafts = dict(recipe.drafts)
    for kind in DRAFTS:
        steps = getattr(args, f"{kind}_steps")
        if steps:
            drafts[kind] = replace(drafts[kind], loop=replace(drafts[kind].loop, steps=steps))
    max_mb = args.max_corpus_mb if args.max_corpus_mb is not None else recipe.max_corpus_mb
    return replace(recipe, target=target, drafts=drafts, max_corpus_mb=max_mb)


def hash_order(docs: list[Any]) -> list[Any]:
    from tandem.train.corpus import path_fraction

    return sorted(docs, key=lambda d: path_fraction(d.source))


def cap(docs: list[Any], max_mb: float | None) -> list[Any]:
    """At most ``max_mb`` of text, documents taken in hash order (all when None)."""
    if max_mb is None:
        return docs
    kept, left = list[Any](), int(max_mb * 2**20)
    for doc in hash_order(docs):
        left -= len(doc.text.encode())
        if left < 0 and kept:
            break
        kept.append(doc)
    return kept


def reproduce(args: argparse.Namespace, target: dict[str, Any], drafts: dict[str, Any]) -> str:
    parts = [
        "python bench/train_reference.py",
        f"--seed {args.seed}",
        f"--target-steps {target['steps']}",
    ]
    parts += [f"--{kind}-steps {drafts[kind]['steps']}" for kind in DRAFTS]
    if args.quick:
        parts.append("--quick")
    parts += [f"--source {p}" for p in args.source]
    if args.max_corpus_mb is not None:
        parts.append(f"--max-corpus-mb {args.max_corpus_mb}")
    return " ".join(parts)


if __name__ == "__main__":
    main()
