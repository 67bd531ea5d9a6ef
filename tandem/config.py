"""Engine configuration (frozen, validated; environment variables use the TANDEM_ prefix)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SPEC_POLICIES = ("fixed", "adaptive", "k0")
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)  # EngineConfig.prefill_graph_tokens
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def on_for_cuda(choice: bool | None, device: str) -> bool:
    """A setting whose unset value (None) means on for CUDA devices, off elsewhere."""
    return device.startswith("cuda") if choice is None else choice


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How one engine loads its model and sizes its batch and KV pool."""

    model: Path  # Hugging Face checkpoint directory
    dtype: str = "float32"  # one of DTYPES
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    page_size: int = 16  # tokens per KV page
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens per forward; longer prompts are chunked
    max_model_len: int | None = None  # prompt + output cap; None = the model's context length
    num_pages: int | None = None  # KV pool size in pages; wins over kv_cache_bytes
    kv_cache_bytes: int | None = None  # KV pool size as a memory budget
    gpu_memory_utilization: float = 0.85  # share of free GPU memory for KV when unsized
    # Decode/verify steps through CUDA graphs (tandem/target/graphs.py); None = on for CUDA devices.
    cuda_graphs: bool | None = None
    # Captured batch sizes; sizes past the first one >= max_num_seqs are never captured.
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    # With graphs: token counts at which a prompt chunk alone in its step replays a CUDA graph
    # (tandem/target/prefill_graphs.py); counts past max_num_batched_tokens are never captured;
    # () = every prompt chunk runs eagerly.
    prefill_graph_tokens: tuple[int, ...] = PREFILL_GRAPH_TOKENS
    # Perf only (tandem.spec.simulate): accept this mean length whatever the drafts are; the
    # output is then not the target's. Set by `tandem bench` and TANDEM_SIMULATE_ACCEPT_LENGTH.
    simulate_accept_length: float | None = None
    # "fixed": speculate every step (with a drafter); "adaptive": per batch size, speculate
    # only while it commits more tokens per second than K=0 decoding (tandem/target/policy.py);
    # "k0": never (the draft stays attached and in step; measures the K=0 path).
    spec_policy: str = "fixed"
    # Plain greedy decode steps (target-only, K=0) launch the next step before reading the
    # last one (tandem/target/ahead.py); False runs every step synchronously.
    overlap: bool = True
    # Steady greedy chain speculation runs as device-chain steps: each launched before the
    # last one is read (tandem/target/device_chain.py), with an in-process drafter or a draft
    # service on the local stream (tandem/link/chain_remote.py). Needs graphs.
    device_chain: bool = False
    # The target's projection weights stored transposed (DecoderLM.use_transposed_weights):
    # cuBLAS's faster layout for decode-sized GEMMs; None = on for CUDA devices.
    transposed_weights: bool | None = None
    # Batch-invariant target kernels (CUDA): every projection, the lm_head and attention run
    # tiles whose per-row sums do not depend on the batch (kernels.skinny, tree_attention's
    # batch_invariant), so a token's logits are bit-identical decoded alone or verified among
    # S+1 tokens in any batch: greedy speculation then equals target-only decoding in bf16 too.
    # Costs speed where cuBLAS or KV splits were faster (large batches, prefill).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: {self.device!r} is not cpu or cuda[:N]")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        for name in ("max_model_len", "num_pages", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1 when given")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs: needs a CUDA device, not {self.device!r}")
        if self.batch_invariant and not self.device.startswith("cuda"):
            # The CPU runs torch's references, whose GEMMs promise no such thing.
            raise ValueError(f"batch_invariant: needs a CUDA device, not {self.device!r}")
        sizes = self.cuda_graph_batch_sizes
        if not sizes or sizes[0] < 1 or list(sizes) != sorted(set(sizes)):
            raise ValueError("cuda_graph_batch_sizes: need increasing sizes >= 1")
        tokens = self.prefill_graph_tokens
        if tokens and (tokens[0] < 1 or list(tokens) != sorted(set(tokens))):
            raise ValueError("prefill_graph_tokens: need increasing counts >= 1")
        if self.spec_policy not in SPEC_POLICIES:
            raise ValueError(f"spec_policy: {self.spec_policy!r} is not one of {SPEC_POLICIES}")
        if self.simulate_accept_length is not None and self.simulate_accept_length < 1.0:
            raise ValueError("simulate_accept_length: must be >= 1 when given")

    @property
    def use_cuda_graphs(self) -> bool:
        return on_for_cuda(self.cuda_graphs, self.device)

    @property
    def use_transposed_weights(self) -> bool:
        return on_for_cuda(self.transposed_weights, self.device)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes to capture: up to the first that holds ``max_num_seqs``."""
        sizes = self.cuda_graph_batch_sizes
        last = next((i for i, b in enumerate(sizes) if b >= self.max_num_seqs), len(sizes) - 1)
        return sizes[: last + 1]

    @property
    def prefill_graph_widths(self) -> tuple[int, ...]:
        """The prompt-chunk token counts to capture (with graphs): up to the first that holds
        a whole step's token budget."""
        tokens, budget = self.prefill_graph_tokens, self.max_num_batched_tokens
        last = next((i for i, t in enumerate(tokens) if t >= budget), len(tokens) - 1)
        return tokens[: last + 1]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
