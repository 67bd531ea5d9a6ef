"""The Triton `top1` and `topk` kernels against `top1_ref` and `topk_ref`.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (fp32 and fp16; it computes
bf16 wrongly): odd vocabularies and batches, every special row of `nasty_logits` (NaN, +inf,
all -inf, ties across tiles and splits), forced split counts. The `gpu` tests repeat this with
bf16 at 128K and 151,666 vocabularies, check ids against torch's argmax, and replay a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.reference import top1_ref, topk_ref
from kernels.top1 import _top1_partial_kernel, launch_top1, top1, topk
from tests.helpers.kernel_oracles import assert_logprobs_close, nasty_logits, oracle_topk

check_mode(_top1_partial_kernel)

NEG_INF = float("-inf")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def check_top1(logits: torch.Tensor, num_splits: int | None = None, atol: float = 1e-6) -> None:
    """Ids and validity exactly as `top1_ref`; log-probabilities within `atol` of fp64's."""
    ids, logprob, valid = launch_top1(logits, num_splits=num_splits)
    ref_ids, _, ref_valid = top1_ref(logits)
    vocab = logits.shape[1]
    assert ids.dtype == torch.int64 and logprob.dtype == torch.float32
    assert ((ids >= 0) & (ids < vocab)).all()
    assert torch.equal(valid, ref_valid) and torch.equal(ids, ref_ids)
    exact = torch.log_softmax(logits.double(), dim=-1).gather(1, ids[:, None])[:, 0]
    exact = torch.where(valid, exact, NEG_INF)
    assert torch.equal(logprob == NEG_INF, ~valid) and (logprob <= 0).all()
    assert ((logprob.double() - exact)[valid].abs() <= atol).all()


@pytest.mark.parametrize("vocab", [1, 3, 1000, 6007])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_top1_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    logits = nasty_logits(vocab, dtype, seed=vocab)[:11].to(DEVICE)  # an odd batch
    for num_splits in (None, 3) if vocab > 1000 else (None, 1, 3):
        check_top1(logits, num_splits)
    ids, _, valid = top1(logits)
    assert valid[[0, 1, 2, 6, 7, 8, 9]].all() and not valid[[3, 4, 5, 10]].any()
    assert ids[1] == 0 and ids[7] == 0 and ids[8] == vocab - 1


def test_top1_ties_across_splits_and_strided_rows() -> None:
    vocab = 3000
    wide = torch.randn(5, vocab + 7, generator=torch.Generator().manual_seed(1))
    logits = wide[:, 3 : vocab + 3]  # row stride != vocab
    logits[0, [2999, 1500, 10]] = 9.0  # three splits tie: the lowest index wins
    logits[1, 2048:] = 9.0  # the tie starts at a tile boundary
    logits[2, 0] = 9.0
    logits = logits.to(DEVICE)
    for num_splits in (None, 2, 3, 4):
        check_top1(logits, num_splits)
    assert top1(logits)[0].tolist()[:3] == [10, 2048, 0]
    check_top1(logits.t().contiguous().t())  # unit stride along rows only: copied


@pytest.mark.parametrize(
    ("vocab", "ks", "dtype"),
    [
        (3, (1, 3), torch.float32),
        (3, (1, 3), torch.float16),
        (1000, (1, 6), torch.float32),
        (1000, (3,), torch.float16),
    ],
)
def test_topk_matches_reference(vocab: int, ks: tuple[int, ...], dtype: torch.dtype) -> None:
    logits = nasty_logits(vocab, dtype, seed=vocab + 1)[:11].to(DEVICE)
    for k in ks:
        ids, logprobs, valid = topk(logits, k)
        ref_ids, _, ref_valid = topk_ref(logits.cpu(), k)
        assert ids.shape == logprobs.shape == (11, k)
        assert ((ids >= 0) & (ids < vocab)).all()
        assert torch.equal(valid.cpu(), ref_valid) and torch.equal(ids.cpu(), ref_ids)
        _, oracle, _ = oracle_topk(logits.cpu(), k)
        assert_logprobs_close(logprobs.cpu(), oracle, fp32_ulps=1)
    one_ids, one_logprobs, _ = topk(logits, 1)
    top_ids, top_logprob, _ = top1(logits)
    assert torch.equal(one_ids[:, 0], top_ids)
    assert torch.allclose(one_logprobs[:, 0], top_logprob, atol=1e-6, rtol=0)


def test_topk_large_k_is_the_reference() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ids, logprobs, _ = topk(logits, 40)
    ref = topk_ref(logits, 40)
    assert torch.equal(ids, ref[0]) and torch.equal(logprobs, ref[1])


def test_top1_rejects_what_the_reference_rejects() -> None:
    cases = [
        (lambda f: f(torch.zeros(2, 5, dtype=torch.int64, device=DEVICE)), "floating"),
        (lambda f: f(torch.zeros(5, device=DEVICE)), "shape"),
        (lambda f: f(torch.zeros(2, 5, device=DEVICE), chunk_size=0), "chunk_size"),
        (lambda f: f(torch.zeros(2, 0, device=DEVICE)), "vocabulary"),
    ]
    for call, match in cases:
        for fn in (top1, top1_ref):
            with pytest.raises(ValueError, match=match):
                call(fn)
    for k_fn in (topk, topk_ref):
        with pytest.raises(ValueError, match="k must be"):
            k_fn(torch.zeros(2, 5, device=DEVICE), 6)


def test_empty_batch() -> None:
    ids, logprob, valid = top1(torch.zeros(0, 7, device=DEVICE))
    assert ids.shape == logprob.shape == valid.shape == (0,)


# ----------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("vocab", [128256, 151666])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_top1_large_vocab_on_cuda(vocab: int, dtype: torch.dtype) -> None:
    for rows in (1, 7, 64, 300):
        g = torch.Generator(device="cuda").manual_seed(rows)
        logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype)
        if rows > 8:
            logits[3, vocab // 2 :] = logits[3].max()  # a tie spanning many splits
        ids, logprob, valid = top1(logits)
        assert valid.all()
        assert torch.equal(ids, logits.argmax(dim=-1))  # torch: first index of the max
        ref = torch.log_softmax(logits.double(), dim=-1).gather(1, ids[:, None])[:, 0]
        assert (logprob.double() - ref).abs().max() <= 5e-6
    check_top1(nasty_logits(vocab, dtype, seed=3).cuda(), atol=5e-6)


@pytest.mark.gpu
@gpu
def test_topk_large_vocab_on_cuda() -> None:
    logits = nasty_logits(128256, torch.bfloat16, seed=4).cuda()
    for k in (1, 4, 10, 32):
        ids, logprobs, valid = topk(logits, k)
        ref_ids, ref_logprobs, ref_valid = topk_ref(logits, k)
        assert torch.equal(ids, ref_ids) and torch.equal(valid, ref_valid)
        finite = ref_logprobs > NEG_INF
        assert torch.equal(finite, logprobs > NEG_INF)
        assert (logprobs - ref_logprobs)[finite].abs().max() <= 1e-5


@pytest.mark.gpu
@gpu
def test_top1_replays_in_a_cuda_graph() -> None:
    logits = torch.randn(8, 128256, device="cuda", dtype=torch.bfloat16)
    top1(logits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, logprob, valid = top1(logits)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    want = top1(logits)
    assert torch.equal(ids, want[0]) and torch.equal(logprob, want[1])
    assert torch.equal(valid, want[2])
