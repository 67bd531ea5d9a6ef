"""Per-cycle time outside model compute, in process and through the services (bs=1).

A speculative cycle costs the target's forward, the draft's model compute, and everything
else: host bookkeeping (planning, verification, commit, building messages) and, between
services, serialisation and loopback transport. This measures that "everything else" per
cycle for one request:

- in process: ``Engine`` with an in-process drafter; per step, ``StepResult.timing``;
- services: the draft and target services as two processes on loopback (``tandem serve``'s
  command lines); this script speaks the target's Control stream itself, as the gateway does,
  and reads each step's ``StepStats`` (step, verify = target forward, draft = the draft's
  model time as it reported it, wire, host).

overhead = cycle - target model - draft model. Only decode cycles count (not the prefill).
Without ``--target`` a random-weight Llama and EAGLE-3 head are written to a temporary
directory (acceptance is then near 0, which does not change the overhead much).

    python bench/cycle_overhead.py [--target DIR --draft DIR --draft-kind eagle3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem.apps.demo import free_port, random_models
from tandem.apps.launch import build_stack
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.models.config import ModelConfig
from tandem.sampling import SamplingParams
from tandem.serving.rpc import channel_options
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc


@dataclass(frozen=True)
class Cycle:
    total_us: float
    target_us: float
    draft_us: float
    wire_us: float  # draft wait beyond its model time (in process: the drafter's bookkeeping)
    host_us: float
    committed: int

    @property
    def overhead_us(self) -> float:
        return self.total_us - self.target_us - self.draft_us


def prompt_ids(vocab: int, n: int = 24) -> list[int]:
    return [(7 * i + 3) % (vocab - 4) + 4 for i in range(n)]


def in_process(args: argparse.Namespace, target: Path, draft: Path | None) -> list[Cycle]:
    layers = ModelConfig.from_pretrained(target).num_layers
    config = DraftConfig(kind=args.draft_kind, path=draft, target=target, page_size=16)
    spec = SpecConfig(num_steps=args.spec_steps, topk=1)
    engine = Engine(
        EngineConfig(model=target, page_size=16),
        drafter=build_drafter(config, layers),
        spec=spec,
    )
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    engine.generate([prompt_ids(vocab)], SamplingParams(max_new_tokens=8, ignore_eos=True))
    request_id = engine.add_request(prompt_ids(vocab), params)
    cycles = []
    while engine.has_unfinished():
        step = engine.step()
        outputs, t, st = step.outputs, step.timing, step.stats
        if st.verify_steps:  # a decode cycle (the prefill step verifies nothing)
            cycles.append(
                Cycle(
                    total_us=t.total_ns / 1e3,
                    target_us=t.forward_ns / 1e3,
                    draft_us=t.draft_model_ns / 1e3,
                    wire_us=max(0, t.draft_wait_ns - t.draft_model_ns) / 1e3,
                    host_us=(t.total_ns - t.forward_ns - t.draft_wait_ns) / 1e3,
                    committed=sum(len(o.new_token_ids) for o in outputs),
                )
            )
    engine.flush_draft()
    engine.pop_finished(request_id)
    return cycles


async def control_run(port: int, vocab: int, new_tokens: int) -> list[Cycle]:
    """One request through the target's Control stream; the StepStats of its cycles."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        outbox: asyncio.Queue[target_pb2.ControlRequest] = asyncio.Queue()

        async def requests():  # type: ignore[no-untyped-def]
            while True:
                yield await outbox.get()

        call = stub.Control(requests())
        cycles: list[Cycle] = []
        for round_, n in enumerate((8, new_tokens)):  # a warm-up request, then the measured one
            admit = target_pb2.AdmitCommand(
                request_id=f"bench-{round_}",
                prompt_token_ids=prompt_ids(vocab),
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=n, ignore_eos=True
                ),
            )
            admit.speculation.enabled = True
            await outbox.put(target_pb2.ControlRequest(admit=admit))
            finished = False
            while not finished:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise RuntimeError("the target ended the control stream")
                if response.WhichOneof("event") != "step":
                    continue
                step = response.step
                for commit in step.commits:
                    if commit.finish_reason == common_pb2.FINISH_REASON_ERROR:
                        raise RuntimeError(f"the target refused the request: {commit.error}")
                    finished = finished or commit.finish_reason != 0
                s = step.stats
                if round_ == 1 and s.batch_size:
                    cycles.append(
                        Cycle(
                            total_us=s.step_ns / 1e3,
                            target_us=s.verify_ns / 1e3,
                            draft_us=s.draft_ns / 1e3,
                            wire_us=s.wire_ns / 1e3,
                            host_us=s.host_ns / 1e3,
                            committed=s.num_committed_tokens,
                        )
                    )
        call.cancel()
        return cycles


def services(args: argparse.Namespace, target: Path, draft: Path | None, logs: Path) -> list[Cycle]:
    stack = build_stack(
        target=target,
        draft=draft,
        draft_kind=args.draft_kind,
        mtp_mode="chain",
        spec_args=["--spec-steps", str(args.spec_steps), "--spec-topk", "1"],
        page_size=16,
        device="cpu",
        dtype="float32",
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        draft_deadline_s=30.0,  # measure, never fall back
    )
    print("starting draft and target services ...", file=sys.stderr)
    stack.start(log_dir=logs)
    try:
        vocab = ModelConfig.from_pretrained(target).vocab_size
        return asyncio.run(control_run(stack.services[1].port, vocab, args.new_tokens))
    finally:
        stack.stop()


def summarize(name: str, cycles: list[Cycle]) -> dict[str, float | int | str]:
    def median(key: str) -> float:
        return statistics.median(getattr(c, key) for c in cycles)

    overheads = sorted(c.overhead_us for c in cycles)
    return {
        "mode": name,
        "cycles": len(cycles),
        "accept_length": sum(c.committed for c in cycles) / len(cycles),
        "cycle_us": median("total_us"),
        "target_model_us": median("target_us"),
        "draft_model_us": median("draft_us"),
        "overhead_us": median("overhead_us"),
        "overhead_p90_us": overheads[int(0.9 * (len(overheads) - 1))],
        "wire_us": median("wire_us"),
        "host_us": median("host_us"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", type=Path, help="target checkpoint (default: random Llama)")
    p.add_argument("--draft", type=Path, help="draft checkpoint (default: random EAGLE-3)")
    p.add_argument("--draft-kind", default="eagle3")
    p.add_argument("--spec-steps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = args.target, args.draft
        if target is None:
            target, draft = random_models(Path(tmp))
        rows = [
            summarize("in-process", in_process(args, target, draft)),
            summarize("services", services(args, target, draft, Path(tmp) / "logs")),
        ]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"bs=1, CPU, {args.draft_kind} S={args.spec_steps} K=1, medians per decode cycle (us)")
    keys = list(rows[0])
    print(" ".join(f"{k:>15}" for k in keys))
    for row in rows:
        cells = [f"{v:>15.1f}" if isinstance(v, float) else f"{v!s:>15}" for v in row.values()]
        print(" ".join(cells))


if __name__ == "__main__":
    main()
