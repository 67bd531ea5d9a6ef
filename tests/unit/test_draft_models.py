"""Draft heads (EAGLE-3, EAGLE-1, MTP) over paged KV equal a dense plain-torch transcription
of docs/draft-formats.md that reads the raw checkpoint tensors
(tests/unit/test_draft_loading.py: the loaders' conventions and errors)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tandem.attention import AttentionMetadata, TorchAttention
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import ForwardContext, ModelConfig, load_model
from tandem.models.draft import DraftModule
from tandem.models.draft_loader import load_eagle, load_eagle3, load_mtp
from tandem.testing.random_drafts import (
    make_eagle3_checkpoint,
    make_eagle_checkpoint,
    make_mtp_checkpoint,
)
from tests.checkpoints import edit_config

TOL = 1e-5
V = 6000  # tandem.testing.random_model.BASE
W = dict[str, torch.Tensor]
# tokens, hidden inputs [n, H], positions -> outputs [n, H], logits [n, V_d]
Ref = Callable[[list[int], torch.Tensor, list[int]], tuple[torch.Tensor, torch.Tensor]]


# --- the dense reference, written from draft-formats.md, reading raw checkpoint tensors --------


def raw(draft: Path, target: Path) -> tuple[W, W, dict[str, Any]]:
    """Draft tensors, target tensors (float32) and the draft's config.json."""
    w, t = (load_file(p / "model.safetensors") for p in (draft, target))
    w = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
    return w, t, json.loads((draft / "config.json").read_text())


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def lin(x: torch.Tensor, w: W, name: str) -> torch.Tensor:
    bias = w.get(f"{name}.bias")
    y = x @ w[f"{name}.weight"].T
    return y if bias is None else y + bias


