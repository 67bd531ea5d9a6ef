"""The Triton tree-attention kernel against its torch twins.

``TritonAttention`` against ``TorchAttention`` on the runtime's own metadata (ragged causal
batches, verify trees up to 64 nodes mixed with prompt chunks and decodes, draft scratch masks
wider than one mask word, forced KV splits), and the functional ``tree_attention`` against
``tree_attention_ref`` (split counts, all-masked rows, odd page sizes and head dims). Without
CUDA the kernels run in Triton's interpreter on CPU tensors (fp32 and fp16: it computes bf16
wrongly); the ``gpu`` tests repeat this on CUDA with bigger shapes, bf16, a CUDA graph, int64
offsets and whole-model forwards.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

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
from tandem.attention import AttentionBackend, AttentionMetadata, TorchAttention, backend_for
from tandem.attention.triton_backend import (
    TritonAttention,
    compile_variants,
    launch_variants,
    mask_inputs,
)
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import DecoderLM, ForwardContext, load_model
from tandem.spec.types import Tree

check_mode(_tree_attention_kernel)

TOL = {  # (atol, rtol): fp32 kernels and oracle agree to rounding; 16-bit P in the P @ V dot
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.6e-2, 2e-2),
}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@dataclass(frozen=True)
class Shape:
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"p{self.page_size}-{self.num_heads}q{self.num_kv_heads}kv-d{self.head_dim}-{dtype}"


@dataclass
class Req:
    """One request of a batch: ``q_len`` new tokens after ``seq_len - q_len`` entries."""

    q_len: int
    seq_len: int
    mask: torch.Tensor | None = None  # [q_len, seq_len - prefix] bool
    prefix: int | None = None  # None: seq_len - q_len


def random_parents(rng: random.Random, n: int) -> tuple[int, ...]:
    return (-1, *(rng.randrange(i) for i in range(1, n)))


def tree_req(rng: random.Random, n: int, context: int) -> Req:
    tree = Tree(tokens=(0,) * n, parents=random_parents(rng, n))
    return Req(q_len=n, seq_len=context + n, mask=tree.ancestor_mask())


def scratch_req(rng: random.Random, q_len: int, scratch: int, context: int) -> Req:
    """Draft scratch entries: each new one sees itself and random earlier scratch entries."""
    width = scratch + q_len
    mask = torch.rand(q_len, width, generator=torch.Generator().manual_seed(rng.randrange(9999)))
    mask = (mask < 0.3).tril_(scratch)
    mask[torch.arange(q_len), scratch + torch.arange(q_len)] = True
    return Req(q_len=q_len, seq_len=context + width, mask=mask, prefix=context)


def make_kv(shape: Shape, num_pages: int, device: torch.device = DEVICE) -> KVCache:
    spec = KVCacheSpec(
        num_layers=1,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        page_size=shape.page_size,
        dtype=shape.dtype,
        device=device,
    )
    kv = KVCache(spec, num_pages)
    g = torch.Generator(device=device).manual_seed(1)
    for cache in (kv.k_caches[0], kv.v_caches[0]):
        cache.copy_(torch.randn(cache.shape, generator=g, device=device))
    return kv


def make_meta(kv: KVCache, reqs: list[Req]) -> AttentionMetadata:
    """Pages handed out round-robin, so every request's pages interleave with the others'."""
    alloc = kv.allocator
    ids = [f"r{i}-{alloc.num_free_pages}" for i in range(len(reqs))]
    for req_id in ids:
        alloc.allocate(req_id, 0)
    page = kv.spec.page_size
    while any(alloc.num_tokens(i) < r.seq_len for i, r in zip(ids, reqs, strict=True)):
        for req_id, r in zip(ids, reqs, strict=True):
            alloc.extend(req_id, min(page, r.seq_len - alloc.num_tokens(req_id)))
    meta = AttentionMetadata.build(
        page_size=page,
        query_lens=[r.q_len for r in reqs],
        seq_lens=[r.seq_len for r in reqs],
        page_table=alloc.page_table(ids, device=kv.spec.device),
        slot_mapping=kv.slot_mapping_tensor(
            ids, [r.seq_len - r.q_len for r in reqs], [r.seq_len for r in reqs]
        ),
        masks=[r.mask for r in reqs],
        prefix_lens=[r.seq_len - r.q_len if r.prefix is None else r.prefix for r in reqs],
    )
    for req_id in ids:
        alloc.free(req_id)
    return meta


def compare_backends(shape: Shape, reqs: list[Req], triton: TritonAttention, seed: int = 0) -> None:
    """Both backends over one batch: outputs within the dtype's tolerance, same cache writes."""
    num_pages = sum(-(-r.seq_len // shape.page_size) for r in reqs) + 1
    kv = make_kv(shape, num_pages, DEVICE)
    meta = make_meta(kv, reqs)
    t = meta.num_tokens
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=DEVICE).to(shape.dtype)

    q = rand(t, shape.num_heads, shape.head_dim)
    k, v = rand(t, shape.num_kv_heads, shape.head_dim), rand(t, shape.num_kv_heads, shape.head_dim)
    caches = (kv.k_caches[0].clone(), kv.v_caches[0].clone())
    scale = shape.head_dim**-0.5
    want = TorchAttention().forward(q, k, v, kv.k_caches[0], kv.v_caches[0], meta, scale)
    got = triton.forward(q, k, v, *caches, meta, scale)
    assert torch.equal(caches[0], kv.k_caches[0]) and torch.equal(caches[1], kv.v_caches[0])
    assert got.isfinite().all()
    assert_close(got, want, shape.dtype)


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


@dataclass
class Inputs:
    """Arguments of ``tree_attention`` / ``tree_attention_ref``."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    page_table: torch.Tensor  # [bs, max_pages] int32
    query_start_loc: torch.Tensor  # [bs + 1] int64
    seq_lens: torch.Tensor  # [bs] int64
    prefix_lens: torch.Tensor | None  # [bs] int64
    tree_mask: torch.Tensor | None  # [num_tokens, num_words] int64
    scale: float
    page_size: int
    max_q_len: int

    def tensors(self) -> list[torch.Tensor | None]:
        return [getattr(self, f.name) for f in fields(self)][:8]

    def run(self, fn: Callable[..., torch.Tensor], **extra: Any) -> torch.Tensor:
        return fn(
            *self.tensors(),
            scale=self.scale,
            page_size=self.page_size,
            max_q_len=self.max_q_len,
            **extra,
        )


def functional_inputs(shape: Shape, reqs: list[Req], device: torch.device, seed: int = 0) -> Inputs:
    """``reqs`` as the kernel sees them (masked when any request has a mask; the others get
    theirs from the metadata's causal default)."""
    kv = make_kv(shape, sum(-(-r.seq_len // shape.page_size) for r in reqs) + 1, device)
    meta = make_meta(kv, reqs)
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(meta.num_tokens, shape.num_heads, shape.head_dim, generator=g, device=device)
    prefix_lens, tree_mask = mask_inputs(meta, device)
    return Inputs(
        q=q.to(shape.dtype),
        k_cache=kv.k_caches[0],
        v_cache=kv.v_caches[0],
        page_table=meta.page_table,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        prefix_lens=prefix_lens,
        tree_mask=tree_mask,
        scale=shape.head_dim**-0.5,
        page_size=shape.page_size,
        max_q_len=max(r.q_len for r in reqs),
    )


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


# ----------------------------------------------------------------------------- on CUDA

CUDA = torch.device("cuda")
GPU_SHAPES = [
    Shape(16, 32, 8, 128, torch.bfloat16),
    Shape(1, 32, 8, 128, torch.float16),
    Shape(16, 28, 4, 128, torch.bfloat16),  # G = 7
    Shape(16, 8, 1, 64, torch.float32),
    Shape(3, 12, 2, 96, torch.float16),  # G = 6, head_dim 96, odd page size
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_backend_matches_torch(shape: Shape) -> None:
    rng = random.Random(str(shape))
    for splits in (None, 1, 8):
        triton = TritonAttention(num_splits=splits)
        prefill = [Req(1, 1), Req(17, 17), Req(300, 1200), Req(900, 900), Req(5, 2000)]
        compare_backends(shape, prefill, triton)
        decode = [Req(1, rng.randint(1, 4096)) for _ in range(8)]
        compare_backends(shape, decode, triton, seed=1)
        verify = [tree_req(rng, 64, rng.randint(0, 3000)) for _ in range(3)]
        compare_backends(shape, [*verify, tree_req(rng, 16, 9), Req(40, 500)], triton, seed=2)
        draft = [scratch_req(rng, 8, 180, 700), scratch_req(rng, 4, 12, 2500)]
        compare_backends(shape, draft, triton, seed=3)


@pytest.mark.gpu
def test_gpu_launch_replays_in_a_cuda_graph() -> None:
    """Capture once, then change lengths, pages and masks in place: replays follow them, and
    capture would fail on a host sync. The first layout needs the largest pool and pages."""
    shape = Shape(16, 32, 8, 128, torch.bfloat16)
    rng = random.Random(2)
    layouts = [
        [tree_req(rng, 16, 1000), tree_req(rng, 16, 40), tree_req(rng, 16, 3000)],
        [tree_req(rng, 16, 7), tree_req(rng, 16, 2500), tree_req(rng, 16, 0)],
    ]
    static = functional_inputs(shape, layouts[0], CUDA)
    out = torch.empty_like(static.q)
    static.run(tree_attention, num_splits=8, out=out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.run(tree_attention, num_splits=8, out=out)
    for i, reqs in enumerate(layouts):
        fresh = functional_inputs(shape, reqs, CUDA, seed=i)
        for dst, src in zip(static.tensors(), fresh.tensors(), strict=True):
            assert dst is not None and src is not None  # pools and page tables may be smaller
            dst.zero_()
            dst[tuple(slice(0, n) for n in src.shape)] = src
        graph.replay()
        assert_close(out, static.run(tree_attention_ref), shape.dtype)


@pytest.mark.gpu
def test_gpu_offsets_past_int32() -> None:
    """Slots whose element offsets exceed 2**31 (a pool of about 2.2M slots x 1024 elements)."""
    shape = Shape(16, 32, 8, 128, torch.bfloat16)
    page = shape.page_size
    num_pages = (2**31 // (8 * 128)) // page + 512  # every page used lies past 2**31
    k_cache = torch.randn(num_pages * page, 8, 128, device=CUDA, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.arange(num_pages - 90, num_pages, device=CUDA, dtype=torch.int32)
    inputs = Inputs(
        q=torch.randn(5, 32, 128, device=CUDA, dtype=torch.bfloat16),
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table.view(2, 45),  # the last pages of the pool
        query_start_loc=torch.tensor([0, 1, 5], device=CUDA),
        seq_lens=torch.tensor([700, 33], device=CUDA),
        prefix_lens=None,
        tree_mask=None,
        scale=128**-0.5,
        page_size=page,
        max_q_len=4,
    )
    want = inputs.run(tree_attention_ref)
    for splits in (1, 4):
        assert_close(inputs.run(tree_attention, num_splits=splits), want, shape.dtype)


def _model_logits(
    model: DecoderLM, kv: KVCache, backend: AttentionBackend, seed: int
) -> list[torch.Tensor]:
    """Ragged prefill of four prompts, then one verify tree per request: both steps' logits."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 40, 130)]
    trees = [Tree(tokens=(0,) * n, parents=random_parents(rng, n)) for n in (1, 16, 64, 7)]
    alloc, names = kv.allocator, [f"m{i}" for i in range(len(prompts))]
    Chunk = tuple[list[int], list[int], Tree | None]  # token ids, positions, tree
    steps: list[list[Chunk]] = [
        [(p, list(range(len(p))), None) for p in prompts],
        [
            ([rng.randrange(3, vocab) for _ in t.tokens], [len(p) + d for d in t.depths], t)
            for p, t in zip(prompts, trees, strict=True)
        ],
    ]
    outs = []
    for chunks in steps:
        starts = []
        for name, (new_ids, _, _) in zip(names, chunks, strict=True):
            if name not in alloc:
                alloc.allocate(name, 0)
            starts.append(alloc.num_tokens(name))
            alloc.extend(name, len(new_ids))
        ends = [s + len(c[0]) for s, c in zip(starts, chunks, strict=True)]
        meta = AttentionMetadata.build(
            page_size=alloc.page_size,
            query_lens=[len(c[0]) for c in chunks],
            seq_lens=ends,
            page_table=alloc.page_table(names, device=CUDA),
            slot_mapping=kv.slot_mapping_tensor(names, starts, ends),
            masks=[c[2].ancestor_mask() if c[2] is not None else None for c in chunks],
        )
        ctx = ForwardContext(kv=kv, meta=meta, backend=backend)
        ids = torch.tensor([t for c in chunks for t in c[0]], device=CUDA)
        positions = torch.tensor([x for c in chunks for x in c[1]], device=CUDA)
        with torch.inference_mode():
            outs.append(model.compute_logits(model(ids, positions, ctx).hidden))
    for name in names:
        alloc.free(name)
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_model_forward_and_greedy_match_torch_backend(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tandem.config import EngineConfig
    from tandem.sampling import SamplingParams
    from tandem.target.engine import Engine
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=4)
    logits: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype=dtype, device=CUDA)
        c = model.config
        for name, backend in (("torch", TorchAttention()), ("triton", TritonAttention())):
            spec = KVCacheSpec(
                num_layers=c.num_layers,
                num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                page_size=16,
                dtype=dtype,
                device=CUDA,
            )
            logits[name, dtype] = _model_logits(model, KVCache(spec, 64), backend, seed=9)
    for step in range(2):
        ref = logits["torch", torch.float32][step]
        torch.testing.assert_close(logits["triton", torch.float32][step], ref, atol=1e-4, rtol=0)
        torch_err = (logits["torch", torch.bfloat16][step] - ref).abs().max().item()
        triton_err = (logits["triton", torch.bfloat16][step] - ref).abs().max().item()
        assert triton_err <= 2 * torch_err + 1e-2, (step, triton_err, torch_err)
    # Greedy generation on the fp32 model: identical tokens with either backend.
    # Eager steps only: the torch engine must not run its decodes through Triton graphs.
    config = EngineConfig(model=path, device="cuda", page_size=16, num_pages=256, cuda_graphs=False)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 6000) for _ in range(n)] for n in (1, 7, 20, 33, 200)]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    tokens = {}
    for name in ("torch", "triton"):
        engine = Engine(config)
        assert isinstance(engine.runner.backend, TritonAttention)  # what CUDA selects
        if name == "torch":
            engine.runner.backend = TorchAttention()
        tokens[name] = [r.token_ids for r in engine.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
