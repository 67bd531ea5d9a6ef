"""The draft process of ``tests/spec/test_chain_processes.py``: a ``DraftChain`` over an
EAGLE-3 drafter, handing off with the test's target process through ``tandem/link/ipc.py``
buffers.

    python -m tests.helpers.chain_peer SOCKET TARGET_DIR DRAFT_DIR NUM_STEPS

The conversation, all frames (``ipc.send_frame``): this process sends its drafter's target
layers; receives the request's committed tokens and the description of its prompt features
(target-owned shared memory), admits it, stages its half and sends the descriptions of its
``Outcome`` buffers; receives those of the target's ``Chains``. Then, per step: a notice from
the target (its half is launched: the last length it read and its unread steps), the draft
half launched, a notice back. An empty notice ends it.
"""

from __future__ import annotations

import socket
import struct
import sys
from pathlib import Path

from tests.kernels._interpret import DEVICE  # sets Triton's mode: import first

# isort: split
import torch

from tandem.config import DraftConfig
from tandem.draft.build import build_drafter
from tandem.draft.drafter import ModelDrafter
from tandem.graphs.base import Bucket
from tandem.link import ipc
from tandem.spec.chain import Chains
from tandem.spec.types import DraftAdmit, SpecConfig

MAX_MODEL_LEN = 128
NOTICE = struct.Struct("<qq")  # the target's last read length, its unread steps


def main(argv: list[str]) -> None:
    path, target, draft, num_steps = argv[0], Path(argv[1]), Path(argv[2]), int(argv[3])
    w = num_steps + 1
    config = DraftConfig(
        kind="eagle3", path=draft, target=target, device=str(DEVICE), page_size=4, num_pages=256
    )
    drafter = build_drafter(config, num_target_layers=4)
    assert isinstance(drafter, ModelDrafter)
    drafter.enable_graphs(
        batch_sizes=(1,), max_model_len=MAX_MODEL_LEN, num_steps=(num_steps,), capture=False
    )
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    with conn:
        layers = drafter.target_layer_ids
        ipc.send_frame(conn, struct.pack(f"<{len(layers)}q", *layers))
        frame = ipc.recv_frame(conn)
        tokens = list(struct.unpack(f"<{len(frame) // 8}q", frame))
        width = int(ipc.recv_frame(conn).decode())
        features = ipc.open_buffer(ipc.recv_frame(conn), (len(tokens) - 1, width), torch.float32)
        spec = SpecConfig(num_steps=num_steps, topk=1)
        admit = DraftAdmit(request_id="r", token_ids=tokens, features=features.clone(), spec=spec)
        drafter.step([admit], [], [])
        half = drafter.chain_half(num_steps, DEVICE)
        half.request_ids = ["r"]
        assert half.reserve([len(tokens)], 0)
        outcome = half.begin(["r"], Bucket(1, w))
        assert outcome.features is not None
        for tensor in (outcome.base, outcome.accepted, outcome.new, outcome.alive):
            ipc.send_frame(conn, ipc.describe(tensor))
        ipc.send_frame(conn, ipc.describe(outcome.features))
        half.chains = Chains(
            tokens=ipc.open_buffer(ipc.recv_frame(conn), (1, w), torch.int64),
            valid=ipc.open_buffer(ipc.recv_frame(conn), (1, num_steps), torch.bool),
        )
        while notice := ipc.recv_frame(conn):
            length, unread = NOTICE.unpack(notice)
            assert half.reserve([length], unread), "draft pool full"
            half.launch()  # CPU work is done when it returns: the notice orders it
            ipc.send_frame(conn, b"d")


if __name__ == "__main__":
    main(sys.argv[1:])
