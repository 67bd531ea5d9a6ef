"""The Triton tree-attention kernel against its torch twins, interpreted on CPU tensors.

``TritonAttention`` against ``TorchAttention`` on the runtime's own metadata (ragged causal
batches, verify trees up to 64 nodes mixed with prompt chunks and decodes, draft scratch masks
wider than one mask word, forced KV splits), and the functional ``tree_attention`` against
``tree_attention_ref`` (split counts, all-masked rows, odd page sizes and head dims). Without
CUDA the kernels run in Triton's interpreter on CPU tensors (fp32 and fp16: it computes bf16
wrongly); tests/kernels/test_attention_gpu.py repeats this on CUDA with bigger shapes, bf16, a
CUDA graph, int64 offsets and whole-model forwards.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.attention import (
    _tree_attention_kernel,
    default_num_splits,
    pack_tree_mask,
    tree_attention,
)
from kernels.reference_attention import pack_tree_mask_ref, tree_attention_ref
from tandem.attention import TorchAttention, backend_for
from tandem.attention.triton_backend import (
    TritonAttention,
    compile_variants,
    launch_variants,
    mask_inputs,
)
from tests.helpers.attention import (
    Req,
    Shape,
    assert_close,
    compare_backends,
    functional_inputs,
    make_kv,
    make_meta,
    scratch_req,
    tree_req,
)

check_mode(_tree_attention_kernel)


INTERPRETED_SHAPES = [
    Shape(1, 4, 2, 32, torch.float32),
    Shape(16, 8, 1, 64, torch.float16),
    Shape(16, 4, 2, 64, torch.float32),
    Shape(1, 8, 1, 32, torch.float16),
    Shape(5, 6, 2, 48, torch.float32),  # odd page size, G = 3, head_dim not a power of 2
]


@pytest.mark.parametrize("shape", INTERPRETED_SHAPES, ids=str)
def test_backend_matches_torch_on_runtime_batches(shape: Shape) -> None:
    rng = random.Random(str(shape))
    ctx = [rng.randint(0, 40) for _ in range(8)]
    triton = TritonAttention()
    # Ragged prefill / chunked prefill / decode: causal, no mask.
    compare_backends(shape, [Req(n, c + n) for n, c in zip((1, 3, 7), ctx, strict=False)], triton)
    # Verify: trees up to 64 nodes next to a prompt chunk and a decode (one packed mask).
    trees = [tree_req(rng, n, c) for n, c in zip((64, 1, 13), ctx[3:], strict=False)]
    compare_backends(shape, [*trees, Req(7, ctx[6] + 7), Req(1, 1)], triton, seed=1)
    # Draft scratch entries: the prefix is shorter than the context, rows up to 72 wide.
    scratch = [scratch_req(rng, 3, 69, ctx[0]), scratch_req(rng, 1, 0, ctx[1])]
    compare_backends(shape, [*scratch, scratch_req(rng, 7, 20, 0)], triton, seed=2)


@pytest.mark.parametrize("shape", INTERPRETED_SHAPES[:2], ids=str)
def test_backend_with_kv_splits_matches_torch(shape: Shape) -> None:
    rng = random.Random(5)
    reqs = [Req(1, 260), Req(1, 3), tree_req(rng, 9, 200)]
    for splits in (2, 5):
        compare_backends(shape, reqs, TritonAttention(num_splits=splits), seed=splits)


@pytest.mark.parametrize(
    "shape", [Shape(3, 4, 2, 32, torch.float32), Shape(16, 2, 2, 16, torch.float16)], ids=str
)
def test_functional_matches_reference_across_splits(shape: Shape) -> None:
    rng = random.Random(11)
    reqs = [Req(1, 300), tree_req(rng, 5, 140), scratch_req(rng, 2, 66, 30), Req(4, 4)]
    inputs = functional_inputs(shape, reqs, DEVICE)
    want = inputs.run(tree_attention_ref)
    for splits in (1, 2, 7):
        assert_close(inputs.run(tree_attention, num_splits=splits), want, shape.dtype)


def test_rows_that_see_nothing_are_zero_and_finite() -> None:
    shape = Shape(16, 4, 2, 32, torch.float32)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[1, :2] = True  # rows 0 and 2 see nothing: no prefix, empty mask rows
    inputs = functional_inputs(shape, [Req(3, 3, mask=mask, prefix=0), Req(2, 40)], DEVICE)
    want = inputs.run(tree_attention_ref)
    assert want[[0, 2]].eq(0).all() and want[1].ne(0).any()
    for splits in (1, 3):
        got = inputs.run(tree_attention, num_splits=splits)
        assert got.isfinite().all()
        assert_close(got, want, shape.dtype)


def test_pack_tree_mask_matches_reference_and_tree_bits() -> None:
    rng = random.Random(3)
    reqs = [tree_req(rng, 64, 5), scratch_req(rng, 4, 125, 2), Req(3, 9), tree_req(rng, 1, 0)]
    kv = make_kv(Shape(16, 2, 2, 16, torch.float32), 40)
    meta = make_meta(kv, reqs)
    _, packed = mask_inputs(meta, DEVICE)
    assert packed is not None and packed.shape == (meta.num_tokens, 3)
    widths = [r.seq_len - (r.seq_len - r.q_len if r.prefix is None else r.prefix) for r in reqs]
    offsets, row_widths, start = [], [], 0
    for r, w in zip(reqs, widths, strict=True):
        offsets += [start + i * w for i in range(r.q_len)]
        row_widths += [w] * r.q_len
        start += r.q_len * w
    assert meta.custom_mask is not None
    where = meta.custom_mask.device
    ref = pack_tree_mask_ref(
        meta.custom_mask,
        torch.tensor(offsets, device=where),
        torch.tensor(row_widths, device=where),
        num_words=3,
    )
    assert torch.equal(packed.cpu(), ref.cpu())
    got = pack_tree_mask(
        meta.custom_mask.to(DEVICE),
        torch.tensor(offsets, device=DEVICE),
        torch.tensor(row_widths, device=DEVICE),
        3,
    )
    assert torch.equal(got.cpu(), ref.cpu())
    # The 64-node tree: one word per row; bit j = node j is an ancestor (bit 63: the sign).
    ancestors = reqs[0].mask
    assert ancestors is not None
    for row in range(64):
        word = int(ref[row, 0]) & (2**64 - 1)
        assert [bool(word >> j & 1) for j in range(64)] == ancestors[row].tolist()
    assert ref[:64, 1:].eq(0).all()


def test_wrapper_rejects_bad_inputs() -> None:
    inputs = functional_inputs(Shape(16, 4, 2, 32, torch.float32), [Req(2, 5)], DEVICE)
    bad = {
        "page_table": replace(inputs, page_table=inputs.page_table.long()),
        "k_cache": replace(inputs, k_cache=inputs.k_cache.half()),
        "num_kv_heads": replace(inputs, q=inputs.q[:, :3]),
        "prefix_lens": replace(inputs, prefix_lens=inputs.seq_lens),
        "head_dim must be contiguous": replace(inputs, q=inputs.q.repeat(1, 1, 2)[..., ::2]),
    }
    for message, call in bad.items():
        with pytest.raises(ValueError, match=message):
            call.run(tree_attention)
    with pytest.raises(ValueError, match="num_splits"):
        inputs.run(tree_attention, num_splits=0)


def test_split_heuristic_fills_the_gpu_only_when_the_batch_does_not() -> None:
    common = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "num_sms": 132}
    assert default_num_splits(batch_size=64, max_q_len=1, max_kv_len=4096, **common) == 1
    assert default_num_splits(batch_size=1, max_q_len=1, max_kv_len=60, **common) == 1
    assert default_num_splits(batch_size=1, max_q_len=1, max_kv_len=200, **common) == 4
    assert default_num_splits(batch_size=1, max_q_len=1, max_kv_len=1024, **common) == 16
    assert default_num_splits(batch_size=1, max_q_len=1, max_kv_len=65536, **common) == 32
    assert 1 < default_num_splits(batch_size=1, max_q_len=16, max_kv_len=4096, **common) <= 32


def test_variant_launches_run_every_tile_mask_and_split() -> None:
    """The warm-up's launches are valid kernel calls (a short query range here; the engine's
    first CUDA forward runs them up to 128 query tokens, and nothing else compiles after:
    tests/spec/test_cuda_compiles.py). On CPU nothing compiles, so it is skipped there."""
    q = torch.zeros(1, 6, 16, dtype=torch.float32, device=DEVICE)  # a shape no other test has
    k_cache = torch.zeros(63, 3, 16, dtype=torch.float32, device=DEVICE)
    launch_variants(q, k_cache, page_size=7, longest=4)
    assert compile_variants(q, k_cache, 7) is (DEVICE.type == "cuda")
    assert compile_variants(q, k_cache, 7) is False  # once per shape


def test_backend_for_keeps_torch_on_cpu() -> None:
    assert isinstance(backend_for("cpu"), TorchAttention)
    assert isinstance(backend_for(torch.device("cpu")), TorchAttention)
