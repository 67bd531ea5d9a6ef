"""tandem.wire's domain conversions: round trips, explicit defaults, and every validation path
naming its field."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tandem import wire
from tandem.errors import InvalidRequest
from tandem.request import FinishReason
from tandem.sampling import SamplingParams
from tandem.spec.types import DraftAdmit, SpecConfig, SpecStats, Tree, VerifyOutcome
from tandem.v1 import common_pb2, draft_pb2

MiB = 1024 * 1024


def _field_of(fn: Callable[[], object]) -> str:
    with pytest.raises(InvalidRequest) as info:
        fn()
    return info.value.field


# ---- sampling ----


def test_sampling_round_trip() -> None:
    params = SamplingParams(
        temperature=0.5,
        top_k=40,
        top_p=0.75,
        min_p=0.125,
        repetition_penalty=1.25,
        seed=2**62 + 3,
        max_new_tokens=77,
        stop_token_ids=(5, 9),
        ignore_eos=True,
        presence_penalty=-0.5,
        frequency_penalty=1.75,
        min_tokens=3,
        logit_bias=((2, -100.0), (7, 2.5)),
        top_logprobs=3,
    )
    msg = common_pb2.SamplingParams.FromString(wire.sampling_to_proto(params).SerializeToString())
    assert wire.sampling_from_proto(msg, default_max_new_tokens=1) == params
    greedy = SamplingParams()  # temperature 0 and no seed must survive too
    msg = wire.sampling_to_proto(greedy)
    assert msg.HasField("temperature") and not msg.HasField("seed")
    assert wire.sampling_from_proto(msg, default_max_new_tokens=1) == greedy


def test_sampling_defaults_of_unset_fields() -> None:
    msg = common_pb2.SamplingParams(stop_strings=["\n\n"], logprobs=True)
    params = wire.sampling_from_proto(msg, default_max_new_tokens=321)
    assert params == SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=321)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_sampling_validation(fields: dict[str, object], field: str) -> None:
    msg = common_pb2.SamplingParams(**fields)  # type: ignore[arg-type]
    got = _field_of(
        lambda: wire.sampling_from_proto(msg, default_max_new_tokens=8, field="reqs[3].sampling")
    )
    assert got == f"reqs[3].sampling.{field}"


# ---- speculation ----


def test_spec_round_trip_and_kinds() -> None:
    for spec in (SpecConfig(num_steps=4), SpecConfig(num_steps=3, topk=4, num_draft_tokens=9)):
        msg = wire.spec_to_proto(spec, "eagle3")
        assert msg.enabled and msg.num_draft_tokens == spec.tree_size
        assert wire.spec_from_proto(msg, None, deployed_kind="eagle3") == spec
    assert wire.spec_from_proto(wire.spec_to_proto(None), SpecConfig()) is None
    for kind in ("eagle3", "eagle", "mtp", "model", "ngram"):
        assert wire.draft_kind_from_proto(wire.draft_kind_to_proto(kind)) == kind
    assert wire.draft_kind_to_proto(None) == common_pb2.DRAFT_KIND_UNSPECIFIED
    with pytest.raises(ValueError, match="draft kind"):
        wire.draft_kind_to_proto("medusa")


def test_spec_unset_fields_come_from_the_default() -> None:
    default = SpecConfig(num_steps=3, topk=4, num_draft_tokens=8)
    unset = common_pb2.SpeculationParams()
    assert wire.spec_from_proto(unset, default) == default
    assert wire.spec_from_proto(unset, None) is None  # no policy: off
    assert wire.spec_from_proto(common_pb2.SpeculationParams(enabled=True), None) == SpecConfig()
    chain = wire.spec_from_proto(common_pb2.SpeculationParams(num_steps=5), SpecConfig())
    assert chain == SpecConfig(num_steps=5)  # N follows S when only S is given
    assert wire.spec_from_proto(common_pb2.SpeculationParams(topk=0), default) is None
    assert wire.spec_from_proto(common_pb2.SpeculationParams(enabled=False), default) is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"num_steps": 0}, "num_steps"),
        ({"num_draft_tokens": 1}, "num_draft_tokens"),
        ({"num_steps": 3, "topk": 1, "num_draft_tokens": 7}, "num_draft_tokens"),
        ({"draft_kind": common_pb2.DRAFT_KIND_MTP}, "draft_kind"),
        ({"draft_kind": 99}, "draft_kind"),
    ],
)
def test_spec_validation(fields: dict[str, object], field: str) -> None:
    msg = common_pb2.SpeculationParams(**fields)  # type: ignore[arg-type]
    got = _field_of(lambda: wire.spec_from_proto(msg, SpecConfig(), deployed_kind="eagle3"))
    assert got == f"speculation.{field}"


# ---- trees ----


def test_tree_round_trip() -> None:
    tree = Tree(tokens=(7, 1, 2, 3), parents=(-1, 0, 0, 1))
    msg = draft_pb2.Tree.FromString(wire.tree_to_proto("r", tree).SerializeToString())
    assert wire.tree_from_proto(msg) == ("r", tree)


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (draft_pb2.Tree(token_ids=[1], parent_indices=[-1]), "request_id"),
        (draft_pb2.Tree(request_id="r"), "token_ids"),
        (draft_pb2.Tree(request_id="r", token_ids=[1, 2], parent_indices=[-1]), "parent_indices"),
        (
            draft_pb2.Tree(
                request_id="r", token_ids=[1], parent_indices=[-1], draft_logprobs=[0, 1]
            ),
            "draft_logprobs",
        ),
    ],
)
def test_tree_validation(msg: draft_pb2.Tree, field: str) -> None:
    assert _field_of(lambda: wire.tree_from_proto(msg, path="trees[2]")) == f"trees[2].{field}"


# ---- admits ----


def _admit(num_tokens: int = 6, feature_size: int = 8) -> DraftAdmit:
    return DraftAdmit(
        request_id="r1",
        token_ids=list(range(10, 10 + num_tokens)),
        features=torch.randn(num_tokens - 1, feature_size),
        spec=SpecConfig(num_steps=2, topk=2),
        temperature=0.5,
    )


def _through_wire(admit: DraftAdmit, **kw: object) -> DraftAdmit:
    msg, prompt = wire.admit_to_proto(admit)
    msg = draft_pb2.DraftAdmit.FromString(msg.SerializeToString())
    features = None
    if prompt is not None:
        features = wire.tensor_from_frames(prompt.frames, max_bytes=64 * MiB)
    return wire.admit_from_proto(msg, features, default_spec=None, **kw)  # type: ignore[arg-type]


def test_admit_round_trip() -> None:
    admit = _admit()
    back = _through_wire(admit, vocab_size=100, feature_size=8)
    assert back.token_ids == admit.token_ids and back.spec == admit.spec
    assert back.temperature == admit.temperature and back.request_id == admit.request_id
    assert back.features is not None and torch.equal(back.features, admit.features)
    msg, prompt = wire.admit_to_proto(admit)
    assert msg.verified_token_id == admit.token_ids[-1] and msg.draft_seed == 0
    assert prompt is not None and prompt.request_id == "r1"
    token_only = DraftAdmit(request_id="t", token_ids=[4], features=None, spec=SpecConfig())
    assert wire.admit_to_proto(token_only)[1] is None
    assert _through_wire(token_only).token_ids == [4]


def test_large_prompt_features_split_into_frames() -> None:
    admit = _admit(num_tokens=1800, feature_size=768)  # 5.5 MB of float32 features
    _, prompt = wire.admit_to_proto(admit)
    assert prompt is not None and len(prompt.frames) >= 2
    assert all(frame.ByteSize() <= 4 * MiB for frame in prompt.frames)
    back = wire.tensor_from_frames(prompt.frames, max_bytes=8 * MiB)
    assert admit.features is not None and torch.equal(back, admit.features)
    small = wire.admit_to_proto(admit, max_frame_bytes=MiB)[1]
    assert small is not None and all(f.ByteSize() <= MiB for f in small.frames)


def test_admit_validation() -> None:
    good, _ = wire.admit_to_proto(_admit())

    def check(msg: draft_pb2.DraftAdmit, features: torch.Tensor | None = None) -> str:
        return _field_of(
            lambda: wire.admit_from_proto(
                msg, features, default_spec=None, path="new_requests[1]", vocab_size=12,
                feature_size=8,
            )
        )  # fmt: skip

    bad = draft_pb2.DraftAdmit()
    bad.CopyFrom(good)
    bad.request_id = ""
    assert check(bad) == "new_requests[1].request_id"
    assert check(good) == "new_requests[1].prompt_token_ids"  # ids 10.. >= vocab 12
    small = draft_pb2.DraftAdmit(request_id="r", verified_token_id=12, speculation=good.speculation)
    assert check(small) == "new_requests[1].verified_token_id"
    off = draft_pb2.DraftAdmit(request_id="r", speculation=wire.spec_to_proto(None))
    assert check(off) == "new_requests[1].speculation"
    hot = draft_pb2.DraftAdmit(request_id="r", speculation=good.speculation)
    hot.sampling.temperature = 3.0
    assert check(hot) == "new_requests[1].sampling.temperature"
    ok = draft_pb2.DraftAdmit(request_id="r", prompt_token_ids=[1, 2], speculation=good.speculation)
    assert check(ok, torch.zeros(3, 8)) == "prompt_frames"  # 3 rows for 2 prompt tokens
    assert check(ok, torch.zeros(2, 9)) == "prompt_frames"  # feature size 9, not 8
    assert check(ok, torch.zeros(2, 8, dtype=torch.int32)) == "prompt_frames"


# ---- outcomes ----


def _outcome() -> VerifyOutcome:
    return VerifyOutcome(
        request_id="r1", accepted_token_ids=[4, 5], bonus_token_id=6, features=torch.randn(3, 8)
    )


def test_outcome_round_trip() -> None:
    outcome = _outcome()
    msg = wire.outcome_to_proto(outcome, 20, accepted_node_indices=[0, 1, 3])
    msg = draft_pb2.VerifyOutcome.FromString(msg.SerializeToString())
    assert msg.committed_len == 20 and list(msg.accepted_node_indices) == [0, 1, 3]
    back = wire.outcome_from_proto(msg, MiB, vocab_size=7, feature_size=8)
    assert back.accepted_token_ids == [4, 5] and back.bonus_token_id == 6
    assert back.features is not None and torch.equal(back.features, outcome.features)
    plain = VerifyOutcome(request_id="x", accepted_token_ids=[], bonus_token_id=1, features=None)
    assert wire.outcome_from_proto(wire.outcome_to_proto(plain, 2), MiB).features is None


def test_outcome_validation() -> None:
    def check(edit: Callable[[draft_pb2.VerifyOutcome], None], **kw: int) -> str:
        msg = wire.outcome_to_proto(_outcome(), 20, accepted_node_indices=[0, 1, 3])
        edit(msg)
        return _field_of(lambda: wire.outcome_from_proto(msg, MiB, path="outcomes[0]", **kw))

    def field(name: str, value: object) -> Callable[[draft_pb2.VerifyOutcome], None]:
        return lambda msg: setattr(msg, name, value)

    def nodes(values: list[int]) -> Callable[[draft_pb2.VerifyOutcome], None]:
        def edit(msg: draft_pb2.VerifyOutcome) -> None:
            del msg.accepted_node_indices[:]
            msg.accepted_node_indices.extend(values)

        return edit

    assert check(field("request_id", "")) == "outcomes[0].request_id"
    assert check(field("committed_len", 3)) == "outcomes[0].committed_len"
    assert check(lambda m: None, vocab_size=5) == "outcomes[0].accepted_token_ids"
    assert check(field("bonus_token_id", 9), vocab_size=7) == "outcomes[0].bonus_token_id"
    assert check(nodes([1, 2, 3])) == "outcomes[0].accepted_node_indices"
    assert check(nodes([0, 2, 2])) == "outcomes[0].accepted_node_indices"
    assert check(lambda m: None, feature_size=4) == "outcomes[0].hidden_states"
    assert check(lambda m: m.hidden_states[0].ClearField("shape")) == (
        "outcomes[0].hidden_states.total_bytes"
    )
    two = wire.tensor_to_frames("hidden_states", torch.randn(2, 8))  # 2 rows for 3 positions
    assert check(lambda m: (m.ClearField("hidden_states"), m.hidden_states.extend(two))) == (
        "outcomes[0].hidden_states"
    )


# ---- finish reasons and usage ----


def test_finish_reason_and_usage() -> None:
    assert wire.finish_reason_to_proto(None) == common_pb2.FINISH_REASON_UNSPECIFIED
    assert wire.finish_reason_to_proto(FinishReason.STOP) == common_pb2.FINISH_REASON_STOP
    assert wire.finish_reason_to_proto(FinishReason.LENGTH) == common_pb2.FINISH_REASON_LENGTH
    assert wire.finish_reason_to_proto(FinishReason.ABORT) == common_pb2.FINISH_REASON_ABORT
    for reason in FinishReason:
        assert wire.finish_reason_from_proto(wire.finish_reason_to_proto(reason)) == reason
    assert wire.finish_reason_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) is None
    error = common_pb2.FINISH_REASON_ERROR
    assert wire.finish_reason_from_proto(error) == FinishReason.ABORT
    assert _field_of(lambda: wire.finish_reason_from_proto(42, field="abort.reason")) == (
        "abort.reason"
    )
    stats = SpecStats()
    stats.record(num_draft_nodes=4, num_accepted=2)
    stats.record(num_draft_nodes=0, num_accepted=0)
    usage = wire.usage_to_proto(stats, prompt_tokens=11, completion_tokens=4)
    assert (usage.prompt_tokens, usage.completion_tokens) == (11, 4)
    assert (usage.draft_tokens, usage.accepted_tokens, usage.verify_steps) == (4, 2, 2)
    assert usage.accept_length == pytest.approx(2.0)
