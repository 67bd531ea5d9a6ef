"""A draft service in the test process and its clients: the checkpoints it serves (a random
target and an EAGLE-3 draft), a server on its own event loop thread, a RemoteDrafter on its
streams, deterministic admits and outcomes, and the checks the service tests share."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from draft_service.config import DraftServiceConfig
from draft_service.server import DraftServer, start
from tandem.config import DraftConfig
from tandem.draft.build import build_drafter
from tandem.link.local_transport import LocalTransport
from tandem.link.remote import RemoteDrafter
from tandem.spec.base import Drafter
from tandem.spec.types import DraftAdmit, SpecConfig, Tree, VerifyOutcome
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint

T = TypeVar("T")
VOCAB = 1999
LAYERS = 4
HIDDEN = 64
FEATURES = 3 * HIDDEN  # EAGLE-3: three aux layers
SPEC = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
# The RemoteDrafter tests run over both streams: gRPC, and the local socket the client takes
# when the draft reports one (tandem.link.local).
TRANSPORTS = ["grpc", "local"]


@dataclass
class Ckpts:
    target: Path
    draft: Path

    def draft_config(self) -> DraftConfig:
        return DraftConfig(kind="eagle3", path=self.draft, target=self.target, num_pages=256)

    def local(self) -> Drafter:
        return build_drafter(self.draft_config(), LAYERS)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    root = tmp_path_factory.mktemp("draft-service")
    target = make_checkpoint(
        root / "target", "llama", seed=5, vocab_size=VOCAB, num_hidden_layers=LAYERS
    )
    draft = make_eagle3_checkpoint(root / "eagle3", target, draft_vocab_size=512, seed=1)
    return Ckpts(target=target, draft=draft)


class ServerThread:
    """A draft server on its own event loop thread, as a separate process would have."""

    def __init__(self, config: DraftServiceConfig, *, load: bool = True) -> None:
        self.local = config.local_socket is not None  # also serves the local stream
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: DraftServer = self.run(start(config))
        self.address = f"127.0.0.1:{self.server.port}"
        if load:
            self.run(self.server.load())

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def num_tracked(self) -> int:
        return self.run(self.server.engine.num_tracked())

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def serve(ckpts: Ckpts, port: int = 0, **kw: Any) -> ServerThread:
    return ServerThread(DraftServiceConfig(draft=ckpts.draft_config(), port=port, **kw))


def socket_path(tmp: Path, transport: str) -> str | None:
    """Where the draft serves its local stream: None for the gRPC stream only."""
    return str(tmp / "draft.sock") if transport == "local" else None


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(
    ckpts: Ckpts, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    s = serve(ckpts, local_socket=socket_path(tmp_path_factory.mktemp("sock"), request.param))
    yield s
    s.stop()


def remote_drafter(server: ServerThread, **kw: Any) -> RemoteDrafter:
    """A client of ``server``, on its local stream when it serves one."""
    remote = RemoteDrafter(server.address, num_target_layers=LAYERS, backoff_max_s=0.2, **kw)
    assert remote.wait_ready(20), "draft stream did not come up"
    assert remote.local_connects == (1 if server.local else 0)
    return remote


def polled(remote: RemoteDrafter) -> RemoteDrafter:
    """``remote`` once it has read what arrived, as the engine's idle loop has it do."""
    remote.poll()
    return remote


def wait_until(predicate: Callable[[], bool], timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


def assert_draft_released_all(server: ServerThread) -> None:
    """The draft service tracks no request any more and its KV pool has no page in use (no
    leak); waits for the last release to land."""
    wait_until(lambda: server.num_tracked() == 0)
    assert server.run(server.server.engine.kv_usage()).pages_used == 0


class Feed:
    """Deterministic admits and outcomes (random features, first child accepted)."""

    def __init__(self, seed: int = 0, device: str = "cpu") -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device  # where the features are (as the target's)

    def ids(self, n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=self.gen).tolist()

    def feats(self, n: int) -> torch.Tensor:
        return torch.randn(n, FEATURES, generator=self.gen).to(self.device)  # [n, F]

    def admit(self, request_id: str, n: int) -> DraftAdmit:
        return DraftAdmit(
            request_id=request_id, token_ids=self.ids(n), features=self.feats(n - 1), spec=SPEC
        )

    def outcome(self, request_id: str, tree: Tree | None) -> VerifyOutcome:
        accepted = [tree.tokens[1]] if tree is not None and len(tree) > 1 else []
        return VerifyOutcome(
            request_id=request_id,
            accepted_token_ids=accepted,
            bonus_token_id=self.ids(1)[0],
            features=self.feats(len(accepted) + 1),
        )


def check_outcomes_through_the_buffer(local: Drafter, remote: RemoteDrafter, device: str) -> None:
    """``remote`` (its outcome features through the draft's buffer: SHARED_OUTCOME_BYTES
    lowered) drafts the trees ``local`` does, step after step, and the buffer took every
    outcome's features."""
    assert remote.wait_ready(60) and remote.shares_prompts
    transport = remote.connection.transport
    assert isinstance(transport, LocalTransport)
    link = transport.link
    assert link.ring is not None
    feed = Feed(3, device)
    admits = [feed.admit("a", 7), feed.admit("b", 12)]
    trees = local.step(admits, [], [])
    assert remote.step(admits, [], []) == trees
    for step in range(4):
        staged = link.ring.staged_bytes
        outcomes = [feed.outcome(r, trees.get(r)) for r in sorted(trees)]
        if step == 2:  # a run of 30 steps K=0 held, in one outcome
            outcomes[0] = VerifyOutcome(
                request_id="a",
                accepted_token_ids=feed.ids(29),
                bonus_token_id=feed.ids(1)[0],
                features=feed.feats(30),
            )
        trees = local.step([], outcomes, [])
        assert remote.step([], outcomes, []) == trees
        assert any(len(t) > 1 for t in trees.values())
        rows = sum(len(o.accepted_token_ids) + 1 for o in outcomes)
        itemsize = link.stream.hidden_dtype.itemsize
        assert link.ring.staged_bytes - staged == rows * FEATURES * itemsize
    assert remote.take_dropped() == []
