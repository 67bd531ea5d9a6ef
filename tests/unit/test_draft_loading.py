"""The draft loaders' conventions (aux layer ids, d2t, the lm_head an EAGLE head uses, MTP
layouts and dtypes, rope read like the target's) and their errors, each naming the problem."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.errors import CheckpointError
from tandem.models import ModelConfig
from tandem.models.draft_loader import load_eagle, load_eagle3, load_mtp, load_standalone
from tandem.models.eagle import default_aux_layer_ids
from tandem.testing.random_drafts import (
    make_eagle3_checkpoint,
    make_eagle_checkpoint,
    make_mtp_checkpoint,
)
from tests.checkpoints import edit_config, edit_tensors, make_checkpoint

TOL = 1e-5
V = 6000  # tandem.testing.random_model.BASE
W = dict[str, torch.Tensor]


# --- conventions -------------------------------------------------------------------------------


def test_aux_id_conventions_normalise_to_hidden_states_index(target: Path, tmp_path: Path) -> None:
    def load(name: str, **kwargs: Any) -> Any:
        return load_eagle3(make_eagle3_checkpoint(tmp_path / name, target, **kwargs), target)

    spec = load("s", aux_layer_ids=[1, 0, 2])  # outputs of layers 1, 0, 2
    vllm = load("v", aux_layer_ids=[2, 1, 3], convention="vllm")  # inputs of layers 2, 1, 3
    assert spec.aux_layer_ids == vllm.aux_layer_ids == (2, 1, 3)
    assert (spec.aux_id_convention, vllm.aux_id_convention) == ("specforge", "vllm")
    assert torch.equal(spec.fc.weight, vllm.fc.weight)  # same seed: the same head
    default = load("d", convention="default")
    assert (default.aux_layer_ids, default.aux_id_convention) == ((2, 1, 0), "default")
    assert default_aux_layer_ids(32) == (2, 16, 29)  # Llama-3.1-8B, draft-formats.md 1.5
    with pytest.raises(CheckpointError, match=r"4 outside \[0, 3\]"):
        load("x", aux_layer_ids=[1, 2, 3])
    both = make_eagle3_checkpoint(tmp_path / "both", target, aux_layer_ids=[1, 0, 2])
    edit_config(both, eagle_aux_hidden_state_layer_ids=[1, 0, 2])  # read raw: other layers
    with pytest.raises(CheckpointError, match="different"):
        load_eagle3(both, target)


def test_d2t_round_trip(target: Path, tmp_path: Path) -> None:
    path = make_eagle3_checkpoint(tmp_path / "e3", target, draft_vocab_size=123, seed=9)
    module = load_eagle3(path, target)
    mapped = module.to_target_ids(torch.arange(123))
    t2d = load_file(path / "model.safetensors")["t2d"]
    assert torch.equal(mapped, t2d.nonzero().flatten())  # a sorted subset, target order kept
    assert bool((mapped.diff() > 0).all()) and bool(module.t2d[mapped].all())
    full = load_eagle3(make_eagle3_checkpoint(tmp_path / "full", target), target)
    assert torch.equal(full.to_target_ids(torch.arange(V)), torch.arange(V))


def test_eagle_uses_the_targets_lm_head_even_with_a_decoy(tmp_path: Path) -> None:
    for tied in (False, True):
        tgt = make_checkpoint(tmp_path / f"t{tied}", tokenizer=False, tie_word_embeddings=tied)
        path = make_eagle_checkpoint(tmp_path / f"e{tied}", tgt, bias=False)
        # Some uploads carry an lm_head; EAGLE-1 never uses it.
        edit_tensors(path, lambda w: w.update({"lm_head.weight": torch.randn(V, 64)}))
        module, t = load_eagle(path, tgt), load_file(tgt / "model.safetensors")
        head = t["model.embed_tokens.weight"] if tied else t["lm_head.weight"]
        assert torch.equal(module.lm_head.weight, head)
        h = torch.randn(5, 64)
        with torch.inference_mode():
            torch.testing.assert_close(module.compute_logits(h), h @ head.T, atol=TOL, rtol=0)


def test_mtp_layouts_and_dtype(target: Path, tmp_path: Path) -> None:
    path = make_mtp_checkpoint(tmp_path / "mtp", target, num_heads=2, seed=2)
    w, cfg = load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())
    export, full = tmp_path / "export", tmp_path / "full"
    # SGLang's export: model.layers.{k} with num_hidden_layers == M.
    export.mkdir()
    renamed = {n.replace(".3.", ".0.").replace(".4.", ".1."): t for n, t in w.items()}
    save_file(renamed, export / "model.safetensors")
    cfg_export = dict(cfg, num_hidden_layers=2)
    cfg_export.pop("layer_types", None)  # Qwen2 configs list one type per layer
    (export / "config.json").write_text(json.dumps(cfg_export))
    # DeepSeek's layout: the MTP layers inside the full target checkpoint.
    full.mkdir()
    save_file(load_file(target / "model.safetensors") | w, full / "model.safetensors")
    (full / "config.json").write_text(json.dumps(cfg))
    heads = load_mtp(path, target)
    for other in (load_mtp(export, target), load_mtp(full, target)):
        for a, b in zip(heads, other, strict=True):
            for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
                assert torch.equal(x, y)
    half = load_mtp(path, target, dtype=torch.bfloat16)[1]
    assert half.eh_proj.weight.dtype == torch.bfloat16
    assert half.rotary.inv_freq.dtype == torch.float32


def test_draft_rope_is_read_like_the_targets(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    tgt = make_checkpoint(tmp_path / "t", tokenizer=False, rope_parameters=rope)
    module = load_eagle3(make_eagle3_checkpoint(tmp_path / "e3", tgt), tgt)
    expected = torch.tensor(ModelConfig.from_pretrained(tgt).inv_freq)
    assert torch.equal(module.rotary.inv_freq, expected)
    assert not torch.equal(expected, 1.0 / 500000.0 ** (torch.arange(0, 16, 2) / 16))


# --- loader errors ------------------------------------------------------------------------------


def to_pickle(path: Path) -> None:
    """Leaves only a pytorch_model.bin, as older SafeAILab uploads have."""
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()


def drop(name: str) -> Callable[[Path], None]:
    return lambda p: edit_tensors(p, lambda w: w.pop(name))


def put(name: str, make: Callable[[W], torch.Tensor]) -> Callable[[Path], None]:
    return lambda p: edit_tensors(p, lambda w: w.update({name: make(w)}))


def cfg(**changes: Any) -> Callable[[Path], None]:
    return lambda p: edit_config(p, **changes)


MISSING, UNEXPECTED = r"missing tensors \['", r"unexpected tensors \['"
BREAKAGES: list[tuple[str, Callable[[Path], Any], str]] = [
    ("eagle3", drop("midlayer.mlp.up_proj.weight"), MISSING + r"midlayer\.mlp\.up_proj\.weight'"),
    ("eagle3", drop("lm_head.weight"), MISSING + r"lm_head\.weight'"),  # V_d < V: needed
    ("eagle3", put("fc.weight", lambda w: w["fc.weight"][:, :128].clone()),
     r"fc\.weight has shape \(64, 128\), expected \(64, 192\)"),
    ("eagle3", put("midlayer.extra.weight", lambda w: torch.ones(3)), UNEXPECTED + "midlayer"),
    ("eagle3", put("d2t", lambda w: w["d2t"] + V), "d2t maps draft ids outside"),
    ("eagle3", cfg(norm_before_fc=True), "norm_before_fc"),
    ("eagle3", to_pickle, "pickle"),
    ("eagle", put("layers.0.input_layernorm.weight", lambda w: torch.ones(64)),
     UNEXPECTED + r"layers\.0\.input_layernorm\.weight'"),
    ("mtp", cfg(num_nextn_predict_layers=3), MISSING + r"model\.layers\.5\."),
    ("mtp", cfg(num_nextn_predict_layers=1), r"unexpected tensors under model\.layers\.\[4\]"),
    ("mtp", cfg(num_nextn_predict_layers=None), "num_nextn_predict_layers"),
]  # fmt: skip
KINDS: dict[str, tuple[Callable[[Path, Path], Path], Callable[[Path, Path], Any]]] = {
    "eagle3": (partial(make_eagle3_checkpoint, draft_vocab_size=50), load_eagle3),
    "eagle": (make_eagle_checkpoint, load_eagle),
    "mtp": (make_mtp_checkpoint, load_mtp),
}


@pytest.mark.parametrize(("kind", "edit", "message"), BREAKAGES)
def test_loader_errors_name_the_problem(
    tmp_path: Path, kind: str, edit: Callable[[Path], Any], message: str
) -> None:
    tgt = make_checkpoint(tmp_path / "t", tokenizer=False)
    write, load = KINDS[kind]
    path = write(tmp_path / kind, tgt)
    edit(path)
    with pytest.raises(CheckpointError, match=message):
        load(path, tgt)


def test_standalone_draft_must_share_the_tokenizer(tmp_path: Path) -> None:
    tgt = make_checkpoint(tmp_path / "target")
    draft = load_standalone(make_checkpoint(tmp_path / "ok", num_hidden_layers=1), tgt)
    assert (draft.shift, draft.uses_hidden, draft.vocab_size) == (0, False, V)
    small = make_checkpoint(tmp_path / "small", vocab_size=5000, tokenizer=False)
    with pytest.raises(CheckpointError, match="vocab_size 5000"):
        load_standalone(small, tgt)
    other = make_checkpoint(tmp_path / "other", vocab_size=5000)
    with pytest.raises(CheckpointError, match="tokenizer differs"):
        load_standalone(other, tgt)
