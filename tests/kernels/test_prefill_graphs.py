"""The prefill graphs without capture ("eager static"): a prompt chunk alone in its step runs on the
static buffers and padding a CUDA-graph replay uses (``tandem.target.prefill_graphs``). Without CUDA
the Triton kernels run in the interpreter on CPU tensors; on a CUDA host the same tests run them
compiled.

Every such chunk is rerun through the eager path on the same KV (``tests.driving.Shadow``): the
last row's logits, every row's target features and the KV writes must agree, for whole prompts
and for chunks of longer ones (a prefix already in the KV), padded to a wider bucket and exact,
at page sizes 1 and 16; greedy outputs equal target-only decoding with every step eager.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.attention import _tree_attention_kernel
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.spec.types import SpecConfig
from tandem.target.engine import Engine
from tandem.target.graphs import graph_widths
from tandem.target.prefill_graphs import PrefillGraphRunner
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tests.driving import Arrival, Shadow, drive

check_mode(_tree_attention_kernel)

VOCAB = 999
LAYERS = 4
ATOL = 1e-4  # fp32: the static buffers' padded rows against the eager step
BUDGET = 12  # tokens per step: a 30-token prompt takes chunks of 12, 12 and 6
WIDTHS = (4, 8, 16)
# Each request arrives after the last one finished, so its prompt chunks run alone; the last
# two arrive together (one eager step holds both prompts).
PLAN = [
    Arrival(step=0, prompt=[11, 12, 13], max_new_tokens=4),  # width 4, padded
    Arrival(step=6, prompt=list(range(100, 130)), max_new_tokens=5),  # chunks 12, 12, 6
    Arrival(step=16, prompt=list(range(300, 308)), max_new_tokens=3),  # width 8, exact
    Arrival(step=22, prompt=list(range(400, 411)), max_new_tokens=3),
    Arrival(step=22, prompt=[7, 8], max_new_tokens=3),
]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefill_graphs")
    # Qwen2 has q/k/v biases: a padding row's K/V is not zero, so a stray KV write shows.
    target = make_checkpoint(
        root / "target", "qwen2", seed=5, vocab_size=VOCAB, num_hidden_layers=LAYERS
    )
    eagle3 = make_eagle3_checkpoint(root / "eagle3", target, draft_vocab_size=256, seed=1)
    return {"target": target, "eagle3": eagle3}


@pytest.fixture(scope="module")
def reference(ckpts: dict[str, Path]) -> list[list[int]]:
    """Target-only greedy outputs, all steps eager."""
    config = EngineConfig(model=ckpts["target"], device=str(DEVICE), num_pages=64)
    outputs, _ = drive(Engine(config), PLAN)
    return outputs


def static_engine(ckpts: dict[str, Path], speculate: bool, page_size: int) -> Engine:
    """An engine whose lone prompt chunks (and decode/verify steps) run on static buffers."""
    config = EngineConfig(
        model=ckpts["target"],
        device=str(DEVICE),
        page_size=page_size,
        num_pages=1024 // page_size,
        max_num_batched_tokens=BUDGET,
        prefill_graph_tokens=WIDTHS,
    )
    drafter = spec = None
    if speculate:
        spec = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
        drafter = build_drafter(
            DraftConfig(
                kind="eagle3",
                path=ckpts["eagle3"],
                target=ckpts["target"],
                device=str(DEVICE),
                page_size=page_size,
                num_pages=1024 // page_size,
            ),
            LAYERS,
        )
    engine = Engine(config, drafter=drafter, spec=spec)
    layers = drafter.target_layer_ids if drafter is not None else ()
    engine.runner.enable_graphs(
        batch_sizes=(1, 2),
        widths=graph_widths(spec.tree_size if spec is not None else None),
        max_model_len=engine.max_model_len,
        capture_layers=layers,
        capture=False,
    )
    engine.runner.enable_prefill_graphs(
        widths=config.prefill_graph_widths,
        max_model_len=engine.max_model_len,
        capture_layers=layers,
        capture=False,
    )
    return engine


@pytest.mark.slow  # whole models, captured and eager, in Triton's interpreter on CPU
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "eagle3-chain"])
def test_lone_prompt_chunks_match_eager_steps(
    ckpts: dict[str, Path], reference: list[list[int]], speculate: bool, page_size: int
) -> None:
    engine = static_engine(ckpts, speculate, page_size)
    shadow = Shadow(engine, atol=ATOL)
    outputs, _ = drive(engine, PLAN)
    assert outputs == reference
    assert shadow.prefills == [
        (4, 3, True),
        (16, 12, False),
        (16, 12, False),
        (8, 6, True),
        (8, 8, True),
    ]  # the last two prompts shared a step: eager
    runner = engine.runner.prefill_graphs
    assert runner is not None and runner.replays == {4: 1, 8: 2, 16: 2}
    if speculate:
        assert engine.drafter is not None and engine.drafter.num_tracked() == 0


def test_plan_pads_the_chunk(ckpts: dict[str, Path]) -> None:
    config = EngineConfig(model=ckpts["target"], device=str(DEVICE), page_size=4, num_pages=64)
    engine = Engine(config)
    runner = engine.runner.enable_prefill_graphs(widths=(8, 4), max_model_len=64, capture=False)
    assert runner.widths == [4, 8]
    alloc = engine.kv.allocator
    alloc.allocate("r", 11)
    chunk = runner.plan("r", 5, [21, 22, 23, 24, 25, 26], last=True)
    assert chunk is not None and chunk.width == 8 and chunk.num_tokens == 6
    assert chunk.input_ids == [21, 22, 23, 24, 25, 26, 0, 0]
    assert chunk.positions == [5, 6, 7, 8, 9, 10, 0, 0]
    assert chunk.slot_mapping == [*alloc.slot_mapping("r", 5, 11), -1, -1]
    assert chunk.seq_len == 11 and chunk.pages == alloc.pages("r")
    assert runner.plan("r", 0, list(range(9)), last=True) is None  # wider than every width
    assert runner.plan("r", 0, [], last=True) is None
    alloc.extend("r", 64)  # capacity past the 64-token context: no page table row holds it
    assert runner.plan("r", 5, [21, 22], last=True) is None


def test_a_chunk_run_changes_nothing_it_reads(ckpts: dict[str, Path]) -> None:
    """SGLang #25015: running a chunk twice gives the same logits, features and KV; a chunk
    that does not end the prompt returns no logits."""
    config = EngineConfig(model=ckpts["target"], device=str(DEVICE), page_size=4, num_pages=64)
    engine = Engine(config)
    runner = engine.runner.enable_prefill_graphs(
        widths=(4, 8), max_model_len=64, capture_layers=(1, LAYERS), capture=False
    )
    kv = engine.kv
    kv.allocator.allocate("r", 12)
    for cache in [*kv.k_caches, *kv.v_caches]:
        cache[kv.spec.page_size :].normal_(generator=torch.Generator(DEVICE).manual_seed(0))
    chunk = runner.plan("r", 7, [5, 6, 7, 8, 9], last=True)
    assert chunk is not None
    first = runner.run(chunk, (1, LAYERS))
    caches = [c.clone() for c in [*kv.k_caches, *kv.v_caches]]
    second = runner.run(chunk, (1, LAYERS))
    assert torch.equal(first[0], second[0]) and first[0].shape == (1, VOCAB)
    assert first[1] is not None and second[1] is not None and torch.equal(first[1], second[1])
    assert first[1].shape[0] == 5
    assert all(map(torch.equal, caches, [*kv.k_caches, *kv.v_caches]))
    middle = runner.plan("r", 7, [5, 6, 7, 8, 9], last=False)
    assert middle is not None and runner.run(middle, (1, LAYERS))[0].shape == (0, VOCAB)
    assert runner.replays == {8: 3}


def test_config_widths() -> None:
    config = EngineConfig(model=Path("m"))
    assert config.prefill_graph_tokens == (16, 32, 64, 128, 256, 512)
    assert config.prefill_graph_widths == config.prefill_graph_tokens  # budget 2048
    assert EngineConfig(model=Path("m"), max_num_batched_tokens=100).prefill_graph_widths == (
        16, 32, 64, 128,
    )  # fmt: skip
    assert EngineConfig(model=Path("m"), prefill_graph_tokens=()).prefill_graph_widths == ()
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(model=Path("m"), prefill_graph_tokens=(32, 16))
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(model=Path("m"), prefill_graph_tokens=(0, 16))
    with pytest.raises(ValueError, match="widths"):
        PrefillGraphRunner(None, None, widths=(), max_model_len=8)  # type: ignore[arg-type]


def test_target_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from target_service.__main__ import _config, build_parser

    args = ["--target", "m"]
    default = _config(build_parser().parse_args(args)).engine
    assert default.prefill_graph_tokens == (16, 32, 64, 128, 256, 512)
    given = build_parser().parse_args([*args, "--prefill-graph-tokens", "8,64"])
    assert _config(given).engine.prefill_graph_tokens == (8, 64)
    off = build_parser().parse_args([*args, "--prefill-graph-tokens", "off"])
    assert _config(off).engine.prefill_graph_tokens == ()
    monkeypatch.setenv("TANDEM_TARGET_PREFILL_GRAPH_TOKENS", "32")
    assert _config(build_parser().parse_args(args)).engine.prefill_graph_tokens == (32,)
    for bad in ("64,8", "0"):  # parse_args turns the config's ValueError into a usage exit
        wrong = build_parser().parse_args([*args, "--prefill-graph-tokens", bad])
        with pytest.raises(ValueError, match="prefill_graph_tokens: need increasing counts"):
            _config(wrong)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--prefill-graph-tokens", "a,b"])
