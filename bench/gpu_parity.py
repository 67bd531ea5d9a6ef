"""GPU greedy parity: speculation through the three services against target-only decoding.

For each dtype, the embedded reference family (checkpoints/tandem-code-ref: target + EAGLE-3
head) runs ``--prompts`` held-out prompts greedily (EOS ignored) twice on one device: target
only, in process (``Engine`` without a draft, CUDA graphs on), and through draft, target and
gateway as real processes (the gateway's ``Generate`` API, all prompts concurrently, so the
batch sizes and lanes change as requests finish). It reports per dtype the prompts whose
outputs are identical, and for the first differing prompt where they part and the target's
top-2 margin there (bf16 non-associativity flips only near-ties), plus the services' accept
length.

    python bench/gpu_parity.py [--dtypes float32,bfloat16] [--prompts 64] [--new-tokens 128]
                               [--device-chain] [--batch-invariant]

``--device-chain``: the target runs steady chains as device-chain runs with the draft on its
local socket (one lane: the gateway's ``--two-lane-batch 0``). ``--batch-invariant``: both
sides run the target's batch-invariant kernels (``EngineConfig.batch_invariant``, the target's
``--batch-invariant``), under which bf16 outputs should be identical too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
import torch

from tandem.apps.client import generate_one
from tandem.apps.demo import free_port
from tandem.apps.embedded import family_dir
from tandem.apps.launch import build_stack
from tandem.bench import hf
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.serving.rpc import channel_options
from tandem.target.engine import Engine
from tandem.train.prompts import read_prompts
from tandem.v1 import common_pb2, gateway_pb2_grpc


def target_only(
    target: Path,
    prompts: list[list[int]],
    n: int,
    dtype: str,
    device: str,
    batch_invariant: bool = False,
) -> list[list[int]]:
    config = EngineConfig(
        model=target,
        dtype=dtype,
        device=device,
        max_num_seqs=len(prompts),
        batch_invariant=batch_invariant,
    )
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return [r.token_ids for r in Engine(config).generate(prompts, params)]


async def _through_gateway(
    port: int, prompts: list[list[int]], n: int
) -> tuple[list[list[int]], float]:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        records = await asyncio.gather(*(generate_one(stub, p, sampling) for p in prompts))
    accepted = sum(r["accepted_tokens"] for r in records)
    steps = sum(r["verify_steps"] for r in records)
    return [r["token_ids"] for r in records], (accepted + steps) / max(steps, 1)


def through_services(
    family: Path,
    prompts: list[list[int]],
    n: int,
    dtype: str,
    device: str,
    log_dir: Path,
    device_chain: bool = False,
    batch_invariant: bool = False,
) -> tuple[list[list[int]], float]:
    ports = free_port(), free_port(), free_port()
    stack = build_stack(
        target=family / "target",
        draft=family / "eagle3",
        draft_kind="eagle3",
        mtp_mode="chain",
        spec_args=["--spec-steps", "3", "--spec-topk", "1"],
        page_size=16,
        device=device,
        dtype=dtype,
        gateway_port=ports[0],
        target_port=ports[1],
        draft_port=ports[2],
        draft_deadline_s=30.0,  # parity of the speculative path, never its K=0 fallback
        two_lane_batch=0 if device_chain else 16,
        local_stream=device_chain,
        extra_target_args=[
            *("--max-num-seqs", str(len(prompts))),
            # Each run's start and end in the target's log (DEBUG).
            *(["--device-chain", "--log-level", "DEBUG"] if device_chain else []),
            *(["--batch-invariant"] if batch_invariant else []),
        ],
    )
    stack.start(log_dir=log_dir)
    try:
        return asyncio.run(_through_gateway(ports[0], prompts, n))
    finally:
        stack.stop()


def first_difference(
    target: Path, dtype: str, device: str, prompt: list[int], a: list[int], b: list[int]
) -> dict[str, object]:
    """Where two outputs part, and the top-2 logit margin there in transformers' forward."""
    at = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    model = hf.load(target, dtype, device)
    with torch.no_grad():
        ids = torch.tensor([prompt + a[:at]], device=device)
        logits = model(ids).logits[0, -1]
    top = torch.topk(logits.float(), 2)
    del model
    return {
        "position": at,
        "target_only": a[at],
        "services": b[at],
        "top2_ids": top.indices.tolist(),
        "top2_margin": float(top.values[0] - top.values[1]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device-chain", action="store_true")
    p.add_argument("--batch-invariant", action="store_true")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    family = family_dir()
    tokenizer = AutoTokenizer.from_pretrained(family / "target")
    records = read_prompts(family / "prompts" / "heldout.jsonl")[: args.prompts]
    prompts = [tokenizer(r["text"])["input_ids"] for r in records]
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="tandem-parity-"))
    report = {}
    for dtype in args.dtypes.split(","):
        ours = target_only(
            family / "target", prompts, args.new_tokens, dtype, args.device, args.batch_invariant
        )
        spec, accept = through_services(
            family,
            prompts,
            args.new_tokens,
            dtype,
            args.device,
            log_root / dtype,
            args.device_chain,
            args.batch_invariant,
        )
        same = [i for i, (a, b) in enumerate(zip(ours, spec, strict=True)) if a == b]
        entry: dict[str, Any] = {
            "prompts": len(prompts),
            "identical": len(same),
            "share": len(same) / len(prompts),
            "accept_length": accept,
        }
        differ = [i for i in range(len(prompts)) if i not in same]
        if differ:
            i = differ[0]
            entry["first_difference"] = {"prompt": i} | first_difference(
                family / "target", dtype, args.device, prompts[i], ours[i], spec[i]
            )
        report[dtype] = entry
        print(
            f"{dtype:9s} identical {len(same)}/{len(prompts)} ({entry['share']:.1%}), "
            f"services accept length {accept:.2f}"
            + (f", first difference {entry['first_difference']}" if differ else ""),
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    ok = report.get("float32", {"share": 1.0})["share"] == 1.0 and all(
        e["share"] >= 0.95 for e in report.values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
