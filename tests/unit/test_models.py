"""Our decoder forward over paged KV equals transformers' logits, hidden states and trees."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.attention import AttentionMetadata, TorchAttention
from tandem.errors import CheckpointError
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import DecoderLM, ForwardContext, load_model
from tests.checkpoints import ARCHS, load_hf, make_checkpoint

TOL = 1e-4
PROMPT_LENS = (1, 7, 33)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(path), load_hf(path)


def make_kv(model: DecoderLM, page_size: int, num_pages: int = 64) -> KVCache:
    c = model.config
    spec = KVCacheSpec(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        page_size=page_size,
        dtype=torch.float32,
    )
    return KVCache(spec, num_pages)


def forward(
    model: DecoderLM,
    kv: KVCache,
    chunks: list[tuple[str, list[int], list[int], torch.Tensor | None]],
    capture: tuple[int, ...] = (),
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Runs one flat forward over (req_id, token ids, positions, mask) chunks; each chunk is
    appended to its request's KV. Returns per-chunk logits and captured hidden states."""
    alloc = kv.allocator
    ids, positions, starts, ends, masks = [], [], [], [], []
    for req_id, tokens, pos, mask in chunks:
        if req_id not in alloc:
            alloc.allocate(req_id, 0)
        start = alloc.num_tokens(req_id)
        alloc.extend(req_id, len(tokens))
        ids += tokens
        positions += pos
        starts.append(start)
        ends.append(start + len(tokens))
        masks.append(mask)
    req_ids = [c[0] for c in chunks]
    meta = AttentionMetadata.build(
        page_size=alloc.page_size,
        query_lens=[len(c[1]) for c in chunks],
        seq_lens=ends,
        page_table=alloc.page_table(req_ids),
        slot_mapping=kv.slot_mapping_tensor(req_ids, starts, ends),
        masks=masks,
    )
    ctx = ForwardContext(kv=kv, meta=meta, backend=TorchAttention())
    with torch.inference_mode():
        out = model(torch.tensor(ids), torch.tensor(positions), ctx, capture)
        logits = model.compute_logits(out.hidden)
    lens = [len(c[1]) for c in chunks]
    return list(logits.split(lens)), [list(h.split(lens)) for h in out.captured]


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_chunked_prefill_and_decode_match_transformers(pair: Any, page_size: int) -> None:
    model, hf = pair
    vocab = model.config.vocab_size
    ps = prompts(vocab)
    # Ragged prefill in one forward.
    kv = make_kv(model, page_size)
    logits, _ = forward(
        model, kv, [(f"r{i}", p, list(range(len(p))), None) for i, p in enumerate(ps)]
    )
    for p, got in zip(ps, logits, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, p), atol=TOL, rtol=0)
    # Decode 4 steps, batched across the three requests.
    seqs = [list(p) for p in ps]
    rng = random.Random(1)
    for _ in range(4):
        step = [rng.randrange(vocab) for _ in seqs]
        chunk = [
            (f"r{i}", [t], [len(s)], None) for i, (s, t) in enumerate(zip(seqs, step, strict=True))
        ]
        logits, _ = forward(model, kv, chunk)
        for s, t, got in zip(seqs, step, logits, strict=True):
            s.append(t)
            torch.testing.assert_close(got[0], hf_logits(hf, s)[-1], atol=TOL, rtol=0)
    # Chunked prefill: every request's prompt in pieces of 5 over several forwards, mixed.
    kv = make_kv(model, page_size)
    done = [0] * len(ps)
    while any(d < len(p) for d, p in zip(done, ps, strict=True)):
        chunk = []
        for i, p in enumerate(ps):
            if done[i] < len(p):
                piece = p[done[i] : done[i] + 5]
                chunk.append((f"r{i}", piece, list(range(done[i], done[i] + len(piece))), None))
        logits, _ = forward(model, kv, chunk)
        for (req_id, piece, pos, _), got in zip(chunk, logits, strict=True):
            i = int(req_id[1:])
            ref = hf_logits(hf, ps[i])[pos[0] : pos[-1] + 1]
            torch.testing.assert_close(got, ref, atol=TOL, rtol=0)
            done[i] += len(piece)


def test_captured_hidden_states_match_output_hidden_states(pair: Any) -> None:
    model, hf = pair
    layers = tuple(range(model.config.num_layers + 1))
    ps = prompts(model.config.vocab_size, seed=3)
    kv = make_kv(model, 16)
    chunks = [(f"r{i}", p, list(range(len(p))), None) for i, p in enumerate(ps)]
    _, captured = forward(model, kv, chunks, capture=(2, 0, *layers))
    for j, p in enumerate(ps):
        with torch.inference_mode():
            ref = hf(torch.tensor([p]), output_hidden_states=True).hidden_states
        assert len(ref) == len(layers)
        for k, layer in enumerate((2, 0, *layers)):
            torch.testing.assert_close(captured[k][j], ref[layer][0], atol=TOL, rtol=0)


def random_tree(rng: random.Random, n: int, branching: int) -> list[int]:
    """Parent index of each node (-1 for node 0); parents precede children."""
    parents = [-1]
    children = [0] * n
    for node in range(1, n):
        candidates = [p for p in range(node) if children[p] < branching]
        parent = rng.choice(candidates)
        children[parent] += 1
        parents.append(parent)
    return parents


