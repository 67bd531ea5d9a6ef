"""The Triton `sample` kernel against `sample_ref` (and `tandem.sampling.sample` on CUDA).

Greedy rows must match exactly (torch's argmax, NaN first). Sampled rows run the race in the
log domain (x - log E) where the reference divides softmax probabilities by E: the same
argmax in exact arithmetic, so a differing id is allowed only where both candidates' race
values tie to within rounding. Without CUDA the kernel runs interpreted (fp32, fp16).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.reference import sample_ref
from kernels.sample import _sample_partial_kernel, sample
from tests.helpers.kernel_oracles import nasty_logits

check_mode(_sample_partial_kernel)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TINY = torch.finfo(torch.float32).tiny


def exp_noise(rows: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    noise = torch.empty(rows, vocab, device=device).exponential_(generator=g)
    return noise.clamp_(min=TINY)


def assert_same_draws(
    ids: torch.Tensor, ref: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor,
    noise: torch.Tensor,
) -> None:  # fmt: skip
    vocab = logits.shape[1]
    assert ids.dtype == torch.int64 and ((ids >= 0) & (ids < vocab)).all()
    greedy = temperature <= 0
    assert torch.equal(ids[greedy], ref[greedy])
    differ = (ids != ref).nonzero()[:, 0]
    race = logits.double() - noise.double().log()  # [R, V] the race in exact-ish arithmetic
    for r in differ.tolist():
        a, b = race[r, ids[r]], race[r, ref[r]]
        assert abs(float(a - b)) <= 1e-5 * max(1.0, abs(float(b))), (r, ids[r], ref[r])
    assert len(differ) <= max(1, len(ids) // 100)  # ties are rare, not the rule


@pytest.mark.parametrize("vocab", [1, 3, 1000, 6007])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sample_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    logits = nasty_logits(vocab, dtype, seed=vocab).to(DEVICE)
    rows = logits.shape[0]
    temperature = torch.tensor([0.0, 0.7] * (rows // 2), device=DEVICE)
    for seed in range(2):  # each special row both greedy and sampled
        noise = exp_noise(rows, vocab, seed, DEVICE)
        ids = sample(logits[: rows - 1], temperature[: rows - 1], noise[: rows - 1])  # odd batch
        ref = sample_ref(logits[: rows - 1], temperature[: rows - 1], noise[: rows - 1])
        assert_same_draws(ids, ref, logits[: rows - 1], temperature[: rows - 1], noise[: rows - 1])
        temperature = temperature.roll(1)
    # Broken rows: all -inf (3), a NaN (4), +inf (5), all NaN (10).
    both = sample(logits, torch.ones(rows, device=DEVICE), noise)
    assert both[[3, 4, 5, 10]].tolist() == [0, 0, 0, 0]
    greedy = sample(logits, torch.zeros(rows, device=DEVICE), noise)
    assert torch.equal(greedy, logits.float().argmax(dim=-1))


def test_sample_never_draws_filtered_tokens() -> None:
    vocab = 700
    logits = torch.full((5, vocab), float("-inf"), device=DEVICE)
    logits[:, [3, 350, 699]] = torch.tensor([0.0, 1.0, 2.0], device=DEVICE)
    noise = exp_noise(5, vocab, 7, DEVICE)
    noise[:, :10] = TINY  # huge weights on filtered and allowed tokens alike
    ids = sample(logits, torch.ones(5, device=DEVICE), noise)
    assert torch.equal(ids, sample_ref(logits, torch.ones(5, device=DEVICE), noise))
    assert (ids == 3).all()  # the only allowed token with a tiny E


def test_sample_rejects_what_the_reference_rejects() -> None:
    x = torch.zeros(2, 5, device=DEVICE)
    for fn in (sample, sample_ref):
        with pytest.raises(ValueError, match="temperature"):
            fn(x, torch.zeros(3, device=DEVICE), x)
        with pytest.raises(ValueError, match="noise"):
            fn(x, torch.zeros(2, device=DEVICE), x[:, :4])
        with pytest.raises(ValueError, match="floating"):
            fn(x.long(), torch.zeros(2, device=DEVICE), x)


# ----------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sample_large_vocab_on_cuda(dtype: torch.dtype) -> None:
    vocab, rows = 128256, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).to(dtype)
    logits[::3, ::2] = float("-inf")
    temperature = torch.tensor([0.0, 1.0, 0.5, 2.0] * (rows // 4), device="cuda")
    noise = exp_noise(rows, vocab, 1, torch.device("cuda"))
    ids = sample(logits, temperature, noise)
    assert_same_draws(ids, sample_ref(logits, temperature, noise), logits, temperature, noise)
    assert (logits[torch.arange(rows), ids] > float("-inf")).all()


@pytest.mark.gpu
@gpu
def test_sample_distribution_on_cuda() -> None:
    """Chi-square of 200k draws against softmax(x): well below the 1e-3 critical value."""
    vocab, draws = 16, 200_000
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(vocab, device="cuda", generator=g)
    x[3] = float("-inf")
    ids = sample(x.expand(draws, vocab), torch.ones(draws, device="cuda"), exp_noise(
        draws, vocab, 9, torch.device("cuda")))  # fmt: skip
    counts = torch.bincount(ids, minlength=vocab).double()
    expected = draws * torch.softmax(x.double(), dim=0)
    assert counts[3] == 0
    keep = expected > 0
    chi2 = float(((counts - expected)[keep] ** 2 / expected[keep]).sum())
    assert chi2 < 36.12  # chi-square with 14 degrees of freedom: upper 0.001 quantile


@pytest.mark.gpu
@gpu
def test_sample_replays_in_a_cuda_graph() -> None:
    logits = torch.randn(4, 128256, device="cuda")
    temperature = torch.tensor([0.0, 1.0, 1.0, 0.0], device="cuda")
    noise = exp_noise(4, 128256, 2, torch.device("cuda"))
    sample(logits, temperature, noise)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = sample(logits, temperature, noise)
    noise.copy_(exp_noise(4, 128256, 3, torch.device("cuda")))
    graph.replay()
    assert torch.equal(ids, sample(logits, temperature, noise))
