"""No Triton kernel compiles mid-serving on CUDA.

Compiling a kernel variant takes about a second, during which every running request waits
(run R of docs/performance.md: a 1.0 s step in a measured bench row, the first prompt to arrive
while other requests verified trees). After the target service's warm-up, an engine that
speculates through CUDA graphs serves prompts of 1 to 300 tokens arriving while others verify
trees, at changing batch sizes, without one new compiled variant of any kernel.
"""

from __future__ import annotations

import importlib
import random

import pytest

from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from target_service.__main__ import warm_up
from tests.driving import Arrival, drive
from tests.spec.conftest import LAYERS, VOCAB, Checkpoints

pytestmark = pytest.mark.gpu

MODULES = ("attention", "fused", "kv", "sample", "top1", "tree")  # kernels.*
PROMPT_LENS = (1, 5, 17, 40, 70, 129, 300)  # query tiles of every size, masks of 1-5 words


def compiled_variants() -> dict[str, list[str]]:
    """The specialisation keys compiled for each Triton kernel in ``kernels``, every device."""
    import triton  # here: importing kernels before tests.kernels._interpret breaks CPU runs

    out: dict[str, list[str]] = {}
    for module in (importlib.import_module(f"kernels.{name}") for name in MODULES):
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.JITFunction):
                # each entry starts with the kernel cache: specialisation key -> compiled kernel
                keys = [str(k) for entry in value.device_caches.values() for k in entry[0]]
                out[f"{module.__name__}.{name}"] = keys
    return out


def new_variants(before: dict[str, list[str]], after: dict[str, list[str]]) -> dict[str, list[str]]:
    return {
        name: [k for k in keys if k not in before.get(name, [])]
        for name, keys in after.items()
        if len(keys) != len(before.get(name, []))
    }


def plan() -> list[Arrival]:
    rng = random.Random(5)
    lens = [n for n in PROMPT_LENS for _ in range(3)]
    rng.shuffle(lens)
    return [
        Arrival(
            step=3 * i,
            prompt=[rng.randrange(3, VOCAB) for _ in range(n)],
            max_new_tokens=rng.randint(8, 40),
            temperature=0.8 if i % 3 == 0 else 0.0,  # sampled requests beside greedy ones
        )
        for i, n in enumerate(lens)
    ]


@pytest.mark.parametrize(("topk", "num_steps", "num_draft_tokens"), [(1, 3, 4), (4, 5, 16)])
def test_nothing_compiles_after_the_warm_up(
    ckpts: Checkpoints, topk: int, num_steps: int, num_draft_tokens: int
) -> None:
    drafter = build_drafter(
        DraftConfig(kind="eagle3", path=ckpts.drafts["eagle3"], target=ckpts.target, device="cuda"),
        LAYERS,
    )
    engine = Engine(
        EngineConfig(model=ckpts.target, device="cuda", page_size=16),
        drafter=drafter,
        spec=SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens),
    )
    warm_up(engine)
    before = compiled_variants()
    assert sum(map(len, before.values())) > 0
    outputs, steps = drive(engine, plan())
    assert len(outputs) == 3 * len(PROMPT_LENS) and steps > 40
    assert new_variants(before, compiled_variants()) == {}
