"""The fused decoder-layer kernels (`rms_norm`, `add_rms_norm`, `rope`, `silu_mul`) against
their references, the eager torch formulas: odd token counts and widths, GQA head counts,
strided views of fused projections, validation errors; the model's forward (target and
drafts) with the kernels equals its torch path.

What is asserted (`kernels/fused.py` docstring for why):
- everywhere: `rope` equal to the reference bit for bit (fp32, fp16); `add_rms_norm`'s new
  residual bit for bit;
- interpreted (CPU, fp32/fp16): `rms_norm`/`add_rms_norm`/`silu_mul` within float32 rounding
  (fp32) or 2 ulps (fp16, `assert_close`); numpy's exp and reduction order are not torch's;
- `gpu` (compiled, bf16/fp16/fp32): `rope` and `silu_mul` equal to the eager formulas bit for
  bit; `rms_norm`/`add_rms_norm` equal bit for bit on inputs whose sum of squares is exact in
  float32 in any order, and within 2 ulps of the output dtype on random inputs (new residual:
  bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
import kernels
from kernels.fused import _rms_norm_kernel, add_rms_norm, rms_norm, rope, silu_mul
from kernels.reference_fused import add_rms_norm_ref, rms_norm_ref, rope_ref, silu_mul_ref
from tandem.attention import AttentionMetadata, TorchAttention
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import ForwardContext, decoder, load_model
from tandem.models.draft import DraftModule
from tandem.models.draft_loader import load_eagle, load_eagle3, load_mtp
from tandem.models.eagle import Eagle3Module
from tandem.testing.random_drafts import (
    make_eagle3_checkpoint,
    make_eagle_checkpoint,
    make_mtp_checkpoint,
)
from tests.checkpoints import ARCHS, make_checkpoint

check_mode(_rms_norm_kernel)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
T = TypeVar("T")

EPS = 1e-6
DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, ulps: float = 2.0) -> None:
    """fp32: within float32 rounding; 16-bit: within `ulps` units in the last place of the
    output. Two by default: a one-ulp difference in an intermediate rounding (the normalised x
    before the weight, the silu before up) can grow to two in the product after it."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        return
    info = torch.finfo(expected.dtype)
    e = expected.double()
    binade = torch.exp2(torch.floor(torch.log2(e.abs().clamp_min(info.tiny))))
    err = ((actual.double() - e).abs() / (binade * info.eps)).max().item()
    assert err <= ulps, f"{err} ulps"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 24), (3, 136), (17, 64), (2, 4096)])
