"""Engine configuration (frozen, validated), and the settings a target and a draft share (each
field's help, flag and environment variable: tandem.settings)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.settings import Setting, setting
from tandem.spec.types import DRAFT_KINDS, MTP_MODES

if TYPE_CHECKING:  # the command lines build configs without loading torch
    import torch

SPEC_POLICIES = ("fixed", "adaptive", "k0")
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)  # EngineConfig.prefill_graph_tokens
DTYPES = ("float32", "bfloat16", "float16")  # the models' dtypes, by torch's names


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (one of DTYPES)."""
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


def token_counts(raw: str) -> tuple[int, ...]:
    """``--prefill-graph-tokens``: comma-separated counts, or 'off' (EngineConfig checks that
    they increase from 1)."""
    if raw.strip().lower() in ("off", "none", ""):
        return ()
    try:
        return tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{raw!r}: expected counts like 16,32,64 or 'off'"
        ) from None


# The settings of both an engine (the target) and a draft.
TARGET = Setting(
    help="target checkpoint directory (Hugging Face format)", env="TARGET", flag="target"
)
DEVICE = Setting(help="cpu or cuda[:N]", env="DEVICE")
DTYPE = Setting(help="the models' dtype", env="DTYPE", choices=tuple(sorted(DTYPES)))
PAGE_SIZE = Setting(help="tokens per KV page", env="PAGE_SIZE")
NUM_PAGES = Setting(help="KV pool size in pages (a draft's: per draft module)", env="NUM_PAGES")
CUDA_GRAPHS = Setting(
    help="run steps through CUDA graphs (the target's decode/verify steps, the draft's chains "
    "and extends)",
    env="CUDA_GRAPHS",
    shown_default="on for CUDA devices",
)
TRANSPOSED_WEIGHTS = Setting(
    help="store the projection weights transposed, the faster GEMM layout for decoding on Hopper",
    env="TRANSPOSED_WEIGHTS",
    shown_default="on for CUDA devices",
)
DRAFT_KIND = Setting(
    help="the draft's kind (ngram needs no checkpoint)",
    env="KIND",
    flag="draft-kind",
    choices=DRAFT_KINDS,
)


