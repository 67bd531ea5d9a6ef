"""The draft's graph runner (``tandem/draft/graphs.py``) against the host path.

A twin drafter runs every step through two ``ModelDrafter`` s with the same weights, one with
draft graphs (eager static here: the same buffers, padding and buckets, not captured; Triton
interpreted on CPU) and one without: the trees must be identical at every step and the carried
state (each module's last output) must agree, while requests arrive and finish (the batch moves
between buckets and pads), for EAGLE-3 and chained MTP at S=5 and S=3. Greedy output stays the
target-only output and both draft pools end empty. Draft-step positions (SGLang #25015) and the
chained-MTP hidden rule (#22041) are checked directly. The ``gpu`` tests capture for real and
compare graph replays against the eager drafter over more than 200 steps. Trees (K > 1):
``test_draft_tree_graphs.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.attention import _tree_attention_kernel
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.draft.drafter import ModelDrafter
from tandem.graphs.base import Bucket
from tandem.models.config import ModelConfig
from tandem.spec.types import DraftAdmit, SpecConfig, VerifyOutcome
from tandem.target.engine import Engine
from tests.driving import drive
from tests.helpers.draft_twin import (  # noqa: F401 (reference: a fixture)
    BATCH_SIZES,
    GPU_PLAN,
    PLAN,
    Twin,
    check_run,
    reference,
    target_only,
    twin_engine,
)
from tests.spec.conftest import KINDS, LAYERS, Checkpoints, make_drafter

check_mode(_tree_attention_kernel)


def test_transposed_draft_weights_change_only_their_layout(ckpts: Checkpoints) -> None:
    """``DraftConfig.transposed_weights`` (on by default for CUDA, as the target's) stores every
    projection of the head as the transpose of a row-major tensor: same values, same state."""
    common = {"kind": "eagle3", "path": ckpts.drafts["eagle3"], "target": ckpts.target}
    assert not DraftConfig(**common).use_transposed_weights  # CPU: off by default
    assert DraftConfig(**common, device="cuda").use_transposed_weights
    plain = build_drafter(DraftConfig(**common), LAYERS)
    moved = build_drafter(DraftConfig(**common, transposed_weights=True), LAYERS)
    assert isinstance(plain, ModelDrafter) and isinstance(moved, ModelDrafter)
    before, after = plain.modules[0].state_dict(), moved.modules[0].state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    linears = [m for m in moved.modules[0].modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) >= 5  # fc, qkv, o, gate_up, down, lm_head
    for m in linears:
        assert m.weight.t().is_contiguous() and not m.weight.is_contiguous()


def feature_width(drafter: ModelDrafter, ckpts: Checkpoints) -> int:
    hidden = ModelConfig.from_pretrained(ckpts.target).hidden_size
    return len(drafter.target_layer_ids) * hidden


@pytest.mark.parametrize("num_steps", [5, 3])
@pytest.mark.parametrize("kind", ["eagle3", "mtp-chain"])
def test_graph_trees_equal_host_trees(
    ckpts: Checkpoints,
    reference: list[list[int]],  # noqa: F811
    kind: str,
    num_steps: int,
) -> None:
    engine, twin = twin_engine(ckpts, kind, num_steps, capture=False)
    outputs, _ = drive(engine, PLAN)
    assert outputs == reference
    check_run(twin, min_buckets=3)
    runner = twin.graph.graphs
    assert runner is not None and not runner.captured


def draft_positions(drafter: ModelDrafter, width: int) -> list[list[int]]:
    """The RoPE positions of every module forward of one step: an outcome, then a chain."""
    seen: list[list[int]] = []
    hooks = [
        module.register_forward_pre_hook(lambda _m, args: seen.append(args[2].tolist()))
        for module in drafter.modules
    ]
    try:
        features = torch.zeros(2, width, device=DEVICE)
        outcome = VerifyOutcome(
            request_id="a", accepted_token_ids=[11], bonus_token_id=12, features=features
        )
        drafter.step([], [outcome], [])
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("kind", ["eagle3", "mtp-chain"])
def test_every_draft_step_runs_at_its_position(ckpts: Checkpoints, kind: str) -> None:
    """SGLang #25015: a draft step consumes the node of depth s at ``L - 1 + s - shift``; the
    loop computes it from a base buffer and never moves that buffer."""
    spec = SpecConfig(num_steps=5, topk=1)
    prompt = list(range(3, 13))
    graph, host = (make_drafter(ckpts, kind, str(DEVICE)) for _ in range(2))
    runner = graph.enable_graphs(batch_sizes=(1,), max_model_len=64, capture=False)
    width = feature_width(graph, ckpts)
    for drafter in (graph, host):
        features = torch.zeros(len(prompt) - 1, width, device=DEVICE)
        admit = DraftAdmit(request_id="a", token_ids=prompt, features=features, spec=spec)
        drafter.step([admit], [], [])
    ours, theirs = draft_positions(graph, width), draft_positions(host, width)
    length = len(prompt) + 2  # after the outcome: one accepted token and the bonus
    shifts = [m.shift for m in graph.modules]
    # The extend: every module consumes the two new tokens at their own positions.
    extend = [[length - 2 - s, length - 1 - s] for s in shifts]
    last = shifts[-1]  # the loop's module from step 1 on (head 1 for chained MTP)
    loop = [[length - 1 + depth - last] for depth in range(1, 5)]
    assert theirs == [*extend, *loop]
    assert [row[: len(want)] for row, want in zip(ours, theirs, strict=True)] == theirs
    assert all(len(row) == 6 for row in ours[: len(extend)])  # a bucket of S + 1 rows
    entry = runner.loops[Bucket(1, 6)]
    assert runner.replays[("loop", entry.bucket)] == 2  # after the admission and the outcome
    assert entry.base.tolist() == [length - 1]  # the replay moved no input
    first, second = runner.draft(["a"]), runner.draft(["a"])
    assert first is not None and first == second  # the same inputs give the same chain
    assert entry.base.tolist() == [length - 1]


def test_chained_mtp_heads_read_the_previous_heads_state(ckpts: Checkpoints) -> None:
    """SGLang #22041: head 1 drafts depth 1 from head 0's last committed output and depth 2
    on from its own outputs; the extend leaves every head's last output in the runner's
    buffers, from which the drafter's state is copied."""
    drafter = make_drafter(ckpts, "mtp-chain", str(DEVICE))
    runner = drafter.enable_graphs(batch_sizes=(1, 2), max_model_len=64, capture=False)
    spec = SpecConfig(num_steps=3, topk=1)
    prompt = list(range(3, 15))
    width = feature_width(drafter, ckpts)
    features = torch.randn(len(prompt) - 1, width, device=DEVICE)
    drafter.step(
        [DraftAdmit(request_id="a", token_ids=prompt, features=features, spec=spec)], [], []
    )
    hidden_in: list[torch.Tensor] = []
    hook = drafter.modules[1].register_forward_pre_hook(
        lambda _m, args: hidden_in.append(args[1].clone())
    )
    try:
        outcome = VerifyOutcome(
            request_id="a",
            accepted_token_ids=[5],
            bonus_token_id=6,
            features=torch.randn(2, width, device=DEVICE),
        )
        drafter.step([], [outcome], [])
    finally:
        hook.remove()
    seq = drafter.seqs["a"]
    extend_in, depth1, depth2 = hidden_in
    assert runner.replays == {("extend", Bucket(1, 4)): 1, ("loop", Bucket(1, 4)): 2}
    for m, last in enumerate(seq.last_out):
        assert last is not None and torch.equal(last, runner.last_out[m][0])
    assert torch.equal(depth1[0], seq.last_out[0])  # head 0's state, carried into head 1
    assert not torch.equal(depth2[0], depth1[0])  # then head 1's own output
    assert extend_in.shape[0] == 4  # S + 1 rows, two of them padding


def test_steps_no_bucket_takes_run_on_the_host(ckpts: Checkpoints) -> None:
    """Trees (K>1) next to chains, more requests than the largest bucket, and a pool without
    room for every scratch entry run the host loop, with the trees the host path gives."""
    graph, host = (make_drafter(ckpts, "eagle3", str(DEVICE)) for _ in range(2))
    runner = graph.enable_graphs(batch_sizes=(1, 2), max_model_len=64, capture=False)
    twin = Twin(graph, host)
    width = feature_width(graph, ckpts)
    tree = SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)
    specs = [tree, *[SpecConfig(num_steps=3)] * 3]
    admits = [
        DraftAdmit(
            request_id=f"r{i}",
            token_ids=list(range(3, 12 + i)),
            features=torch.zeros(8 + i, width, device=DEVICE),
            spec=spec,
        )
        for i, spec in enumerate(specs)
    ]

    def outcomes(ids: list[int]) -> list[VerifyOutcome]:
        return [
            VerifyOutcome(
                request_id=f"r{i}",
                accepted_token_ids=[],
                bonus_token_id=9,
                features=torch.zeros(1, width, device=DEVICE),
            )
            for i in ids
        ]

    trees = twin.step(admits, [], [])  # a tree among the chains
    assert len(trees["r0"]) == 5 and runner.replays == {}
    twin.step([], outcomes([1, 2]), [])  # two chains: a bucket
    assert runner.replays == {("extend", Bucket(2, 4)): 1, ("loop", Bucket(2, 4)): 1}
    twin.step([], outcomes([1, 2, 3]), [])  # three: larger than every bucket
    assert sum(runner.replays.values()) == 2
    # NaN logits end a chain at their depth (here the first), in a bucket as on the host.
    for drafter in (graph, host):
        last = drafter.seqs["r1"].last_out
        last[0] = torch.full_like(last[0], float("nan"))  # type: ignore[arg-type]
    trees = graph._draft(["r1", "r2"])
    assert trees == host._draft(["r1", "r2"]) and len(trees["r1"]) == 1 < len(trees["r2"])
    assert sum(runner.replays.values()) == 3
    twin.step([], [], [a.request_id for a in admits])
    assert twin.num_tracked() == 0

    # Three pages hold the 11 committed pairs and one scratch entry, not two.
    graph, host = (make_drafter(ckpts, "eagle3", str(DEVICE), num_pages=3) for _ in range(2))
    runner = graph.enable_graphs(batch_sizes=(1,), max_model_len=64, capture=False)
    trees = Twin(graph, host).step([admits[3]], [], [])
    assert len(trees["r3"]) == 3 and runner.eager_steps == 1 and runner.replays == {}


