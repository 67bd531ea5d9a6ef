"""The draft service in-process (grpc.aio on 127.0.0.1:0, its own loop thread) and the
RemoteDrafter talking to it: same trees as the in-process drafter, deadlines, outages,
chunked prompts, health, errors, and the sacred invariant through the whole stack."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch
from google.rpc import code_pb2, error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from draft_service.__main__ import parse_config
from draft_service.config import DraftServiceConfig
from draft_service.server import DraftServer, start
from tandem import transfer, wire
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.errors import CheckpointError, InvalidRequest, KVExhausted, NotFound
from tandem.link.remote import RemoteDrafter
from tandem.sampling import SamplingParams
from tandem.serving import rpc
from tandem.spec.base import Drafter, DraftState
from tandem.spec.types import DraftAdmit, SpecConfig, Tree, VerifyOutcome
from tandem.target.engine import Engine
from tandem.testing.random_drafts import make_eagle3_checkpoint
from tandem.testing.random_model import make_checkpoint
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

T = TypeVar("T")
VOCAB = 1999
LAYERS = 4
HIDDEN = 64
FEATURES = 3 * HIDDEN  # EAGLE-3: three aux layers
SPEC = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)


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


def _serve(ckpts: Ckpts, port: int = 0, **kw: Any) -> ServerThread:
    return ServerThread(DraftServiceConfig(draft=ckpts.draft_config(), port=port, **kw))


def _socket(tmp: Path, transport: str) -> str | None:
    """Where the draft serves its local stream: None for the gRPC stream only."""
    return str(tmp / "draft.sock") if transport == "local" else None


# The RemoteDrafter tests run over both streams: gRPC, and the local socket the client takes
# when the draft reports one (tandem.link.local).
TRANSPORTS = ["grpc", "local"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(
    ckpts: Ckpts, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    s = _serve(ckpts, local_socket=_socket(tmp_path_factory.mktemp("sock"), request.param))
    yield s
    s.stop()


def _remote(server: ServerThread, **kw: Any) -> RemoteDrafter:
    """A client of ``server``, on its local stream when it serves one."""
    remote = RemoteDrafter(server.address, num_target_layers=LAYERS, backoff_max_s=0.2, **kw)
    assert remote.wait_ready(20), "draft stream did not come up"
    assert remote.local_connects == (1 if server.local else 0)
    return remote


def _polled(remote: RemoteDrafter) -> RemoteDrafter:
    """``remote`` once it has read what arrived, as the engine's idle loop has it do."""
    remote.poll()
    return remote


