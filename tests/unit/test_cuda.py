"""The runtime on a CUDA device: float32 matches transformers there too, greedy generation is
identical, and bfloat16 stays within bfloat16's error of the float32 reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.target.engine import Engine
from tests.checkpoints import ARCHS, hf_greedy, make_checkpoint
from tests.helpers.engine import ragged_prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=21)


def hf_on(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.to("cuda").eval()


def prefill_logits(eng: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Full-prompt logits from one ragged prefill through the engine's runner."""
    from tandem.request import Request
    from tandem.target.scheduler import ScheduledBatch

    batch = ScheduledBatch()
    for i, p in enumerate(prompts):
        req = Request(request_id=f"p{i}", prompt_ids=p, params=SamplingParams())
        eng.kv.allocator.allocate(req.request_id, len(p))
        batch.requests.append(req)
        batch.num_new_tokens.append(len(p))
    inputs = eng.runner.prepare(batch)
    inputs.logits_indices = torch.arange(inputs.input_ids.numel(), device="cuda")
    logits = eng.runner.forward(inputs).logits
    for i in range(len(prompts)):
        eng.kv.allocator.free(f"p{i}")
    return list(logits.split([len(p) for p in prompts]))


def test_float32_on_cuda_matches_transformers(ckpt: Path) -> None:
    eng = Engine(EngineConfig(model=ckpt, device="cuda", page_size=16))
    prompts = ragged_prompts(eng.model.config.vocab_size)
    hf = hf_on(ckpt, torch.float32)
    for p, got in zip(prompts, prefill_logits(eng, prompts), strict=True):
        with torch.inference_mode():
            ref = hf(torch.tensor([p], device="cuda")).logits[0].float()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    results = eng.generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == hf_greedy(ckpt, prompts, 32)


def test_bfloat16_error_is_that_of_bfloat16(ckpt: Path) -> None:
    eng = Engine(EngineConfig(model=ckpt, device="cuda", dtype="bfloat16", page_size=16))
    prompts = ragged_prompts(eng.model.config.vocab_size)
    hf32, hf16 = hf_on(ckpt, torch.float32), hf_on(ckpt, torch.bfloat16)
    for p, got in zip(prompts, prefill_logits(eng, prompts), strict=True):
        ids = torch.tensor([p], device="cuda")
        with torch.inference_mode():
            ref = hf32(ids).logits[0].float()
            hf_err = (hf16(ids).logits[0].float() - ref).abs().max().item()
        our_err = (got - ref).abs().max().item()
        # Ours keeps softmax and RoPE in float32, so it should be no worse than transformers'.
        assert our_err <= 2 * hf_err + 1e-2, (our_err, hf_err)
