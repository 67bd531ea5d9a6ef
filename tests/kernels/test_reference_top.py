"""The plain-torch top1/topk references (`kernels/reference.py`) against an independent
oracle: softmax in fp64 and a Python sort, on logits with every special row."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import top1_ref, topk_ref
from tests.helpers.kernel_oracles import I64, assert_logprobs_close, nasty_logits, oracle_topk

# Thousands of sequential chunks drift past 1e-6 in fp32, so chunks of 2 only on tiny vocabularies.
VOCAB_CHUNKS = [(v, c) for v in (6000, 6007) for c in (4096, 1000, 64)] + [
    (v, c) for v in (1, 3) for c in (4096, 2)
]


@pytest.mark.parametrize(("vocab", "chunk_size"), VOCAB_CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top1_matches_softmax(vocab: int, dtype: torch.dtype, chunk_size: int) -> None:
    logits = nasty_logits(vocab, dtype, seed=vocab)
    ids, logprob, valid = top1_ref(logits, chunk_size=chunk_size)
    ref_ids, ref_logprobs, ref_valid = oracle_topk(logits, 1)
    assert ids.dtype == I64 and valid.dtype == torch.bool
    assert ((ids >= 0) & (ids < vocab)).all()
    assert torch.equal(valid, ref_valid)
    assert torch.equal(ids, ref_ids[:, 0])
    assert_logprobs_close(logprob, ref_logprobs[:, 0])
    assert valid[[0, 1, 2, 6, 7, 8, 9]].all() and not valid[[3, 4, 5, 10]].any()
    assert ids[1] == 0 and ids[7] == 0 and ids[8] == vocab - 1


@pytest.mark.parametrize("vocab", [6007, 3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunk_size", [4096, 64])
def test_topk_matches_softmax(vocab: int, dtype: torch.dtype, chunk_size: int) -> None:
    logits = nasty_logits(vocab, dtype, seed=vocab + 1)
    k_max = vocab if vocab < 10 else 64
    all_ids, all_logprobs, ref_valid = oracle_topk(logits, k_max)
    for k in sorted({1, min(5, vocab), k_max}):
        ids, logprobs, valid = topk_ref(logits, k, chunk_size=chunk_size)
        ref_ids = all_ids[:, :k]  # invalid rows: arange(k_max)[:k]
        ref_logprobs = all_logprobs[:, :k]
        assert ids.shape == logprobs.shape == (len(logits), k)
        assert ((ids >= 0) & (ids < vocab)).all()
        assert torch.equal(valid, ref_valid)
        assert torch.equal(ids, ref_ids)
        assert_logprobs_close(logprobs, ref_logprobs, fp32_ulps=1)
        assert torch.equal(ids[~valid], torch.arange(k).expand(int((~valid).sum()), k))
    one_ids, one_logprobs, one_valid = topk_ref(logits, 1, chunk_size=chunk_size)
    top_ids, top_logprob, top_valid = top1_ref(logits, chunk_size=chunk_size)
    assert torch.equal(one_ids[:, 0], top_ids) and torch.equal(one_logprobs[:, 0], top_logprob)
    assert torch.equal(one_valid, top_valid)


def test_top_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k must be"):
        topk_ref(torch.zeros(2, 5), 6)
    with pytest.raises(ValueError, match="k must be"):
        topk_ref(torch.zeros(2, 5), 0)
    with pytest.raises(ValueError, match="floating"):
        top1_ref(torch.zeros(2, 5, dtype=I64))
    with pytest.raises(ValueError, match="shape"):
        top1_ref(torch.zeros(5))
    with pytest.raises(ValueError, match="chunk_size"):
        top1_ref(torch.zeros(2, 5), chunk_size=0)