def _wait(predicate: Callable[[], bool], timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


def assert_draft_released_all(server: ServerThread) -> None:
    """The draft service tracks no request any more and its KV pool has no page in use (no
    leak); waits for the last release to land."""
    _wait(lambda: server.num_tracked() == 0)
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


def test_health_and_info(ckpts: Ckpts) -> None:
    s = ServerThread(DraftServiceConfig(draft=ckpts.draft_config()), load=False)
    try:
        with grpc.insecure_channel(s.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest
            assert health.Check(check()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            s.run(s.server.load())
            assert health.Check(check()).status == health_pb2.HealthCheckResponse.SERVING
            name = check(service="tandem.v1.DraftService")
            assert health.Check(name).status == health_pb2.HealthCheckResponse.SERVING
            info = stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())
        assert info.draft_kind == common_pb2.DRAFT_KIND_EAGLE3
        local = ckpts.local()
        # draft.proto's -1 is transformers' hidden_states[LAYERS], the final normed state
        wire_ids = tuple(-1 if i == LAYERS else i for i in local.target_layer_ids)
        assert tuple(info.target_layer_ids) == wire_ids
        assert (info.hidden_size, info.vocab_size, info.target_vocab_size) == (HIDDEN, 512, VOCAB)
        assert info.hidden_dtype == common_pb2.DTYPE_FLOAT32
        assert info.kv_usage.pages_total == 256 and info.kv_usage.pages_used == 0
    finally:
        s.stop()


def _abort_status(requests: list[draft_pb2.SpeculateRequest], address: str) -> Any:
    with grpc.insecure_channel(address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Speculate(iter(requests)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    return bad.field_violations[0].field


def test_stream_without_hello_is_invalid(server: ServerThread) -> None:
    assert _abort_status([draft_pb2.SpeculateRequest(step_id=1)], server.address) == "hello"
    hello = draft_pb2.SpeculateHello(protocol_version=2)
    field = _abort_status([draft_pb2.SpeculateRequest(hello=hello)], server.address)
    assert field == "hello.protocol_version"


def test_trees_equal_in_process(server: ServerThread, ckpts: Ckpts) -> None:
    local, remote = ckpts.local(), _remote(server)
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
    _wait(lambda: server.num_tracked() == 0)  # the stream ended: its requests are freed


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
    remote = _remote(server)
    try:
        remote.submit(0, [Feed(5).admit("a", 9)], [], [])
        remote.submit(1, [], [], ["a"])  # no features: nothing to wait for
        remote.collect(0)
        remote.collect(1)
        _wait(lambda: server.num_tracked() == 0, timeout=5)
        assert copying.waited  # the copy was not done when the loop got to it
        assert remote.num_tracked() == 0 and remote.take_dropped() == []
        assert remote.state is DraftState.HEALTHY
    finally:
        remote.close()


def test_deadline_miss_discards_late_answer(server: ServerThread, ckpts: Ckpts) -> None:
    local, remote = ckpts.local(), _remote(server, deadline_s=1e-6)
    feed = Feed(2)
    try:
        admit = feed.admit("a", 9)
        tree = local.step([admit], [], [])["a"]
        assert remote.step([admit], [], []) == {}
        assert remote.late_steps == 1 and remote.state is DraftState.UNHEALTHY
        # gRPC: the client's reader discards the late answer on arrival; local stream: the
        # engine thread does, when it polls (idle) or steps.
        _wait(lambda: _polled(remote).late_responses == 1)
        assert remote.state is DraftState.HEALTHY
        remote.deadline_s = 10.0
        outcome = [feed.outcome("a", None)]  # the step ran without a tree: K=0
        assert remote.step([], outcome, []) == local.step([], outcome, [])
        assert tree is not None and remote.late_responses == 1
    finally:
        remote.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prompt_frames_span_messages(ckpts: Ckpts, transport: str, tmp_path: Path) -> None:
    s = _serve(ckpts, max_message_bytes=64 * 1024, local_socket=_socket(tmp_path, transport))
    local, remote = ckpts.local(), _remote(s)
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
    sock = _socket(tmp_path, transport)
    s = _serve(ckpts, local_socket=sock)
    port = s.server.port
    remote = _remote(s)
    feed = Feed(4)
    try:
        assert set(remote.step([feed.admit("a", 5), feed.admit("b", 8)], [], [])) == {"a", "b"}
        s.stop()
        _wait(lambda: _polled(remote).state is DraftState.UNHEALTHY)
        assert sorted(remote.take_dropped()) == ["a", "b"]
        assert remote.num_tracked() == 0
        assert remote.step([feed.admit("c", 5)], [], []) == {}  # down: no wait, no trees
        assert remote.take_dropped() == ["c"]
        s = _serve(ckpts, port=port, local_socket=sock)  # the same addresses again
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
    remote = _remote(server, deadline_s=10.0)
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
    remote = _remote(server, deadline_s=10.0)
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
        _wait(lambda: server.num_tracked() == 0)
    finally:
        remote.close()


def test_bad_request_in_a_message_drops_only_that_request(server: ServerThread) -> None:
    spec = wire.spec_to_proto(SPEC)

    def admit(request_id: str, ids: list[int]) -> draft_pb2.DraftAdmit:
        return draft_pb2.DraftAdmit(
            request_id=request_id, prompt_token_ids=ids[:-1], verified_token_id=ids[-1],
            speculation=spec,
        )  # fmt: skip

    def frames(request_id: str, rows: int) -> draft_pb2.PromptFrames:
        tensor = torch.randn(rows, FEATURES)
        return draft_pb2.PromptFrames(
            request_id=request_id, frames=wire.tensor_to_frames("hidden_states", tensor)
        )

    hello = draft_pb2.SpeculateHello(protocol_version=1)
    good = draft_pb2.VerifyOutcome(request_id="good", bonus_token_id=5, committed_len=99)
    good.hidden_states.extend(wire.tensor_to_frames("hidden_states", torch.randn(1, FEATURES)))
    ghost = draft_pb2.VerifyOutcome(request_id="ghost", bonus_token_id=5, committed_len=9)
    requests = [
        draft_pb2.SpeculateRequest(hello=hello),
        draft_pb2.SpeculateRequest(
            step_id=1,
            new_requests=[admit("good", [7, 8, 9, 10]), admit("bad", [7, VOCAB])],
            prompt_frames=[frames("good", 3), frames("bad", 1)],
        ),
        draft_pb2.SpeculateRequest(step_id=2, outcomes=[ghost, good]),  # good: wrong length
    ]
    with grpc.insecure_channel(server.address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        first, second, third = stub.Speculate(iter(requests))
    assert first.hello.protocol_version == 1 and first.hello.max_message_bytes > 0
    assert list(first.hello.tensor_transports) == [draft_pb2.TENSOR_TRANSPORT_INLINE]
    assert second.step_id == 1 and [t.request_id for t in second.trees] == ["good"]
    assert list(second.dropped_request_ids) == ["bad"]
    assert second.kv_usage.pages_used > 0 and second.total_ns >= second.draft_ns > 0
    assert list(third.dropped_request_ids) == ["ghost", "good"] and not third.trees
    _wait(lambda: server.num_tracked() == 0)


def test_unexpected_errors_are_internal(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def boom() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(server.server.engine, "kv_usage", boom)
    with grpc.insecure_channel(server.address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "internal error: RuntimeError: boom"


def test_status_mapping() -> None:
    status = rpc.status_for(InvalidRequest("sampling.top_p", "must be in (0, 1]"))
    bad = error_details_pb2.BadRequest()
    assert status.code == code_pb2.INVALID_ARGUMENT and status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "sampling.top_p"
    assert rpc.status_for(NotFound("req-1")).code == code_pb2.NOT_FOUND
    exhausted = rpc.status_for(KVExhausted("need 4 pages"))
    assert exhausted.code == code_pb2.RESOURCE_EXHAUSTED
    assert exhausted.details[0].Is(error_details_pb2.RetryInfo.DESCRIPTOR)
    assert rpc.status_for(CheckpointError("no config")).code == code_pb2.INTERNAL
    assert rpc.status_for(KeyError("x")).message == "internal error: KeyError: 'x'"


def test_env_defaults_and_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_DRAFT_TARGET", str(tmp_path))
    monkeypatch.setenv("TANDEM_DRAFT_KIND", "ngram")
    monkeypatch.setenv("TANDEM_DRAFT_PORT", "5678")
    monkeypatch.setenv("TANDEM_DRAFT_REFLECTION", "yes")
    config = parse_config(["--grace", "2.5"])
    assert (config.draft.kind, config.draft.target, config.port) == ("ngram", tmp_path, 5678)
    assert config.reflection and config.grace_s == 2.5
    assert parse_config(["--port", "0", "--no-reflection"]).port == 0
    monkeypatch.setenv("TANDEM_DRAFT_PORT", "http")
    with pytest.raises(ValueError, match="TANDEM_DRAFT_PORT"):
        parse_config([])
    monkeypatch.setenv("TANDEM_DRAFT_PORT", "1")
    with pytest.raises(SystemExit):
        parse_config(["--draft-kind", "eagle3"])  # eagle3 needs --draft
    with pytest.raises(ValueError, match="TANDEM_"):
        rpc.env_default("DRAFT_PORT", 0)
    assert parse_config([]).draft.cuda_graphs is None  # on for CUDA devices, off on CPU
    assert not parse_config([]).draft.use_cuda_graphs
    assert parse_config(
        ["--device", "cuda", "--draft-kind", "eagle3", "--draft", "d"]
    ).draft.use_cuda_graphs
    assert parse_config(["--device", "cuda", "--no-cuda-graphs"]).draft.cuda_graphs is False
    with pytest.raises(SystemExit):
        parse_config(["--cuda-graphs"])  # CUDA graphs on a CPU device
    monkeypatch.setenv("TANDEM_DRAFT_CUDA_GRAPHS", "off")
    assert parse_config(["--device", "cuda"]).draft.cuda_graphs is False
    assert parse_config([]).draft.transposed_weights is None  # on for CUDA devices
    assert parse_config(["--device", "cuda"]).draft.use_transposed_weights
    assert parse_config(["--transposed-weights"]).draft.use_transposed_weights  # CPU, asked
    monkeypatch.setenv("TANDEM_DRAFT_TRANSPOSED_WEIGHTS", "off")
    assert not parse_config(["--device", "cuda"]).draft.use_transposed_weights
    assert rpc.parse_address("[::1]:50051") == ("::1", 50051)
    assert rpc.format_address("::1", 50051) == "[::1]:50051"
    with pytest.raises(ValueError, match="HOST:PORT"):
        rpc.parse_address("localhost")
