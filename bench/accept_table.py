"""Accept-length table of the reference family: every draft kind at (K=1, S=3), (K=1, S=5) and
the tree (K=4, S=5, N=16), plus the held-out losses its training recorded.

    python bench/accept_table.py [--family checkpoints/tandem-code-ref] [--num-prompts 64]
        [--max-new-tokens 128] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--doc docs/reference-model.md] [--json PATH]

Runs Tandem's in-process engine (the path ``tandem generate`` takes) on the first N prompts of
``prompts/heldout.jsonl``, greedy, EOS ignored, all prompts in one batch. Accept length is
tokens committed per verify step, bonus included, over all prompts (``SpecStats``: the first
step after each prompt verifies no draft and counts). Every speculative run's tokens are
compared with the target-only run; a mismatch fails the script. Each engine runs a short warm-up
first; the seconds of the measured run give each row's speedup over target only (all prompts
in one batch: a throughput figure). The tables replace the region between the markers in
``--doc`` and are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tandem.config import DraftConfig, EngineConfig  # noqa: E402
from tandem.draft.build import build_drafter  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tandem.spec.types import SpecConfig  # noqa: E402
from tandem.target.engine import Engine, GenerationResult  # noqa: E402
from tandem.train.prompts import read_prompts  # noqa: E402

SHAPES = ((1, 3, None), (1, 5, None), (4, 5, 16))  # (K, S, N)
KINDS = ("eagle3", "mtp", "model", "eagle", "ngram")  # those present in the family are run
START, END = "<!-- accept-table:start -->", "<!-- accept-table:end -->"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    family_dir: Path = args.family
    target = family_dir / "target"
    family = json.loads((family_dir / "family.json").read_text())
    records = read_prompts(family_dir / "prompts" / "heldout.jsonl")[: args.num_prompts]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer(r["text"])["input_ids"] for r in records]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    # Every request's whole sequence plus a tree fits at once (no preemption, nothing huge).
    longest = (
        max(len(p) for p in prompts) + args.max_new_tokens + max(n or s + 1 for _, s, n in SHAPES)
    )
    config = EngineConfig(
        model=target,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(1, len(prompts)),
        num_pages=len(prompts) * (-(-longest // 16) + 1),
    )
    base = Engine(config)
    base_s, results = timed(base, prompts, params)
    reference = [r.token_ids for r in results]
    del base
    print(
        f"target only: {len(prompts)} prompts x {args.max_new_tokens} tokens in {base_s:.2f}s",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for kind in KINDS:
        path = None if kind == "ngram" else family_dir / kind
        if path is not None and not (path / "config.json").is_file():
            continue
        for k, s, n in SHAPES:
            spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
            draft = DraftConfig(
                kind=kind, path=path, target=target, dtype=args.dtype, device=args.device
            )
            engine = Engine(config, drafter=build_drafter(draft, num_layers(target)), spec=spec)
            seconds, results = timed(engine, prompts, params)
            del engine  # its KV pools, before the next one is allocated
            if [r.token_ids for r in results] != reference:
                raise SystemExit(f"{kind} K={k} S={s}: output differs from target-only greedy")
            row = {
                "kind": kind,
                "K": k,
                "S": s,
                "N": spec.tree_size,
                "accept_length": accept_length(results),
                "seconds": round(seconds, 3),
                "speedup": round(base_s / seconds, 2),
            }
            rows.append(row)
            print(
                f"{kind} K={k} S={s} N={spec.tree_size}: accept length "
                f"{row['accept_length']:.3f} ({seconds:.2f}s, {row['speedup']:.2f}x target only)",
                flush=True,
            )
    report = {
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "device": args.device,
        "dtype": args.dtype,
        "target_only_seconds": round(base_s, 3),
        "rows": rows,
    }
    text = markdown(report, family)
    print(text)
    if args.doc is not None:
        write_region(args.doc, text)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", type=Path, default=REPO / "checkpoints" / "tandem-code-ref")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--doc",
        type=Path,
        default=REPO / "docs" / "reference-model.md",
        help="markdown file whose marked region receives the tables",
    )
    parser.add_argument("--no-doc", dest="doc", action="store_const", const=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    return parser.parse_args(argv)


def timed(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, list[GenerationResult]]:
    """Seconds for all prompts at once, after a short warm-up round (kernels compiled, shapes
    seen); the results."""
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - start, results


def num_layers(target: Path) -> int:
    from tandem.models.config import ModelConfig

    return ModelConfig.from_pretrained(target).num_layers


def accept_length(results: list[GenerationResult]) -> float:
    """Committed tokens per verify step over all requests, bonus included."""
    steps = sum(r.stats.verify_steps for r in results)
    tokens = sum(r.stats.accepted_tokens + r.stats.verify_steps for r in results)
    return tokens / max(steps, 1)


def markdown(report: dict[str, Any], family: dict[str, Any]) -> str:
    shapes = [f"K={k}, S={s}" + (f", N={n}" if n else "") for k, s, n in SHAPES]
    lines = [
        START,
        f"Accept length (tokens per verify step, bonus included) on {report['prompts']} held-out "
        f"prompts, {report['max_new_tokens']} new tokens, greedy, EOS ignored "
        f"({report['device']}, {report['dtype']}); every run's output equals target-only greedy.",
        "",
        "| draft | " + " | ".join(shapes) + " |",
        "|---|" + "---|" * len(shapes),
    ]
    for kind in dict.fromkeys(r["kind"] for r in report["rows"]):
        cells = [f"{r['accept_length']:.2f}" for r in report["rows"] if r["kind"] == kind]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    target = family["target"]
    lines += [
        "",
        "Held-out figures recorded by training (`family.json`): the target's next-token loss; "
        "for drafts, cross-entropy against the target's distribution at the first draft step "
        "and top-1 agreement with the target's greedy token by depth.",
        "",
        "| model | parameters | held-out loss | top-1 agreement by depth |",
        "|---|---|---|---|",
        f"| target | {target['parameters'] / 1e6:.2f} M | {target['heldout_loss']:.4f} | |",
    ]
    for kind, rec in family["drafts"].items():
        held = rec["heldout"]
        accs = ", ".join(f"{held[k]:.3f}" for k in sorted(held) if k.startswith("acc"))
        lines.append(
            f"| {kind} | {rec['trainable_parameters'] / 1e6:.2f} M | "
            f"{held.get('ce0', float('nan')):.4f} | {accs} |"
        )
    lines.append(END)
    return "\n".join(lines)


def write_region(doc: Path, text: str) -> None:
    """Replaces the marked region of ``doc`` (appends it when the markers are missing)."""
    current = doc.read_text() if doc.is_file() else ""
    if START in current and END in current:
        before, rest = current.split(START, 1)
        after = rest.split(END, 1)[1]
        doc.write_text(before + text + after)
    else:
        doc.write_text(current + ("\n" if current else "") + text + "\n")


if __name__ == "__main__":
    main()