@pytest.mark.gpu
@pytest.mark.parametrize("num_steps", [5, 3])
@pytest.mark.parametrize("kind", ["eagle3", "mtp-chain"])
def test_captured_graph_trees_equal_eager_trees(
    ckpts: Checkpoints, kind: str, num_steps: int
) -> None:
    """Real capture on CUDA: every replayed chain and extend against the eager drafter over
    more than 200 steps while the batch moves between buckets."""
    if DEVICE.type != "cuda":
        pytest.skip("needs CUDA without TRITON_INTERPRET")
    engine, twin = twin_engine(ckpts, kind, num_steps, capture=True)
    runner = twin.graph.graphs
    assert runner is not None and runner.captured and runner.steps == [num_steps]
    outputs, steps = drive(engine, GPU_PLAN)
    assert steps >= 200
    assert outputs == target_only(ckpts, GPU_PLAN)
    check_run(twin, min_buckets=4)
    assert runner.steps == [num_steps]  # nothing captured on the way


@pytest.mark.gpu
def test_engine_with_target_graphs_captures_draft_graphs(
    ckpts: Checkpoints, caplog: pytest.LogCaptureFixture
) -> None:
    if DEVICE.type != "cuda":
        pytest.skip("needs CUDA without TRITON_INTERPRET")
    drafter = make_drafter(ckpts, "eagle3", "cuda", page_size=16, num_pages=256)
    config = EngineConfig(model=ckpts.target, device="cuda", num_pages=256, max_num_seqs=8)
    with caplog.at_level(logging.INFO, logger="tandem.draft.graphs"):
        engine = Engine(config, drafter=drafter, spec=SpecConfig(num_steps=4, topk=1))
    runner = drafter.graphs
    assert runner is not None and runner.captured and runner.steps == [4]
    count = 2 * len(config.graph_batch_sizes)  # a loop and an extend per batch size
    assert f"captured {count} draft CUDA graphs" in caplog.text and "MiB" in caplog.text
    outputs, _ = drive(engine, PLAN)
    assert outputs == target_only(ckpts, PLAN)
    assert any(kind == "loop" for kind, _ in runner.replays)
    assert all(kv.allocator.num_free_pages == kv.allocator.num_pages for kv in drafter.kvs)


