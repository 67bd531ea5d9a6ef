"""A trained family's provenance: what ``family.json`` and its ``README.md`` say.

``bench/train_reference.py`` collects the record (corpus manifest, settings and figures of
every stage, versions, sizes); this module renders it.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import torch


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()})"


def versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sizes(out: Path) -> dict[str, float]:
    found = {p.parent.name: 0.0 for p in out.glob("*/config.json")}
    for name in found:
        found[name] = round(sum(f.stat().st_size for f in (out / name).iterdir()) / 1e6, 2)
    found["total"] = round(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6, 2)
    return found


def figures(family: dict[str, Any]) -> list[str]:
    target = family["target"]
    lines = [
        f"| target | {target['parameters'] / 1e6:.2f} M | {target['steps']} | "
        f"held-out loss {target['heldout_loss']:.4f} nats/token |"
    ]
    for kind, rec in family["drafts"].items():
        held = rec["heldout"]
        accs = ", ".join(f"{held[k]:.3f}" for k in sorted(held) if k.startswith("acc"))
        lines.append(
            f"| {kind} | {rec['trainable_parameters'] / 1e6:.2f} M | {rec['steps']} | "
            f"held-out CE vs target {held.get('ce0', float('nan')):.4f}; "
            f"top-1 agreement by depth {accs} |"
        )
    return lines


def summary(family: dict[str, Any]) -> str:
    head = ["", "| model | trainable params | steps | figures |", "|---|---|---|---|"]
    tail = [
        f"sizes (MB): {family['sizes_mb']}",
        f"total {family['seconds']:.0f}s",
        f"reproduce: {family['reproduce']}",
    ]
    return "\n".join(head + figures(family) + tail)


def readme(family: dict[str, Any]) -> str:
    corpus = family["corpus"]
    return "\n".join(
        [
            "# tandem-code-ref: provenance",
            "",
            "Written by `bench/train_reference.py`; every weight here comes from running it.",
            "",
            f"- Command: `{family['command']}` ({family['recipe']} recipe, seed {family['seed']}, "
            f"{family['device']}, {family['seconds']:.0f}s)",
            f"- Reproduce with the steps it ran: `{family['reproduce']}`",
            f"- Versions: {json.dumps(family['versions'])}",
            f"- Corpus: {corpus['implementation']} {corpus['python']} sources under "
            f"{json.dumps(corpus['roots'])}; {corpus['files']} files, {corpus['bytes']} bytes, "
            f"{corpus['heldout_files']} held out by sha256 of `<root>/<relative path>`; "
            f"corpus sha256 `{corpus['sha256']}` (over sorted `source<TAB>content sha256` lines)",
            f"- Tokenizer: byte-level BPE, {family['tokenizer']['vocab_size']} tokens, trained on "
            f"{corpus['tokenizer_trained_on_files']} training files",
            f"- Prompts: `prompts/heldout.jsonl`, {family['prompts']['count']} prompts cut from "
            f"held-out files (whole lines; source, file sha256 and character offsets in each "
            f"record; `tandem/train/prompts.py`), sha256 `{family['prompts']['sha256']}`",
            f"- Sizes (MB): {json.dumps(family['sizes_mb'])}",
            "",
            "| model | trainable params | steps | figures |",
            "|---|---|---|---|",
            *figures(family),
            "",
            "Settings of every stage, the data each saw and its figures: `family.json` and each",
            "directory's `training.json`.",
            "",
        ]
    )
