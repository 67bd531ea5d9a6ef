from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ControlRequest(_message.Message):
    __slots__ = ("admit", "abort", "lane_assignment", "policy_update")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    LANE_ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    POLICY_UPDATE_FIELD_NUMBER: _ClassVar[int]
    admit: AdmitCommand
    abort: AbortCommand
    lane_assignment: LaneAssignment
    policy_update: PolicyUpdate
    def __init__(self, admit: _Optional[_Union[AdmitCommand, _Mapping]] = ..., abort: _Optional[_Union[AbortCommand, _Mapping]] = ..., lane_assignment: _Optional[_Union[LaneAssignment, _Mapping]] = ..., policy_update: _Optional[_Union[PolicyUpdate, _Mapping]] = ...) -> None: ...

class AdmitCommand(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "speculation", "trace_context", "lane_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationParams
    trace_context: _common_pb2.TraceContext
    lane_id: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., lane_id: _Optional[int] = ...) -> None: ...

class AbortCommand(_message.Message):
    __slots__ = ("request_ids", "finish_reason")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    finish_reason: _common_pb2.FinishReason
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class LaneAssignment(_message.Message):
    __slots__ = ("request_ids", "lane_id")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    lane_id: int
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., lane_id: _Optional[int] = ...) -> None: ...

class PolicyUpdate(_message.Message):
    __slots__ = ("lane_id", "speculation", "draft_deadline_ns")
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    lane_id: int
    speculation: _common_pb2.SpeculationParams
    draft_deadline_ns: int
    def __init__(self, lane_id: _Optional[int] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., draft_deadline_ns: _Optional[int] = ...) -> None: ...

class ControlResponse(_message.Message):
    __slots__ = ("step", "status")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    step: StepReport
    status: TargetStatus
    def __init__(self, step: _Optional[_Union[StepReport, _Mapping]] = ..., status: _Optional[_Union[TargetStatus, _Mapping]] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step_id", "lane_id", "commits", "stats")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    lane_id: int
    commits: _containers.RepeatedCompositeFieldContainer[Commit]
    stats: StepStats
    def __init__(self, step_id: _Optional[int] = ..., lane_id: _Optional[int] = ..., commits: _Optional[_Iterable[_Union[Commit, _Mapping]]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "error", "usage", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    error: _common_pb2.ErrorStatus
    usage: _common_pb2.Usage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., error: _Optional[_Union[_common_pb2.ErrorStatus, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("batch_size", "num_speculating", "draft_fallback", "speculation", "num_draft_tokens", "num_accepted_tokens", "num_accepted_per_pos", "num_committed_tokens", "draft_ns", "wire_ns", "verify_ns", "host_ns", "step_ns", "without_tree")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    WIRE_NS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_NS_FIELD_NUMBER: _ClassVar[int]
    HOST_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_NS_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_TREE_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    num_speculating: int
    draft_fallback: bool
    speculation: _common_pb2.SpeculationParams
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    num_committed_tokens: int
    draft_ns: int
    wire_ns: int
    verify_ns: int
    host_ns: int
    step_ns: int
    without_tree: _common_pb2.StepsWithoutTree
    def __init__(self, batch_size: _Optional[int] = ..., num_speculating: _Optional[int] = ..., draft_fallback: _Optional[bool] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_accepted_per_pos: _Optional[_Iterable[int]] = ..., num_committed_tokens: _Optional[int] = ..., draft_ns: _Optional[int] = ..., wire_ns: _Optional[int] = ..., verify_ns: _Optional[int] = ..., host_ns: _Optional[int] = ..., step_ns: _Optional[int] = ..., without_tree: _Optional[_Union[_common_pb2.StepsWithoutTree, _Mapping]] = ...) -> None: ...

class TargetStatus(_message.Message):
    __slots__ = ("kv_usage", "draft_kv_usage", "draft_state", "num_running", "num_waiting", "verify_steps", "drafted_steps", "steps_without_tree")
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_WITHOUT_TREE_FIELD_NUMBER: _ClassVar[int]
    kv_usage: _common_pb2.KvUsage
    draft_kv_usage: _common_pb2.KvUsage
    draft_state: _common_pb2.DraftState
    num_running: int
    num_waiting: int
    verify_steps: int
    drafted_steps: int
    steps_without_tree: _common_pb2.StepsWithoutTree
    def __init__(self, kv_usage: _Optional[_Union[_common_pb2.KvUsage, _Mapping]] = ..., draft_kv_usage: _Optional[_Union[_common_pb2.KvUsage, _Mapping]] = ..., draft_state: _Optional[_Union[_common_pb2.DraftState, str]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., verify_steps: _Optional[int] = ..., drafted_steps: _Optional[int] = ..., steps_without_tree: _Optional[_Union[_common_pb2.StepsWithoutTree, _Mapping]] = ...) -> None: ...

class TargetServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetServiceGetInfoResponse(_message.Message):
    __slots__ = ("model_id", "vocab_size", "max_model_len", "num_layers", "hidden_size", "dtype", "eos_token_ids", "max_batch_size", "draft_kind", "status", "version", "speculation", "spec_policy")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    SPEC_POLICY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    hidden_size: int
    dtype: _common_pb2.Dtype
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_batch_size: int
    draft_kind: _common_pb2.DraftKind
    status: TargetStatus
    version: str
    speculation: _common_pb2.SpeculationParams
    spec_policy: _common_pb2.SpecPolicy
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.Dtype, str]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_batch_size: _Optional[int] = ..., draft_kind: _Optional[_Union[_common_pb2.DraftKind, str]] = ..., status: _Optional[_Union[TargetStatus, _Mapping]] = ..., version: _Optional[str] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., spec_policy: _Optional[_Union[_common_pb2.SpecPolicy, str]] = ...) -> None: ...