@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_verification_equals_sequential_decoding_along_each_path(
    pair: Any, page_size: int
) -> None:
    model, hf = pair
    vocab = model.config.vocab_size
    rng = random.Random(7)
    kv = make_kv(model, page_size, num_pages=256)
    prefixes = prompts(vocab, seed=5)
    forward(model, kv, [(f"t{i}", p, list(range(len(p))), None) for i, p in enumerate(prefixes)])
    trees = []
    for i, prefix in enumerate(prefixes):
        n = rng.randint(1, 16)
        parents = random_tree(rng, n, branching=rng.randint(1, 4))
        tokens = [rng.randrange(vocab) for _ in range(n)]
        depth = [0] * n
        mask = torch.zeros(n, n, dtype=torch.bool)
        for node in range(n):
            if node:
                depth[node] = depth[parents[node]] + 1
                mask[node] = mask[parents[node]]
            mask[node, node] = True
        positions = [len(prefix) + d for d in depth]
        trees.append((f"t{i}", tokens, positions, mask, parents))
    logits, _ = forward(model, kv, [t[:4] for t in trees])
    for prefix, (_, tokens, _, _, parents), got in zip(prefixes, trees, logits, strict=True):
        for node in range(len(tokens)):
            path = []
            at = node
            while at != -1:
                path.append(tokens[at])
                at = parents[at]
            ref = hf_logits(hf, prefix + path[::-1])[-1]
            torch.testing.assert_close(got[node], ref, atol=TOL, rtol=0)


def test_sharded_untied_and_tied_checkpoints_load(tmp_path: Path) -> None:
    for tie in (False, True):
        path = make_checkpoint(
            tmp_path / f"tie{tie}", "llama", tie_word_embeddings=tie, max_shard_size="100KB"
        )
        assert (path / "model.safetensors.index.json").is_file()
        model = load_model(path)
        hf = load_hf(path)
        assert (model.lm_head.weight is model.embed_tokens.weight) == tie
        kv = make_kv(model, 3)
        p = prompts(model.config.vocab_size)[2]
        logits, _ = forward(model, kv, [("a", p, list(range(len(p))), None)])
        torch.testing.assert_close(logits[0], hf_logits(hf, p), atol=TOL, rtol=0)


def test_rope_scaling_is_applied(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = make_checkpoint(tmp_path / "llama3", "llama", rope_parameters=rope)
    model, hf = load_model(path), load_hf(path)
    plain = load_model(make_checkpoint(tmp_path / "plain", "llama", tokenizer=False))
    assert model.config.inv_freq != plain.config.inv_freq
    p = prompts(model.config.vocab_size)[2]
    logits, _ = forward(model, make_kv(model, 16), [("a", p, list(range(len(p))), None)])
    torch.testing.assert_close(logits[0], hf_logits(hf, p), atol=TOL, rtol=0)


def test_bad_checkpoints_are_refused_with_reasons(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_model(tmp_path)
    path = make_checkpoint(tmp_path / "ok", "llama", tokenizer=False)
    (path / "model.safetensors").rename(path / "weights.bin")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(path)


def test_transposed_weights_keep_shapes_values_and_tied_heads(tmp_path: Path) -> None:
    """``use_transposed_weights`` changes only the storage of every projection: same shape and
    values, [in, out] row-major underneath; a tied lm_head stays the embedding itself."""
    for arch, tied in (("llama", False), ("qwen2", True)):
        path = make_checkpoint(tmp_path / arch, arch, seed=5, tie_word_embeddings=tied)
        model = load_model(path, dtype=torch.float32, device="cpu")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        moved = model.use_transposed_weights()
        assert moved == len(linears) - (1 if tied else 0)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        for m in linears:
            if tied and m is model.lm_head:
                assert m.weight is model.embed_tokens.weight and m.weight.is_contiguous()
            else:
                assert m.weight.t().is_contiguous() and not m.weight.is_contiguous()


def test_batch_invariant_switches_every_projection_and_needs_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``use_batch_invariant`` flags every projection (the kernels then take their
    batch-invariant GEMM on CUDA); on CPU the references run as before, so logits are equal.
    The engine setting needs CUDA; the target's flag and environment set it."""
    from tandem.config import EngineConfig
    from tandem.models.decoder import Linear
    from target_service.__main__ import _config, build_parser

    path = make_checkpoint(tmp_path / "m", "llama", seed=7, tie_word_embeddings=True)
    model = load_model(path, dtype=torch.float32, device="cpu")
    tokens = list(range(3, 12))
    before, _ = forward(model, make_kv(model, 4), [("a", tokens, list(range(9)), None)])
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.use_batch_invariant() == len(projections) > 0
    assert model.batch_invariant and all(m.batch_invariant for m in projections)
    after, _ = forward(model, make_kv(model, 4), [("a", tokens, list(range(9)), None)])
    assert torch.equal(before[0], after[0])
    with pytest.raises(ValueError, match="batch_invariant: needs a CUDA device"):
        EngineConfig(model=path, batch_invariant=True)
    parser = build_parser()
    assert not _config(parser.parse_args(["--target", str(path)])).engine.batch_invariant
    with pytest.raises(ValueError, match="batch_invariant: needs a CUDA device"):
        _config(parser.parse_args(["--target", str(path), "--batch-invariant"]))
    on_cuda = ["--target", str(path), "--device", "cuda"]
    assert _config(parser.parse_args([*on_cuda, "--batch-invariant"])).engine.batch_invariant
    monkeypatch.setenv("TANDEM_TARGET_BATCH_INVARIANT", "1")
    assert _config(build_parser().parse_args(on_cuda)).engine.batch_invariant
