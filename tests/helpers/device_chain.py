"""What the device-chain tests share (in process and through a draft service): the batch
sizes its buckets cover, a plan of arrivals that starts and ends runs, the target's buckets
run eagerly on their static buffers, and target-only references."""

from __future__ import annotations

import pytest

from tests.kernels._interpret import DEVICE  # sets Triton's mode: import first

# isort: split
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.target.engine import Engine
from tandem.target.graphs import graph_widths
from tests.driving import Arrival, arrivals, drive
from tests.spec.conftest import VOCAB, Checkpoints

BATCH_SIZES = (1, 2, 4)
# A request alone first (a long run), then arrivals that end runs and pad batches.
PLAN = [
    Arrival(step=0, prompt=[5, 9, 17, 4, 250, 31], max_new_tokens=56),
    *(
        Arrival(step=a.step + 10, prompt=a.prompt, max_new_tokens=a.max_new_tokens)
        for a in arrivals(3, VOCAB, every=8, new_tokens=(6, 36), seed=3)
    ),
]


def static_target_buckets(engine: Engine, num_steps: int, layers: tuple[int, ...]) -> None:
    """The target's graph buckets for chains of ``num_steps``, run eagerly on their static
    buffers (the CPU stand-in for CUDA graphs)."""
    engine.runner.enable_graphs(
        batch_sizes=BATCH_SIZES,
        widths=graph_widths(num_steps + 1),
        max_model_len=engine.max_model_len,
        capture_layers=layers,
        capture=False,
    )


@pytest.fixture(scope="module")
def reference(ckpts: Checkpoints) -> list[list[int]]:
    """Target-only greedy outputs of ``PLAN``."""
    config = EngineConfig(model=ckpts.target, device=str(DEVICE), num_pages=256, cuda_graphs=False)
    return drive(Engine(config), PLAN)[0]


def reference_tokens(ckpts: Checkpoints, prompt: list[int], num: int) -> list[int]:
    """Target-only greedy continuation of ``prompt``."""
    config = EngineConfig(model=ckpts.target, device=str(DEVICE), num_pages=64, cuda_graphs=False)
    params = SamplingParams(max_new_tokens=num, ignore_eos=True)
    return Engine(config).generate([prompt], params)[0].token_ids
