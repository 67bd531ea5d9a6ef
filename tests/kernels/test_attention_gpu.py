"""The Triton tree-attention kernel against its torch twins on CUDA (the ``gpu`` tests):
bigger shapes and bf16 than the interpreted tests, replays in a CUDA graph, element offsets
past int32, and whole-model forwards and greedy generation against the torch backend."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels._interpret import check_mode  # sets Triton's mode: import first

# isort: split
from kernels.attention import _tree_attention_kernel, tree_attention
from kernels.reference_attention import tree_attention_ref
from tandem.attention import AttentionBackend, AttentionMetadata, TorchAttention
from tandem.attention.triton_backend import TritonAttention
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import DecoderLM, ForwardContext, load_model
from tandem.spec.types import Tree
from tests.helpers.attention import (
    Inputs,
    Req,
    Shape,
    assert_close,
    compare_backends,
    functional_inputs,
    random_parents,
    scratch_req,
    tree_req,
)

check_mode(_tree_attention_kernel)

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