def attention(x: torch.Tensor, w: W, p: str, c: dict[str, Any], pos: list[int]) -> torch.Tensor:
    """Dense causal GQA over one whole sequence; default RoPE from the config."""
    n, heads, kv_heads = x.shape[0], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or c["hidden_size"] // heads
    q = lin(x, w, f"{p}self_attn.q_proj").view(n, heads, d)
    k = lin(x, w, f"{p}self_attn.k_proj").view(n, kv_heads, d)
    v = lin(x, w, f"{p}self_attn.v_proj").view(n, kv_heads, d)
    if f"{p}self_attn.q_norm.weight" in w:  # Qwen3
        q = rms(q, w[f"{p}self_attn.q_norm.weight"], c["rms_norm_eps"])
        k = rms(k, w[f"{p}self_attn.k_norm.weight"], c["rms_norm_eps"])
    inv_freq = 1.0 / c["rope_parameters"]["rope_theta"] ** (torch.arange(0, d, 2) / d)
    angles = torch.tensor(pos, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat((angles, angles), -1)[:, None]  # [n, 1, d]

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = torch.cat((-t[..., d // 2 :], t[..., : d // 2]), -1)
        return t * angles.cos() + half * angles.sin()

    group = heads // kv_heads
    q, k, v = rope(q), rope(k).repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    return lin(out, w, f"{p}self_attn.o_proj")


def mlp(x: torch.Tensor, w: W, p: str) -> torch.Tensor:
    gate, up = lin(x, w, f"{p}mlp.gate_proj"), lin(x, w, f"{p}mlp.up_proj")
    return lin(torch.nn.functional.silu(gate) * up, w, f"{p}mlp.down_proj")


def eagle3_ref(draft: Path, target: Path) -> Ref:
    w, t, c = raw(draft, target)
    eps, p = c["rms_norm_eps"], "midlayer."

    def forward(tokens: list[int], g: torch.Tensor, pos: list[int]) -> Any:
        e = t["model.embed_tokens.weight"][tokens]  # the target's embedding (1.3, step 1)
        e, gn = (
            rms(e, w[p + "input_layernorm.weight"], eps),
            rms(g, w[p + "hidden_norm.weight"], eps),
        )
        residual = gn if c.get("norm_before_residual") else g  # the vLLM variant (1.7)
        h1 = residual + attention(torch.cat((e, gn), -1), w, p, c, pos)  # embedding first
        h2 = h1 + mlp(rms(h1, w[p + "post_attention_layernorm.weight"], eps), w, p)
        return h2, rms(h2, w["norm.weight"], eps) @ w["lm_head.weight"].T  # pre-norm state

    return forward


def eagle_ref(draft: Path, target: Path) -> Ref:
    w, t, c = raw(draft, target)
    eps, p = c["rms_norm_eps"], "layers.0."

    def forward(tokens: list[int], g: torch.Tensor, pos: list[int]) -> Any:
        x = lin(torch.cat((t["model.embed_tokens.weight"][tokens], g), -1), w, "fc")
        h = x + attention(x, w, p, c, pos)  # the input norm is the identity
        h = h + mlp(rms(h, w[p + "post_attention_layernorm.weight"], eps), w, p)
        return h, h @ t["lm_head.weight"].T  # no final norm; the target's head

    return forward


def mtp_ref(draft: Path, target: Path, k: int) -> Ref:
    w, t, c = raw(draft, target)
    p, eps = f"model.layers.{c['num_hidden_layers'] + k}.", c["rms_norm_eps"]
    embed = w.get(p + "embed_tokens.weight", t["model.embed_tokens.weight"])
    head = w.get(p + "shared_head.head.weight", t["lm_head.weight"])

    def forward(tokens: list[int], h: torch.Tensor, pos: list[int]) -> Any:
        e = rms(embed[tokens], w[p + "enorm.weight"], eps)
        x = lin(torch.cat((e, rms(h, w[p + "hnorm.weight"], eps)), -1), w, p + "eh_proj")
        x = x + attention(rms(x, w[p + "input_layernorm.weight"], eps), w, p, c, pos)
        x = x + mlp(rms(x, w[p + "post_attention_layernorm.weight"], eps), w, p)
        out = rms(x, w[p + "shared_head.norm.weight"], eps)
        return out, out @ head.T  # post-norm state

    return forward


# --- driving modules over paged KV -------------------------------------------------------------


def make_kv(geometry: DraftModule | ModelConfig, page_size: int) -> KVCache:
    spec = KVCacheSpec(
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        page_size=page_size,
        dtype=torch.float32,
    )
    return KVCache(spec, 128)


def context(kv: KVCache, lens: list[tuple[str, int]]) -> ForwardContext:
    """Appends ``n`` KV slots to each ``(req_id, n)`` and describes that flat step."""
    alloc, starts, ends = kv.allocator, [], []
    for req_id, n in lens:
        if req_id not in alloc:
            alloc.allocate(req_id, 0)
        starts.append(alloc.num_tokens(req_id))
        alloc.extend(req_id, n)
        ends.append(starts[-1] + n)
    req_ids = [r for r, _ in lens]
    meta = AttentionMetadata.build(
        page_size=alloc.page_size,
        query_lens=[n for _, n in lens],
        seq_lens=ends,
        page_table=alloc.page_table(req_ids),
        slot_mapping=kv.slot_mapping_tensor(req_ids, starts, ends),
    )
    return ForwardContext(kv=kv, meta=meta, backend=TorchAttention())


@dataclass
class Seq:
    """One request as the reference sees it: every pair consumed so far."""

    tokens: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # each [H]
    positions: list[int] = field(default_factory=list)
    out: torch.Tensor | None = None  # [n, H], the reference's outputs


def check_against_reference(
    module: DraftModule,
    ref: Ref,
    project: Callable[[torch.Tensor], torch.Tensor],  # [n, width] -> [n, H]
    width: int,
    page_size: int,
) -> None:
    """A ragged prefill of pairs, a batched extend, 3 recurrent single steps, a truncation of 2 of
    them and a re-extend: outputs and logits equal the dense reference over each sequence.
    ``project`` is the reference's own target-feature projection (features are random)."""
    gen = torch.Generator().manual_seed(1)
    kv, reqs = make_kv(module, page_size), ("a", "b", "c")
    seqs = {r: Seq() for r in reqs}
    last: dict[str, torch.Tensor] = {}  # the module's last output per request, [1, H]
    stream = {r: torch.randint(0, V, (64,), generator=gen).tolist() for r in reqs}

    def step(counts: dict[str, int], recurrent: bool) -> None:
        inputs = []
        for r, n in counts.items():
            s = seqs[r]
            pos = list(range(len(s.tokens), len(s.tokens) + n))
            s.tokens += [stream[r][q + module.shift] for q in pos]  # pair q eats t_{q+shift}
            s.positions += pos
            if recurrent:  # each side feeds back its own previous output
                assert s.out is not None
                hidden, s.hidden = last[r], [*s.hidden, s.out[-1]]
            else:
                feats = torch.randn(n, width, generator=gen)
                with torch.inference_mode():
                    hidden = module.project_target(feats)
                s.hidden += list(project(feats))
            inputs.append((r, s.tokens[-n:], hidden, pos))
        ctx = context(kv, [(r, len(t)) for r, t, _, _ in inputs])
        ids = torch.tensor([t for _, ts, _, _ in inputs for t in ts])
        positions = torch.tensor([q for *_, ps in inputs for q in ps])
        with torch.inference_mode():
            outs = module(ids, torch.cat([h for _, _, h, _ in inputs]), positions, ctx)
            logits = module.compute_logits(outs)
        assert logits.dtype == torch.float32 and logits.shape[1] == module.vocab_size
        lens = [len(t) for _, t, _, _ in inputs]
        for (r, *_), out, lg in zip(inputs, outs.split(lens), logits.split(lens), strict=True):
            s = seqs[r]
            s.out, ref_logits = ref(s.tokens, torch.stack(s.hidden), s.positions)
            torch.testing.assert_close(out, s.out[-len(out) :], atol=TOL, rtol=0)
            torch.testing.assert_close(lg, ref_logits[-len(out) :], atol=TOL, rtol=0)
            last[r] = out[-1:]

    step({"a": 1, "b": 6, "c": 11}, recurrent=False)
    step({"a": 4, "b": 4, "c": 1}, recurrent=False)
    for _ in range(3):
        step(dict.fromkeys(reqs, 1), recurrent=True)
    for r in reqs:  # the target accepted 1 of 3 drafted pairs: drop 2 from KV and reference
        kv.allocator.truncate(r, kv.allocator.num_tokens(r) - 2)
        s = seqs[r]
        s.tokens, s.hidden, s.positions = s.tokens[:-2], s.hidden[:-2], s.positions[:-2]
    step(dict.fromkeys(reqs, 3), recurrent=False)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_matches_dense_reference(
    target: Path, tmp_path: Path, page_size: int, norm_before_residual: bool
) -> None:
    path = make_eagle3_checkpoint(tmp_path / "e3", target, draft_vocab_size=997, seed=3)
    if norm_before_residual:
        edit_config(path, norm_before_residual=True)
    module = load_eagle3(path, target)
    assert (module.shift, module.uses_hidden, module.vocab_size) == (1, True, 997)
    fc = load_file(path / "model.safetensors")["fc.weight"]
    ref = eagle3_ref(path, target)
    check_against_reference(module, ref, lambda f: f @ fc.T, 3 * module.hidden_size, page_size)


@pytest.mark.parametrize("page_size", [1, 16])
def test_eagle_matches_dense_reference(target: Path, tmp_path: Path, page_size: int) -> None:
    path = make_eagle_checkpoint(tmp_path / "e1", target, bias=page_size == 1, seed=4)
    module = load_eagle(path, target)
    assert (module.fc.bias is not None) == (page_size == 1)
    ref = eagle_ref(path, target)
    check_against_reference(module, ref, lambda f: f, module.hidden_size, page_size)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("own_head", [False, True])
def test_mtp_heads_match_dense_reference(
    target: Path, tmp_path: Path, page_size: int, own_head: bool
) -> None:
    path = make_mtp_checkpoint(tmp_path / "mtp", target, num_heads=2, own_head=own_head, seed=5)
    heads = load_mtp(path, target)
    assert [(h.shift, h.head_index) for h in heads] == [(1, 0), (2, 1)]
    for k, head in enumerate(heads):
        ref = mtp_ref(path, target, k)
        check_against_reference(head, ref, lambda f: f, head.hidden_size, page_size)


def test_eagle3_consumes_the_targets_captured_aux_states(target: Path, tmp_path: Path) -> None:
    path = make_eagle3_checkpoint(tmp_path / "e3", target, draft_vocab_size=300, convention="vllm")
    module, tgt = load_eagle3(path, target), load_model(target)
    tokens = list(range(10, 19))
    with torch.inference_mode():
        ctx = context(make_kv(tgt.config, 4), [("r", 9)])
        out = tgt(torch.tensor(tokens), torch.arange(9), ctx, module.aux_layer_ids)
        g = module.project_target(torch.cat(out.captured, -1))  # [9, H]
        ctx = context(make_kv(module, 16), [("r", 8)])
        h2 = module(torch.tensor(tokens[1:]), g[:-1], torch.arange(8), ctx)
        target_ids = module.to_target_ids(module.compute_logits(h2).argmax(-1))
    assert bool(module.t2d[target_ids].all())
