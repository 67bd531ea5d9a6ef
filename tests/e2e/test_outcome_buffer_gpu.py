"""Outcome features through the draft's shared buffer on a GPU: CUDA IPC, so the draft service
runs in its own process (a process cannot open its own IPC handle). It reads every step's
outcome features where the target wrote them, its copies out queued and waited for once per
answer, and drafts the trees the in-process drafter drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.apps.demo import free_port
from tandem.apps.launch import Service, Stack
from tandem.config import DraftConfig
from tandem.draft.build import build_drafter
from tandem.link import messages
from tandem.link.remote import RemoteDrafter
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tests.helpers.draft_service import LAYERS, VOCAB, check_outcomes_through_the_buffer

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device"),
]


def test_outcomes_through_the_drafts_cuda_buffer_give_the_same_trees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(messages, "SHARED_OUTCOME_BYTES", 1)
    target = make_checkpoint(
        tmp_path / "target", "llama", seed=5, vocab_size=VOCAB, num_hidden_layers=LAYERS
    )
    draft = make_eagle3_checkpoint(tmp_path / "eagle3", target, draft_vocab_size=512, seed=1)
    config = DraftConfig(kind="eagle3", path=draft, target=target, num_pages=256, device="cuda")
    port = free_port()
    args = [
        *("--target", str(target), "--draft", str(draft), "--draft-kind", "eagle3"),
        *("--device", "cuda", "--dtype", config.dtype, "--page-size", str(config.page_size)),
        *("--num-pages", str(config.num_pages), "--port", str(port)),
        *("--local-socket", str(tmp_path / "d.sock"), "--prompt-buffer-mb", "1"),
        *("--no-cuda-graphs", "--no-transposed-weights"),  # as the in-process drafter
    ]
    stack = Stack([Service("draft", "draft_service", args, port)])
    stack.start(log_dir=tmp_path / "logs")
    remote = RemoteDrafter(f"127.0.0.1:{port}", num_target_layers=LAYERS, device="cuda")
    try:
        check_outcomes_through_the_buffer(build_drafter(config, LAYERS), remote, "cuda")
    finally:
        remote.close()
        stack.stop()
