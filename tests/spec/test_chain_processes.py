"""The device-chain halves in two processes (docs/device-cycle.md, stage 3): the target half
here, the draft half in a child process (``tests/helpers/chain_peer.py``), their ``Outcome``
and ``Chains`` buffers shared through ``tandem/link/ipc.py`` (CPU shared memory here, the
stand-in for CUDA IPC).

Greedy output equals target-only output, and every step accepts exactly what the same halves
accept in one process with the same draft state. With simulated acceptance the committed
tokens are the draft's own, so equal outputs there mean the draft half saw the same outcomes
and answered the same chains across the process boundary.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.kernels._interpret import DEVICE, INTERPRETED  # sets Triton's mode: import first

# isort: split
from tandem.config import EngineConfig
from tandem.draft.drafter import ModelDrafter
from tandem.graphs.base import Bucket
from tandem.link import ipc
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.spec.chain import Outcome
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import DraftAdmit, SpecConfig, Tree
from tandem.target.chain_verify import TargetChain
from tandem.target.engine import Engine
from tests.helpers.chain_peer import MAX_MODEL_LEN, NOTICE
from tests.spec.conftest import Checkpoints, make_drafter

# The halves here hand off by notices alone, which orders CPU work only: on CUDA a notice says
# the work is enqueued, not done, and the halves wait on each other's events instead
# (bench/chain_ipc.py runs that on the GPU).
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not INTERPRETED, reason="CPU only: notices alone order CPU work, CUDA needs the events"
    ),
]

S, W = 3, 4
PROMPT = [5, 9, 17, 4, 250, 31, 77, 5, 9, 17]
NEW_TOKENS = 30


def target_engine(ckpts: Checkpoints, layers: tuple[int, ...]) -> tuple[Engine, Request]:
    """A target with its verify bucket (eager static), the prompt prefilled."""
    config = EngineConfig(
        model=ckpts.target,
        device=str(DEVICE),
        page_size=4,
        num_pages=256,
        max_num_seqs=1,
        max_model_len=MAX_MODEL_LEN,
        cuda_graphs=False,
    )
    engine = Engine(config)
    engine.runner.enable_graphs(
        batch_sizes=(1,),
        widths=(1, W),
        max_model_len=MAX_MODEL_LEN,
        capture_layers=layers,
        capture=False,
    )
    engine.add_request(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS + 2 * W, ignore_eos=True))
    engine.step()  # the prompt, and the first token
    req = engine.scheduler.running[0]
    req.tree = Tree(tokens=(req.tokens[-1],), parents=(-1,))
    return engine, req


def prompt_features(num: int, width: int) -> torch.Tensor:
    """The admitted prompt's features: drawn, the same in both runs (the draft's guesses need
    not be good for the comparison; they must be the same)."""
    gen = torch.Generator().manual_seed(3)
    return torch.randn(num, width, generator=gen).share_memory_()


def drive(
    engine: Engine, req: Request, half: TargetChain, draft_step: Callable[[int, int], None]
) -> tuple[list[int], list[int]]:
    """Device-chain steps until NEW_TOKENS: the target half launched, then the draft's
    (``draft_step(length, unread)``); each verdict read a step late. Returns the generated
    tokens and each step's accept count."""
    accepts: list[int] = []
    while len(req.output_ids) < NEW_TOKENS:
        unread = len(half.unread)
        assert half.reserve([(req.request_id, req.num_tokens)], unread)
        length = req.num_tokens
        half.launch()
        draft_step(length, unread)
        if len(half.unread) >= 2:
            (verdict,) = half.read(1)
            req.output_ids.extend(verdict.new_tokens)
            accepts.append(verdict.accepted)
    return req.output_ids[:NEW_TOKENS], accepts


Run = tuple[list[int], list[int]]  # generated tokens, accepted drafts per step


