"""Speculation through the services keeps the acceptance it has in process: the shipped reference
family (``checkpoints/tandem-code-ref``: a target and its EAGLE-3 head, trained), held-out
prompts, 64 new tokens, greedy, one request alone and 16 at once, chains (S=3) and trees (K=4,
N=16). The three services run as processes (``build_stack``); in process is ``Engine`` with the
same draft. Tokens are identical, and the accept length through the services is within 2% of
in process's, every decode step of every request counted (the usage's drafted steps and steps
without a tree say why any step went without)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.apps.demo import free_port
from tandem.apps.launch import Stack, build_stack
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.models.config import ModelConfig
from tandem.models.tokenizer import load_tokenizer
from tandem.sampling import SamplingParams
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.e2e

FAMILY = Path(__file__).resolve().parents[2] / "checkpoints" / "tandem-code-ref"
NEW_TOKENS = 64
SHAPES = {
    "chain": SpecConfig(num_steps=3),
    "tree": SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
}


def heldout(n: int) -> list[list[int]]:
    tokenizer = load_tokenizer(FAMILY / "target")
    lines = (FAMILY / "prompts" / "heldout.jsonl").read_text().splitlines()[:n]
    return [tokenizer(json.loads(line)["text"])["input_ids"] for line in lines]


def in_process(spec: SpecConfig, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    target = FAMILY / "target"
    draft = DraftConfig(kind="eagle3", path=FAMILY / "eagle3", target=target)
    drafter = build_drafter(draft, ModelConfig.from_pretrained(target).num_layers)
    engine = Engine(EngineConfig(model=target), drafter=drafter, spec=spec)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    results = engine.generate(prompts, params)
    accepted = sum(r.stats.accepted_tokens for r in results)
    steps = sum(r.stats.verify_steps for r in results)
    return (accepted + steps) / steps, [r.token_ids for r in results]


async def through(port: int, prompts: list[list[int]]) -> list[tuple[list[int], common_pb2.Usage]]:
    """Sends every prompt at once; each stream's tokens and final usage."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def one(ids: list[int]) -> tuple[list[int], common_pb2.Usage]:
            request = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=ids),
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True
                ),
                stream_options=gateway_pb2.StreamOptions(detokenize=False),
            )
            tokens: list[int] = []
            usage = common_pb2.Usage()
            async for response in stub.Generate(request):
                if response.HasField("chunk"):
                    tokens += response.chunk.token_ids
                if response.HasField("complete"):
                    usage = response.complete.usage
            return tokens, usage

        return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.fixture(scope="module", params=list(SHAPES))
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Stack]]:
    spec = SHAPES[request.param]
    args = ["--spec-steps", str(spec.num_steps), "--spec-topk", str(spec.topk)]
    args += ["--spec-tokens", str(spec.tree_size)]
    started = build_stack(
        target=FAMILY / "target",
        draft=FAMILY / "eagle3",
        draft_kind="eagle3",
        mtp_mode="chain",
        spec_args=args,
        page_size=16,
        device="cpu",
        dtype="float32",
        gateway_port=free_port(),
        target_port=free_port(),
        draft_port=free_port(),
        # Three processes share this machine's cores with the in-process reference: a late
        # draft answer costs steps without trees by design (their own counter), not what this
        # test is about.
        draft_deadline_s=10.0,
    )
    started.start(log_dir=tmp_path_factory.mktemp("logs"))
    yield request.param, started
    started.stop()


@pytest.mark.parametrize("concurrent", [1, 16])
def test_acceptance_through_the_services_equals_in_process(
    stack: tuple[str, Stack], concurrent: int
) -> None:
    shape, services = stack
    prompts = heldout(concurrent)
    expected, tokens = in_process(SHAPES[shape], prompts)
    gateway = next(s for s in services.services if s.name == "gateway")
    outputs = asyncio.run(through(gateway.port, prompts))
    assert [t for t, _ in outputs] == tokens
    usages = [u for _, u in outputs]
    steps = sum(u.verify_steps for u in usages)
    accept = (sum(u.accepted_tokens for u in usages) + steps) / steps
    without = {
        f.name: sum(getattr(u.steps_without_tree, f.name) for u in usages)
        for f in common_pb2.StepsWithoutTree.DESCRIPTOR.fields
    }
    assert sum(u.drafted_steps for u in usages) + sum(without.values()) == steps
    print(f"{shape} x{concurrent}: services {accept:.3f}, in process {expected:.3f}, {without}")
    assert abs(accept - expected) <= 0.02 * expected, (accept, expected, without)
