"""Speed of light for a memory-bound verify (docs/design.md section 11).

``t_verify_min = bytes read per verify step / copy bandwidth``: the target's weights once per
step (the input embedding only as the rows it gathers, so not at all) plus every request's KV
prefix, over the bandwidth a large device-to-device copy achieves (read + write bytes per
second, the usual figure for a copy). A chain's N nodes add their own few KV rows; ignored.
"""

from __future__ import annotations

import time

import torch

from tandem.models.config import ModelConfig


def copy_bandwidth(device: str, *, nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes per second (read + write) of a large copy on ``device``; best of ``iters``."""
    if nbytes is None:
        nbytes = (1 << 30) if device.startswith("cuda") else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    cuda = device.startswith("cuda")
    best = float("inf")
    for _ in range(iters + 1):  # the first copy warms up
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / best


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the weights one forward reads (decoder layers, final norm, lm_head)."""
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    if config.qkv_bias:
        per_layer += q + 2 * kv
    if config.qk_norm:
        per_layer += 2 * config.head_dim
    params = config.num_layers * per_layer + h + v * h  # + final norm + lm_head
    return params * torch.tensor([], dtype=dtype).element_size()


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    size = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * size


def t_verify_min(
    config: ModelConfig, dtype: torch.dtype, context_tokens: int, bandwidth: float
) -> float:
    """Seconds a verify step needs at least: weights + ``context_tokens`` of KV (all requests
    of the step together) read once at ``bandwidth`` bytes/s."""
    read = weight_bytes(config, dtype) + context_tokens * kv_bytes_per_token(config, dtype)
    return read / bandwidth