def one_process(ckpts: Checkpoints, simulator: AcceptSimulator | None) -> Run:
    """Both halves here, the draft admitted with the drawn prompt features."""
    drafter = make_drafter(ckpts, "eagle3", str(DEVICE), 4, 256)
    assert isinstance(drafter, ModelDrafter)
    drafter.enable_graphs(
        batch_sizes=(1,), max_model_len=MAX_MODEL_LEN, num_steps=(S,), capture=False
    )
    engine, req = target_engine(ckpts, drafter.target_layer_ids)
    width = engine.runner.graphs.features.shape[-1]  # type: ignore[union-attr]
    features = prompt_features(req.num_tokens - 1, width)
    spec = SpecConfig(num_steps=S, topk=1)
    admit = DraftAdmit(request_id="r", token_ids=req.tokens, features=features, spec=spec)
    drafter.step([admit], [], [])
    target = TargetChain(engine.runner.graphs, engine.kv, S, simulator)  # type: ignore[arg-type]
    draft = drafter.chain_half(S, DEVICE)
    draft.request_ids = ["r"]
    assert draft.reserve([req.num_tokens], 0)
    assert target.reserve([(req.request_id, req.num_tokens)], 0)
    target.chains = draft.chains = target.begin([req], Bucket(1, W))
    target.outcome = draft.outcome = draft.begin(["r"], Bucket(1, W))

    def local(length: int, unread: int) -> None:
        assert draft.reserve([length], unread)
        draft.launch()

    return drive(engine, req, target, local)


def two_processes(ckpts: Checkpoints, simulator: AcceptSimulator | None, tmp: Path) -> Run:
    """The target half here, the draft half in ``chain_peer``, the buffers shared."""
    path = tmp / "chain.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    command = [sys.executable, "-m", "tests.helpers.chain_peer", str(path)]
    child = subprocess.Popen([*command, str(ckpts.target), str(ckpts.drafts["eagle3"]), str(S)])
    try:
        server.settimeout(300)
        conn, _ = server.accept()
        with conn:
            frame = ipc.recv_frame(conn)
            engine, req = target_engine(ckpts, struct.unpack(f"<{len(frame) // 8}q", frame))
            width = engine.runner.graphs.features.shape[-1]  # type: ignore[union-attr]
            ipc.send_frame(conn, struct.pack(f"<{req.num_tokens}q", *req.tokens))
            ipc.send_frame(conn, str(width).encode())
            shared = prompt_features(req.num_tokens - 1, width)  # alive while the child maps it
            ipc.send_frame(conn, ipc.describe(shared))
            target = TargetChain(engine.runner.graphs, engine.kv, S, simulator)  # type: ignore[arg-type]
            assert target.reserve([(req.request_id, req.num_tokens)], 0)
            chains = target.begin([req], Bucket(1, W))
            frames = [ipc.recv_frame(conn) for _ in range(5)]
            target.outcome = Outcome(
                base=ipc.open_buffer(frames[0], (1,), torch.int64),
                accepted=ipc.open_buffer(frames[1], (1,), torch.int64),
                new=ipc.open_buffer(frames[2], (1, W), torch.int64),
                alive=ipc.open_buffer(frames[3], (1,), torch.bool),
                features=ipc.open_buffer(frames[4], (W, width), torch.float32),
            )
            for tensor in (chains.tokens, chains.valid):
                ipc.send_frame(conn, ipc.describe(tensor))

            def remote(length: int, unread: int) -> None:
                ipc.send_frame(conn, NOTICE.pack(length, unread))
                assert ipc.recv_frame(conn) == b"d"

            run = drive(engine, req, target, remote)
            ipc.send_frame(conn, b"")
    finally:
        assert child.wait(timeout=300) == 0
        server.close()
    return run


def test_greedy_output_across_processes_equals_target_only(
    ckpts: Checkpoints, tmp_path: Path
) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    config = EngineConfig(model=ckpts.target, device=str(DEVICE), num_pages=64, cuda_graphs=False)
    reference = Engine(config).generate([PROMPT], params)[0].token_ids
    alone, alone_accepts = one_process(ckpts, None)
    apart, apart_accepts = two_processes(ckpts, None, tmp_path)
    assert alone == apart == reference
    assert apart_accepts == alone_accepts


def test_the_draft_half_answers_alike_across_processes(ckpts: Checkpoints, tmp_path: Path) -> None:
    """Simulated acceptance commits the draft's own tokens, so the output is the drafts: equal
    outputs and accept counts mean the draft half drafted the same chains in its process."""
    alone = one_process(ckpts, AcceptSimulator(3.0, S))
    apart = two_processes(ckpts, AcceptSimulator(3.0, S), tmp_path)
    assert apart == alone
    assert sum(alone[1]) >= len(alone[1]), alone[1]  # about two drafts a step accepted
