"""Batch invariance of the kernels a target runs under ``EngineConfig.batch_invariant``: a row's
projection (`kernels.skinny.linear`) and a token's attention (`tree_attention`) are
bit-identical whether computed alone or among other rows, and a token verified inside a chain
equals the same token decoded alone and prefilled. Interpreted on CPU (fp32/fp16), compiled on
the GPU (bf16 too)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels import skinny
from kernels.attention import _tree_attention_kernel, pack_tree_mask, tree_attention
from kernels.reference_attention import tree_attention_ref
from kernels.skinny import linear, skinny_linear
from tandem.attention.triton_backend import TritonAttention

check_mode(_tree_attention_kernel)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CUDA = DEVICE.type == "cuda"


def _chain_mask(q_len: int, device: torch.device) -> torch.Tensor:
    """Packed rows of a chain of ``q_len`` tokens: row i sees tree columns 0..i."""
    rows = torch.arange(q_len, device=device)
    dense = (rows[None, :] <= rows[:, None]).reshape(-1)
    return pack_tree_mask(
        dense,
        rows * q_len,
        torch.full((q_len,), q_len, dtype=torch.int64, device=device),
        1,
    )


class _Paged:
    """One request's KV (``length`` entries over scattered pages) plus filler requests, and
    queries for its last ``q_len`` tokens; launches in several batch shapes."""

    def __init__(self, *, length: int, heads: tuple[int, int], head_dim: int, page_size: int,
                 dtype: torch.dtype, seed: int) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        num_heads, num_kv_heads = heads
        self.page_size = page_size
        num_pages = 4 * (-(-length // page_size)) + 8
        slots = num_pages * page_size
        self.k = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        self.v = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        self.q = torch.randn(length, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
        self.perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
        self.length = length

    def run(self, reqs: list[tuple[int, int]], *, masked: bool = False, invariant: bool = True,
            splits: int = 1, ref: bool = False) -> list[torch.Tensor]:  # fmt: skip
        """``reqs``: (seq_len, q_len) per request, each querying the tokens seq_len - q_len ..
        seq_len - 1 over its own order of the KV pages (the same entries: fillers); ``masked``
        launches with chain masks (causal over the new tokens, as a verified chain sees),
        else causal without a mask. Returns each request's output rows."""
        pages_per_req = -(-self.length // self.page_size)
        table = torch.stack(
            [torch.roll(self.perm, -i * 3)[:pages_per_req] for i in range(len(reqs))]
        ).to(DEVICE)
        qs, cu = [self.q[s - n : s] for s, n in reqs], [0]
        for _, q_len in reqs:
            cu.append(cu[-1] + q_len)
        masks = [_chain_mask(q_len, DEVICE) for _, q_len in reqs]
        prefixes = [s - n for s, n in reqs]
        fn = tree_attention_ref if ref else tree_attention
        out = fn(
            torch.cat(qs),
            self.k,
            self.v,
            table,
            torch.tensor(cu, dtype=torch.int64, device=DEVICE),
            torch.tensor([r[0] for r in reqs], dtype=torch.int64, device=DEVICE),
            torch.tensor(prefixes, dtype=torch.int64, device=DEVICE) if masked else None,
            torch.cat(masks) if masked else None,
            scale=0.125,
            page_size=self.page_size,
            max_q_len=max(r[1] for r in reqs),
            num_splits=splits,
            batch_invariant=invariant,
        )
        return [out[a:b] for a, b in itertools.pairwise(cu)]


SHAPES = [  # (length, (heads, kv heads), head_dim, page size)
    (37, (4, 2), 16, 1),
    (70, (4, 1), 32, 16),
    (131, (2, 2), 16, 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"len{s[0]}-h{s[1][0]}x{s[1][1]}-p{s[3]}")
def test_a_token_attends_the_same_decoded_verified_or_prefilled(
    shape: tuple[int, tuple[int, int], int, int], dtype: torch.dtype
) -> None:
    length, heads, head_dim, page_size = shape
    paged = _Paged(length=length, heads=heads, head_dim=head_dim, page_size=page_size,
                   dtype=dtype, seed=length)  # fmt: skip
    width = 4  # a verified chain of S + 1 = 4 tokens: the last four of the request
    fillers = [(length - 5, 1), (length, 6)]
    verified = paged.run([(length, width), *fillers[:1]], masked=True)[0]
    verified_alone = paged.run([(length, width)], masked=True)[0]
    prefilled = paged.run([(length, length), *fillers])[0]
    for d in range(width):
        seq_len = length - width + 1 + d
        alone = paged.run([(seq_len, 1)])[0][0]
        batched = paged.run([*fillers, (seq_len, 1)][::-1])[0][0]
        masked = paged.run([(seq_len, 1), *fillers], masked=True)[0][0]
        for other in (batched, masked, verified[d], verified_alone[d], prefilled[seq_len - 1]):
            assert torch.equal(alone, other), d
    # And the values are attention's: the reference on the verified chain.
    want = paged.run([(length, width)], masked=True, ref=True)[0]
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(verified.float(), want.float(), **tol)


def test_the_comparison_sees_another_order_of_sums() -> None:
    """What the test above would see without the mode: two KV splits merge partial sums in
    another order, and the float32 outputs differ in their last bits."""
    paged = _Paged(length=131, heads=(4, 2), head_dim=16, page_size=16, dtype=torch.float32,
                   seed=2)  # fmt: skip
    alone = torch.cat([paged.run([(131 - 3 + d, 1)])[0] for d in range(4)])
    split = paged.run([(131, 4)], masked=True, invariant=False, splits=2)[0]
    torch.testing.assert_close(split, alone, rtol=1e-5, atol=1e-5)
    assert not torch.equal(split, alone)


def test_batch_invariant_needs_one_split() -> None:
    paged = _Paged(length=9, heads=(2, 1), head_dim=16, page_size=4, dtype=torch.float32, seed=1)
    for ref in (False, True):
        with pytest.raises(ValueError, match="batch_invariant: needs num_splits == 1"):
            paged.run([(9, 1)], splits=2, ref=ref)
    with pytest.raises(ValueError, match="batch_invariant: needs one split"):
        TritonAttention(num_splits=2, batch_invariant=True)
    assert TritonAttention(batch_invariant=True).num_splits == 1


def test_linear_off_cuda_is_f_linear_with_or_without_the_flag() -> None:
    x, w = torch.randn(5, 12), torch.randn(7, 12)
    assert torch.equal(linear(x, w, batch_invariant=True), torch.nn.functional.linear(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_linear_rows_are_bit_identical_at_any_batch(dtype: torch.dtype) -> None:
    """Under ``batch_invariant`` every row count runs the skinny GEMM (past 16 rows the
    default is cuBLAS, whose tiles and split-K follow the row count) and a row's output is the
    same alone, among 4 (a verify at bs 1), 64 or 300 rows (prefill), for both weight layouts,
    the lm_head's width and a long reduction (down_proj's)."""
    gen = torch.Generator().manual_seed(3)
    for n, k in ((1536, 1024), (4096, 1536), (32000, 1024), (512, 14336)):
        w = (torch.randn(n, k, generator=gen) / 32).to("cuda", dtype)
        for weight in (w, w.t().contiguous().t()):
            x = torch.randn(300, k, generator=gen).to("cuda", dtype)
            alone = torch.cat(
                [linear(x[i : i + 1], weight, batch_invariant=True) for i in range(8)]
            )
            for rows in (4, 64, 300):
                got = linear(x[:rows], weight, batch_invariant=True)
                assert torch.equal(got[: min(rows, 8)], alone[: min(rows, 8)]), (n, k, rows)
            config = skinny.invariant_config(n, dtype)
            assert torch.equal(got, skinny_linear(x, weight, **config))  # the kernel's path
            torch.testing.assert_close(
                got.float(), torch.nn.functional.linear(x, weight).float(), rtol=2e-2, atol=2e-2
            )