def test_served_heads_need_no_grad(ckpts: Checkpoints) -> None:
    """build_drafter's modules never train: no parameter asks for grad, so ``fused_ops`` may
    take the Triton kernels whatever the grad mode of the caller (a capture at load)."""
    for kind in (k for k in KINDS if k != "ngram"):
        drafter = make_drafter(ckpts, kind, str(DEVICE))
        assert not any(p.requires_grad for m in drafter.modules for p in m.parameters())


@pytest.mark.gpu
def test_capture_takes_the_fused_kernels(
    ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture outside inference mode, of heads whose parameters ask for grad, still records
    the Triton kernels (``capture_graph`` runs in inference mode): before, it recorded the eager
    references (about 120 more kernels a bs-1 draft step of the 8B-shaped EAGLE-3 head)."""
    if DEVICE.type != "cuda":
        pytest.skip("needs CUDA without TRITON_INTERPRET")
    import kernels
    from tandem.models import decoder

    drafter = make_drafter(ckpts, "eagle3", "cuda", page_size=16, num_pages=64)
    for module in drafter.modules:
        module.requires_grad_(True)
    chosen: list[kernels.Ops] = []

    def spy(*tensors: torch.Tensor) -> kernels.Ops:
        chosen.append(original(*tensors))
        return chosen[-1]

    original = decoder.fused_ops
    monkeypatch.setattr(decoder, "fused_ops", spy)
    assert torch.is_grad_enabled()
    runner = drafter.enable_graphs(batch_sizes=(1, 2), max_model_len=64, num_steps=(3,))
    assert runner.captured and chosen
    assert all(ops is not kernels.REFERENCE for ops in chosen)