def test_rms_norms_match_reference(num_tokens: int, hidden: int, dtype: torch.dtype) -> None:
    wide = rand(num_tokens, hidden + 8, dtype=dtype, seed=hidden, scale=3.0)
    x = wide[:, 3 : 3 + hidden]  # a row-strided view
    residual = rand(num_tokens, hidden, dtype=dtype, seed=1)
    weight = rand(hidden, dtype=dtype, seed=2)
    assert_close(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    normed, new_residual = add_rms_norm(x, residual, weight, EPS)
    normed_ref, new_residual_ref = add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(new_residual, new_residual_ref)
    assert_close(normed, normed_ref)
    assert normed.is_contiguous() and new_residual.data_ptr() != residual.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_heads_of_a_fused_projection(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: [num_tokens, heads, head_dim] sliced out of the QKV output."""
    qkv = rand(5, (6 + 2 * 2) * 16, dtype=dtype, seed=3)
    q = qkv[:, : 6 * 16].reshape(5, 6, 16)
    weight = rand(16, dtype=dtype, seed=4)
    out = rms_norm(q, weight, EPS)
    assert out.shape == q.shape
    assert_close(out, rms_norm_ref(q, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
    [(1, 4, 2, 16), (3, 8, 1, 64), (17, 6, 3, 64), (2, 5, 5, 24)],
)
def test_rope_equals_reference(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = rand(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=head_dim, scale=2.0)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)  # strided views, as Attention has them
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    angles = rand(num_tokens, head_dim, dtype=torch.float32, seed=5, scale=3.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_out, k_out = rope(q, k, cos, sin)
    q_ref, k_ref = rope_ref(q, k, cos, sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert q_out.is_contiguous() and k_out.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "inter"), [(1, 24), (3, 136), (17, 1500)])
def test_silu_mul_matches_reference(num_tokens: int, inter: int, dtype: torch.dtype) -> None:
    wide = rand(num_tokens, 2 * inter + 6, dtype=dtype, seed=inter, scale=4.0)
    gate_up = wide[:, : 2 * inter]  # row-strided
    assert_close(silu_mul(gate_up), silu_mul_ref(gate_up))


def test_wrappers_name_the_bad_argument() -> None:
    x, w = rand(3, 8, dtype=torch.float32, seed=0), rand(8, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w.half(), EPS)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:7], EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, x[:2], w, EPS)
    with pytest.raises(ValueError, match="x"):
        rms_norm(x.double(), w.double(), EPS)
    q, cos = rand(2, 4, 6, dtype=torch.float32, seed=2), rand(2, 6, dtype=torch.float32, seed=3)
    with pytest.raises(ValueError, match="k"):
        rope(q, q[:, :, :4], cos, cos)
    with pytest.raises(ValueError, match="sin"):
        rope(q, q, cos, cos[:1])
    with pytest.raises(ValueError, match="sin"):
        rope(q, q, cos, cos.half())
    with pytest.raises(ValueError, match="odd"):
        rope(q[:, :, :5], q[:, :, :5], cos[:, :5], cos[:, :5])
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(x[:, :7])
    for ref_call in (lambda: rms_norm_ref(x, w[:7], EPS), lambda: silu_mul_ref(x[:, :7])):
        with pytest.raises(ValueError):
            ref_call()


# --- the model with the kernels -------------------------------------------------------------


def context(num_layers: int, num_kv_heads: int, head_dim: int, lens: list[int]) -> ForwardContext:
    """A fresh paged KV and one prefill step of requests with `lens` tokens (causal)."""
    spec = KVCacheSpec(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=4,
        dtype=torch.float32,
        device=DEVICE,
    )
    kv = KVCache(spec, 32)
    req_ids = [f"r{i}" for i in range(len(lens))]
    for req_id, n in zip(req_ids, lens, strict=True):
        kv.allocator.allocate(req_id, n)
    meta = AttentionMetadata.build(
        page_size=4,
        query_lens=lens,
        seq_lens=lens,
        page_table=kv.allocator.page_table(req_ids, device=DEVICE),
        slot_mapping=kv.slot_mapping_tensor(req_ids, [0] * len(lens), lens),
    )
    return ForwardContext(kv=kv, meta=meta, backend=TorchAttention())


def run_on(monkeypatch: pytest.MonkeyPatch, ops: kernels.Ops, run: Callable[[], T]) -> T:
    """`run()` with every fused op of the model on `ops` (the kernels are interpreted on CPU)."""
    with monkeypatch.context() as m:
        m.setattr(decoder, "fused_ops", lambda *tensors: ops)
        return run()


def test_fused_ops_picks_the_kernels_only_where_they_may_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, w = torch.randn(2, 8), torch.nn.Parameter(torch.ones(8))
    monkeypatch.setattr(kernels, "uses_triton", lambda device: False)
    assert decoder.fused_ops(x) is kernels.REFERENCE
    monkeypatch.setattr(kernels, "uses_triton", lambda device: True)  # as on CUDA
    with torch.inference_mode():
        assert decoder.fused_ops(x, w) is kernels.triton_ops()
    assert decoder.fused_ops(x, w) is kernels.REFERENCE  # autograd would record the op
    with torch.no_grad():
        assert decoder.fused_ops(x, w) is kernels.triton_ops()
        assert decoder.fused_ops(x, w.half()) is kernels.REFERENCE  # mixed dtypes
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            assert decoder.fused_ops(x, w) is kernels.REFERENCE


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_forward_with_kernels_equals_torch_path(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(make_checkpoint(tmp_path, arch, tokenizer=False), device=DEVICE)
    c = model.config
    lens = [7, 1, 3]
    ids = torch.randint(0, c.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    capture = (0, 1, c.num_layers - 1, c.num_layers)

    def run() -> tuple[Any, KVCache]:
        ctx = context(c.num_layers, c.num_kv_heads, c.head_dim, lens)
        with torch.inference_mode():
            return model(ids.to(DEVICE), positions, ctx, capture), ctx.kv

    ours, kv = run_on(monkeypatch, kernels.triton_ops(), run)
    ref, ref_kv = run_on(monkeypatch, kernels.REFERENCE, run)
    torch.testing.assert_close(ours.hidden, ref.hidden, rtol=1e-4, atol=1e-5)
    assert torch.equal(ours.captured[0], ref.captured[0])  # the embedding
    for got, want in zip(ours.captured, ref.captured, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for got, want in zip(kv.k_caches, ref_kv.k_caches, strict=True):  # roped K in the cache
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_draft_forwards_with_kernels_equal_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = make_checkpoint(tmp_path / "t", "llama", tokenizer=False)
    modules = [
        load_eagle3(make_eagle3_checkpoint(tmp_path / "e3", target, seed=1), target),
        load_eagle(make_eagle_checkpoint(tmp_path / "e1", target, seed=2), target),
        *load_mtp(make_mtp_checkpoint(tmp_path / "mtp", target, num_heads=1, seed=3), target),
    ]
    lens = [5, 2]
    gen = torch.Generator().manual_seed(0)
    for module in modules:
        module.to(DEVICE)
        ids = torch.randint(0, 1000, (sum(lens),), generator=gen).to(DEVICE)
        positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
        width = module.fc.in_features if isinstance(module, Eagle3Module) else module.hidden_size
        features = torch.randn(sum(lens), width, generator=gen).to(DEVICE)

        def run(
            module: DraftModule = module,
            inputs: tuple[torch.Tensor, ...] = (ids, features, positions),
        ) -> Any:
            ctx = context(1, module.num_kv_heads, module.head_dim, lens)
            token_ids, features, positions = inputs
            with torch.inference_mode():
                out = module(token_ids, module.project_target(features), positions, ctx)
                return out, module.compute_logits(out)

        out, logits = run_on(monkeypatch, kernels.triton_ops(), run)
        out_ref, logits_ref = run_on(monkeypatch, kernels.REFERENCE, run)
        torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-5)


# --- compiled on a GPU: bit-exactness against the eager formulas ------------------------------


def exact_sum_input(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Multiples of 1/8 in [-1, 1]: squares are multiples of 1/64 and any partial sum of up to
    2**14 of them is exact in float32, so the reduction order cannot change the mean square."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=g) / 8).to(dtype).to(DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 4096), (3, 136), (64, 4096)])
def test_gpu_rms_norms_are_exact_but_for_the_reduction(
    num_tokens: int, hidden: int, dtype: torch.dtype
) -> None:
    x = exact_sum_input(num_tokens, hidden, dtype=dtype, seed=0) / 2
    residual = exact_sum_input(num_tokens, hidden, dtype=dtype, seed=1) / 2
    weight = rand(hidden, dtype=dtype, seed=2)
    assert torch.equal(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    got, want = add_rms_norm(x, residual, weight, EPS), add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x = rand(num_tokens, hidden, dtype=dtype, seed=3)
    residual = rand(num_tokens, hidden, dtype=dtype, seed=4)
    assert_close(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    got, want = add_rms_norm(x, residual, weight, EPS), add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(got[1], want[1])
    assert_close(got[0], want[0])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 17, 64])
def test_gpu_rope_and_silu_mul_are_bit_exact(num_tokens: int, dtype: torch.dtype) -> None:
    heads, kv_heads, dim, inter = 32, 8, 128, 14336
    qkv = rand(num_tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=0, scale=3.0)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(num_tokens, heads, dim), k.reshape(num_tokens, kv_heads, dim)
    angles = torch.arange(num_tokens, device=DEVICE)[:, None] * torch.rand(dim, device=DEVICE)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for got, want in zip(rope(q, k, cos, sin), rope_ref(q, k, cos, sin), strict=True):
        assert torch.equal(got, want)
    gate_up = rand(num_tokens, 2 * inter, dtype=dtype, seed=1, scale=6.0)
    assert torch.equal(silu_mul(gate_up), silu_mul_ref(gate_up))


@pytest.mark.gpu
@gpu
def test_gpu_offsets_past_2_31_elements() -> None:
    hidden = 4096
    rows = 2**31 // hidden + 3
    x = torch.empty(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    x[-3:] = rand(3, hidden, dtype=torch.bfloat16, seed=0)
    weight = rand(hidden, dtype=torch.bfloat16, seed=1)
    assert_close(rms_norm(x, weight, EPS)[-3:], rms_norm_ref(x[-3:], weight, EPS))
    del x
    gate_up = torch.empty(rows, 2 * hidden, dtype=torch.bfloat16, device=DEVICE)
    gate_up[-3:] = rand(3, 2 * hidden, dtype=torch.bfloat16, seed=2)
    assert torch.equal(silu_mul(gate_up)[-3:], silu_mul_ref(gate_up[-3:]))