def on_for_cuda(choice: bool | None, device: str) -> bool:
    """A setting whose unset value (None) means on for CUDA devices, off elsewhere."""
    return device.startswith("cuda") if choice is None else choice


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How one engine loads its model and sizes its batch and KV pool."""

    model: Path = setting(like=TARGET)
    dtype: str = setting("float32", like=DTYPE)
    device: str = setting("cpu", like=DEVICE)
    page_size: int = setting(16, like=PAGE_SIZE)
    max_num_seqs: int = setting(64, help="requests running at once", env="MAX_NUM_SEQS")
    max_num_batched_tokens: int = setting(
        2048,
        help="tokens per forward; longer prompts are prefilled in chunks",
        env="MAX_NUM_BATCHED_TOKENS",
    )
    max_model_len: int | None = None  # prompt + output cap; None = the model's context length
    # KV pool size in pages; wins over kv_cache_bytes
    num_pages: int | None = setting(None, like=NUM_PAGES, shown_default="sized to free memory")
    kv_cache_bytes: int | None = None  # KV pool size as a memory budget
    gpu_memory_utilization: float = 0.85  # share of free GPU memory for KV when unsized
    # Decode/verify steps through CUDA graphs (tandem/target/graphs.py); None = on for CUDA devices.
    cuda_graphs: bool | None = setting(None, like=CUDA_GRAPHS)
    # Captured batch sizes; sizes past the first one >= max_num_seqs are never captured.
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    # With graphs: token counts at which a prompt chunk alone in its step replays a CUDA graph
    # (tandem/target/prefill_graphs.py); counts past max_num_batched_tokens are never captured;
    # () = every prompt chunk runs eagerly.
    prefill_graph_tokens: tuple[int, ...] = setting(
        PREFILL_GRAPH_TOKENS,
        help="with CUDA graphs, the token counts at which a prompt chunk alone in its step "
        "replays a CUDA graph, comma-separated, or 'off'",
        env="PREFILL_GRAPH_TOKENS",
        parse=token_counts,
    )
    # Perf only (tandem.spec.simulate): accept this mean length whatever the drafts are; the
    # output is then not the target's. The target service reads it from the environment only.
    simulate_accept_length: float | None = setting(
        None,
        help="PERF ONLY: force this mean accept length (drafts accepted unchecked; the output "
        "is not the target's), for random-weight models",
        env="TANDEM_SIMULATE_ACCEPT_LENGTH",
    )
    # tandem/target/policy.py; "k0": the draft stays attached and in step (measures the K=0 path).
    spec_policy: str = setting(
        "fixed",
        help="fixed: speculate every step; adaptive: per batch size, speculate only while it "
        "commits more tokens per second than K=0 decoding; k0: never",
        env="SPEC_POLICY",
        choices=SPEC_POLICIES,
    )
    # tandem/target/ahead.py
    overlap: bool = setting(
        True,
        help="plain greedy decode steps (no draft, or K=0) launch the next step before the last "
        "one is read",
        env="OVERLAP",
    )
    # Steady greedy chain speculation as device-chain steps (tandem/target/device_chain.py), with
    # an in-process drafter or a draft service on the local stream (tandem/link/chain_remote.py).
    # None: on wherever the engine can run them (Engine.enable_device_chain), else off.
    device_chain: bool | None = setting(
        None,
        help="steady greedy chain speculation runs as device-chain steps: both halves queued on "
        "the GPU before the last step is read (needs CUDA graphs and a one-module draft on this "
        "GPU, in process or reached through its local socket; docs/device-cycle.md); on: fail "
        "at start where it cannot run",
        env="DEVICE_CHAIN",
        shown_default="on where it can run",
    )
    # DecoderLM.use_transposed_weights: cuBLAS's faster layout for decode-sized GEMMs.
    transposed_weights: bool | None = setting(None, like=TRANSPOSED_WEIGHTS)
    # Every projection, the lm_head and attention run tiles whose per-row sums do not depend on
    # the batch (kernels.skinny, tree_attention's batch_invariant), so a token's logits are
    # bit-identical decoded alone or verified among S+1 tokens in any batch. Costs speed where
    # cuBLAS or KV splits were faster (large batches, prefill).
    batch_invariant: bool = setting(
        False,
        help="batch-invariant target kernels (CUDA): a token's logits do not depend on its batch, "
        "so greedy speculation equals target-only decoding in bf16 too; slower at large batches "
        "and in prefill",
        env="BATCH_INVARIANT",
    )

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
        return torch_dtype(self.dtype)


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Where the draft comes from and how its KV pool is sized."""

    kind: str = setting(like=DRAFT_KIND)
    path: Path | None = setting(  # None only for ngram
        None, help="draft checkpoint directory (every kind but ngram)", env="PATH", flag="draft"
    )
    target: Path = setting(like=TARGET)  # EAGLE/MTP read its embedding and lm_head
    mtp_mode: str = setting(
        "chain",
        help="MTP heads fed the previous head's hidden (chain) or the target's (target)",
        env="MTP_MODE",
        choices=MTP_MODES,
    )
    dtype: str = setting("float32", like=DTYPE)
    device: str = setting("cpu", like=DEVICE)
    page_size: int = setting(16, like=PAGE_SIZE)
    num_pages: int = setting(2048, like=NUM_PAGES)  # per draft module
    fast_top1: bool = True  # K=1: fused argmax + logsumexp instead of softmax + topk
    # Chains and extends through CUDA graphs (tandem/draft/graphs.py); None = on for CUDA.
    cuda_graphs: bool | None = setting(None, like=CUDA_GRAPHS)
    # The target's default buckets (EngineConfig): a device-chain run needs its bucket on both.
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    cuda_graph_steps: tuple[int, ...] = (3,)  # S captured at load; any other S on first use
    # Without CUDA graphs (CPU): the graphs' buckets run eagerly on their static buffers, the
    # stand-in with which the CPU tests run device-chain runs (draft_service/chain.py).
    static_buckets: bool = False
    # Projection weights stored transposed (tandem.models.decoder.transpose_weights), as the
    # target's: cuBLAS's faster layout and the skinny kernel at decode sizes; None = on for CUDA.
    transposed_weights: bool | None = setting(None, like=TRANSPOSED_WEIGHTS)

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {DRAFT_KINDS}")
        if self.kind != "ngram" and self.path is None:
            raise ValueError(f"path: draft kind {self.kind} needs a checkpoint directory")
        if self.mtp_mode not in MTP_MODES:
            raise ValueError(f"mtp_mode: {self.mtp_mode!r} is not one of {MTP_MODES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.page_size < 1 or self.num_pages < 1:
            raise ValueError("page_size/num_pages: must be >= 1")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs: needs a CUDA device, not {self.device!r}")
        sizes = self.cuda_graph_batch_sizes
        if not sizes or sizes[0] < 1 or list(sizes) != sorted(set(sizes)):
            raise ValueError("cuda_graph_batch_sizes: need increasing sizes >= 1")
        if any(s < 1 for s in self.cuda_graph_steps):
            raise ValueError("cuda_graph_steps: every S must be >= 1")

    @property
    def use_transposed_weights(self) -> bool:
        return on_for_cuda(self.transposed_weights, self.device)

    @property
    def use_cuda_graphs(self) -> bool:
        if self.cuda_graphs is None:
            return self.device.startswith("cuda") and self.kind != "ngram"
        return self.cuda_graphs
