"""The RemoteDrafter talking to a draft service in-process (grpc.aio on 127.0.0.1:0, its own
loop thread), over both streams: same trees as the in-process drafter, deadlines, outages,
chunked prompts, two lanes, and the sacred invariant through the whole stack."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tandem import transfer
from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.spec.base import DraftState
from tandem.spec.types import DraftAdmit, Tree, VerifyOutcome
from tandem.target.engine import Engine
from tests.helpers.draft_service import (
    SPEC,
    TRANSPORTS,
    Ckpts,
    Feed,
    ServerThread,
    assert_draft_released_all,
    polled,
    remote_drafter,
    serve,
    socket_path,
    wait_until,
)


def test_trees_equal_in_process(server: ServerThread, ckpts: Ckpts) -> None:
    local, remote = ckpts.local(), remote_drafter(server)
    feed = Feed(1)
    try:
        steps: list[tuple[list[DraftAdmit], list[str]]] = [
            ([feed.admit("a", 7), feed.admit("b", 1)], []),
            ([feed.admit("c", 20)], []),
            ([], ["b"]),
            ([], []),
        ]
        trees: dict[str, Tree] = {}
        for admits, released in steps:
            outcomes = [feed.outcome(r, trees.get(r)) for r in sorted(trees) if r not in released]
            trees = local.step(admits, outcomes, released)
            assert remote.step(admits, outcomes, released) == trees
            assert any(len(t) > 1 for t in trees.values())
        assert remote.num_tracked() == local.num_tracked() == 2
        assert remote.take_dropped() == [] and remote.state is DraftState.HEALTHY
    finally:
        remote.close()
    wait_until(lambda: server.num_tracked() == 0)  # the stream ended: its requests are freed


class _Copying:
    """A device-to-host copy that completes ``seconds`` after it starts (``query`` looks,
    ``synchronize`` waits, as a CUDA event's)."""

    def __init__(self, seconds: float) -> None:
        self.done_at = time.monotonic() + seconds
        self.waited = False

    def query(self) -> bool:
        return time.monotonic() >= self.done_at

    def synchronize(self) -> None:
        self.waited = True
        time.sleep(max(0.0, self.done_at - time.monotonic()))


def test_a_step_waiting_for_its_copy_keeps_its_place(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose features are still being copied to the host goes out before any later
    step: the release right behind an admit reaches the draft after it, so nothing leaks."""
    copying = _Copying(0.3)
    monkeypatch.setattr(
        transfer, "to_host", lambda tensors, dtype: ([t.to(dtype) for t in tensors], copying)
    )
    remote = remote_drafter(server)
    try:
        remote.submit(0, [Feed(5).admit("a", 9)], [], [])
        remote.submit(1, [], [], ["a"])  # no features: nothing to wait for
        remote.collect(0)
        remote.collect(1)
        wait_until(lambda: server.num_tracked() == 0, timeout=5)
        assert copying.waited  # the copy was not done when the loop got to it
        assert remote.num_tracked() == 0 and remote.take_dropped() == []
        assert remote.state is DraftState.HEALTHY
    finally:
        remote.close()


def test_deadline_miss_discards_late_answer(server: ServerThread, ckpts: Ckpts) -> None:
    local, remote = ckpts.local(), remote_drafter(server, deadline_s=1e-6)
    feed = Feed(2)
    try:
        admit = feed.admit("a", 9)
        tree = local.step([admit], [], [])["a"]
        assert remote.step([admit], [], []) == {}
        assert remote.late_steps == 1 and remote.state is DraftState.UNHEALTHY
        # gRPC: the client's reader discards the late answer on arrival; local stream: the
        # engine thread does, when it polls (idle) or steps.
        wait_until(lambda: polled(remote).late_responses == 1)
        assert remote.state is DraftState.HEALTHY
        remote.deadline_s = 10.0
        outcome = [feed.outcome("a", None)]  # the step ran without a tree: K=0
        assert remote.step([], outcome, []) == local.step([], outcome, [])
        assert tree is not None and remote.late_responses == 1
    finally:
        remote.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prompt_frames_span_messages(ckpts: Ckpts, transport: str, tmp_path: Path) -> None:
    s = serve(ckpts, max_message_bytes=64 * 1024, local_socket=socket_path(tmp_path, transport))
    local, remote = ckpts.local(), remote_drafter(s)
    feed = Feed(3)
    try:
        a, b = feed.admit("a", 120), feed.admit("b", 100)  # 89 KiB and 74 KiB of features
        assert remote.step([a, b], [], []) == {}  # a's frames continue next message
        out_a, out_b = feed.outcome("a", None), feed.outcome("b", None)
        merged_a = _merged(a, [out_a])
        assert remote.step([], [out_a, out_b], []) == local.step([merged_a], [], [])
        out_a2, out_b2 = feed.outcome("a", None), feed.outcome("b", None)
        trees = local.step([], [out_a2], [])
        assert remote.step([], [out_a2, out_b2], []) == trees  # b: admitted, frames started
        out_a3, out_b3 = feed.outcome("a", None), feed.outcome("b", None)
        trees = local.step([_merged(b, [out_b, out_b2, out_b3])], [out_a3], [])
        assert set(trees) == {"a", "b"}
        assert remote.step([], [out_a3, out_b3], []) == trees
    finally:
        remote.close()
        s.stop()


def _merged(admit: DraftAdmit, outcomes: list[VerifyOutcome]) -> DraftAdmit:
    tokens, feats = list(admit.token_ids), [admit.features]
    for o in outcomes:
        tokens += [*o.accepted_token_ids, o.bonus_token_id]
        feats.append(o.features)
    return DraftAdmit(
        request_id=admit.request_id, token_ids=tokens, features=torch.cat(feats), spec=admit.spec
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_outage_drops_and_reconnects(ckpts: Ckpts, transport: str, tmp_path: Path) -> None:
    sock = socket_path(tmp_path, transport)
    s = serve(ckpts, local_socket=sock)
    port = s.server.port
    remote = remote_drafter(s)
    feed = Feed(4)
    try:
        assert set(remote.step([feed.admit("a", 5), feed.admit("b", 8)], [], [])) == {"a", "b"}
        s.stop()
        wait_until(lambda: polled(remote).state is DraftState.UNHEALTHY)
        assert sorted(remote.take_dropped()) == ["a", "b"]
        assert remote.num_tracked() == 0
        assert remote.step([feed.admit("c", 5)], [], []) == {}  # down: no wait, no trees
        assert remote.take_dropped() == ["c"]
        s = serve(ckpts, port=port, local_socket=sock)  # the same addresses again
        assert remote.wait_ready(20) and remote.state is DraftState.HEALTHY
        assert remote.local_connects == (2 if s.local else 0)
        trees = remote.step([feed.admit("d", 6)], [], [])
        assert set(trees) == {"d"} and len(trees["d"]) > 1
        assert remote.connects == 2
    finally:
        remote.close()
        s.stop()


def test_engine_with_remote_drafter_equals_target_only(server: ServerThread, ckpts: Ckpts) -> None:
    prompts = [Feed(5).ids(n) for n in (1, 6, 17)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    config = EngineConfig(model=ckpts.target, page_size=4)
    reference = [r.token_ids for r in Engine(config).generate(prompts, params)]
    remote = remote_drafter(server, deadline_s=10.0)
    try:
        engine = Engine(config, drafter=remote, spec=SPEC)
        assert remote.target_layer_ids != ()  # the engine captures what GetInfo named
        results = engine.generate(prompts, params)
        assert [r.token_ids for r in results] == reference
        assert sum(r.stats.draft_tokens for r in results) > 0  # trees were verified
        assert remote.fallback_steps == 0 and remote.take_dropped() == []
        assert remote.num_tracked() == 0
        assert_draft_released_all(server)
    finally:
        remote.close()


def test_two_lanes_overlap_draft_and_verify(server: ServerThread, ckpts: Ckpts) -> None:
    """With two lanes the draft service drafts one lane while the engine verifies the other:
    steps start their forward with the other lane's answer still outstanding, and the output
    is unchanged."""
    prompts = [Feed(6).ids(n) for n in (3, 9, 14, 5)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    config = EngineConfig(model=ckpts.target, page_size=4)
    reference = [r.token_ids for r in Engine(config).generate(prompts, params)]
    remote = remote_drafter(server, deadline_s=10.0)
    try:
        engine = Engine(config, drafter=remote, spec=SPEC)
        ids = [engine.add_request(p, params, lane=i % 2) for i, p in enumerate(prompts)]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        engine.flush_draft()
        results = [engine.pop_finished(i) for i in ids]
        assert [r.token_ids for r in results] == reference
        assert sum(r.stats.draft_tokens for r in results) > 0
        assert remote.fallback_steps == 0 and remote.late_steps == 0
        # The draft's answer for the other lane usually arrives during this lane's forward.
        assert engine.sync.overlapped > steps // 2, (engine.sync.overlapped, steps)
        wait_until(lambda: server.num_tracked() == 0)
    finally:
        remote.close()
