"""Next-token choice from processed logits without a host sync (kernels.md section 5): `sample`.
Torch twin: `sample_ref` in `reference.py`.

One pass over the vocabulary, split like `top1`. Greedy rows keep torch's argmax (first
maximum; a NaN ranks highest, so the first NaN wins). Sampled rows run the exponential race in
the log domain: argmax(softmax(x) / E) = argmax(x - log E), so no normaliser and no second pass
are needed; a NaN or +inf anywhere in a sampled row, or no finite logit, gives 0. Stage 1, grid
(rows, num_splits), keeps per chunk the best key and its first index, the first NaN index and
the count of NaN/+inf entries; stage 2, grid (rows,), merges them in vocabulary order.

The race differs from the reference's `softmax(x) / E` in rounding only: where two candidates
tie to within an ulp, the two may pick different ones of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._launch import cdiv, next_pow2
from kernels.reference import _check_sample
from kernels.top1 import default_splits

_BLOCK = 1024
_NO_INDEX = tl.constexpr(2**63 - 1)


@triton.jit(do_not_specialize=["num_splits"])  # chunk stays specialised: aligned loads
def _sample_partial_kernel(
    logits_ptr: tl.tensor,  # [R, V], unit stride along V
    temperature_ptr: tl.tensor,  # [R]
    noise_ptr: tl.tensor,  # [R, V], unit stride along V
    part_key_ptr: tl.tensor,  # [R, num_splits] fp32 best key of the chunk
    part_idx_ptr: tl.tensor,  # [R, num_splits] int64 its first index
    part_nan_ptr: tl.tensor,  # [R, num_splits] int64 first NaN index (_NO_INDEX: none)
    part_bad_ptr: tl.tensor,  # [R, num_splits] int32 NaN/+inf count
    ids_ptr: tl.tensor,  # [R] int64 (SINGLE)
    vocab: tl.int64,
    logits_stride: tl.int64,
    noise_stride: tl.int64,
    chunk: tl.int64,
    num_splits: tl.int64,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    sampled = tl.load(temperature_ptr + row) > 0
    lanes = tl.arange(0, BLOCK)
    key = tl.full([], float("-inf"), tl.float32)
    idx = tl.full([], 0, tl.int64)
    first_nan = tl.full([], _NO_INDEX, tl.int64)
    bad = tl.full([], 0, tl.int32)
    for off in range(start, end, BLOCK):
        offs = off + lanes
        inside = offs < end
        x = tl.load(logits_ptr + row * logits_stride + offs, mask=inside, other=float("-inf"))
        x = x.to(tl.float32)
        nan = x != x
        bad += tl.sum((nan | (x == float("inf"))).to(tl.int32), axis=0)
        nan_at = tl.min(tl.where(nan, offs.to(tl.int64), _NO_INDEX), axis=0)
        first_nan = tl.minimum(first_nan, nan_at)
        # Greedy rows never read the noise (masked load).
        e_mask = tl.where(sampled, inside, False)  # (the interpreter rejects inside & sampled)
        e = tl.load(noise_ptr + row * noise_stride + offs, mask=e_mask, other=1.0)
        race = x - tl.log(e.to(tl.float32))
        k = tl.where(nan, float("-inf"), tl.where(sampled, race, x))
        k = tl.where(inside, k, float("-inf"))
        tile_key = tl.max(k, axis=0)
        tile_arg = tl.min(tl.where(k == tile_key, offs, vocab), axis=0)
        idx = tl.where(tile_key > key, tile_arg, idx)  # strictly greater: first index wins
        key = tl.maximum(key, tile_key)
    if SINGLE:
        greedy_id = tl.where(first_nan != _NO_INDEX, first_nan, idx)
        sampled_id = tl.where(bad == 0, idx, 0)
        tl.store(ids_ptr + row, tl.where(sampled, sampled_id, greedy_id))
    else:
        at = row * num_splits + split
        tl.store(part_key_ptr + at, key)
        tl.store(part_idx_ptr + at, idx)
        tl.store(part_nan_ptr + at, first_nan)
        tl.store(part_bad_ptr + at, bad)


@triton.jit(do_not_specialize=["num_splits"])  # per-step values: no recompiles
def _sample_merge_kernel(
    temperature_ptr: tl.tensor,
    part_key_ptr: tl.tensor,
    part_idx_ptr: tl.tensor,
    part_nan_ptr: tl.tensor,
    part_bad_ptr: tl.tensor,
    ids_ptr: tl.tensor,  # [R] int64
    num_splits: tl.int64,
    BLOCK_S: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    inside = s < num_splits
    at = row * num_splits + s
    key = tl.load(part_key_ptr + at, mask=inside, other=float("-inf"))
    idx = tl.load(part_idx_ptr + at, mask=inside, other=_NO_INDEX)
    first_nan = tl.min(tl.load(part_nan_ptr + at, mask=inside, other=_NO_INDEX), axis=0)
    bad = tl.sum(tl.load(part_bad_ptr + at, mask=inside, other=0), axis=0)
    top = tl.max(key, axis=0)
    best = tl.min(tl.where(inside & (key == top), idx, _NO_INDEX), axis=0)
    best = tl.where(top > float("-inf"), best, 0)  # no finite key: torch's argmax gives 0
    greedy_id = tl.where(first_nan != _NO_INDEX, first_nan, best)
    sampled_id = tl.where(bad == 0, best, 0)
    sampled = tl.load(temperature_ptr + row) > 0
    tl.store(ids_ptr + row, tl.where(sampled, sampled_id, greedy_id))


def sample(logits: Tensor, temperature: Tensor, noise: Tensor) -> Tensor:
    """`sample_ref` on the GPU: `logits` [R, V] processed logits, `temperature` [R] (> 0
    samples), `noise` [R, V] Exp(1) (clamped away from 0 by the caller) -> `ids` [R] int64."""
    _check_sample(logits, temperature, noise)
    num_rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if noise.stride(1) != 1:
        noise = noise.contiguous()
    temperature = temperature.contiguous()
    block = min(_BLOCK, max(16, next_pow2(vocab)))
    num_splits = default_splits(num_rows, vocab, block)
    chunk = cdiv(cdiv(vocab, num_splits), block) * block
    num_splits = cdiv(vocab, chunk)
    dev = logits.device
    ids = torch.empty(num_rows, dtype=torch.int64, device=dev)
    if num_rows == 0:
        return ids
    single = num_splits == 1
    shape = (num_rows, 1 if single else num_splits)
    part_key = torch.empty(shape, dtype=torch.float32, device=dev)
    part_idx = torch.empty(shape, dtype=torch.int64, device=dev)
    part_nan = torch.empty(shape, dtype=torch.int64, device=dev)
    part_bad = torch.empty(shape, dtype=torch.int32, device=dev)
    _sample_partial_kernel[(num_rows, num_splits)](
        logits, temperature, noise, part_key, part_idx, part_nan, part_bad, ids,
        vocab, logits.stride(0), noise.stride(0), chunk, num_splits,
        BLOCK=block, SINGLE=single,
    )  # fmt: skip
    if not single:
        _sample_merge_kernel[(num_rows,)](
            temperature, part_key, part_idx, part_nan, part_bad, ids, num_splits,
            BLOCK_S=next_pow2(cdiv(vocab, block)), num_warps=1,  # the most splits: one variant
        )  # fmt: skip
    return ids
