from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("detokenize", "skip_special_tokens", "continuous_usage")
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUOUS_USAGE_FIELD_NUMBER: _ClassVar[int]
    detokenize: bool
    skip_special_tokens: bool
    continuous_usage: bool
    def __init__(self, detokenize: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., continuous_usage: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "speculation", "stream_options", "add_special_tokens", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationParams
    stream_options: StreamOptions
    add_special_tokens: bool
    n: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "complete", "error", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    complete: GenerateComplete
    error: GenerateError
    index: int
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., complete: _Optional[_Union[GenerateComplete, _Mapping]] = ..., error: _Optional[_Union[GenerateError, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "usage", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    usage: _common_pb2.Usage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateComplete(_message.Message):
    __slots__ = ("finish_reason", "stop_token_id", "stop_string", "usage", "queue_ns", "ttft_ns", "total_ns")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    TTFT_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    stop_string: str
    usage: _common_pb2.Usage
    queue_ns: int
    ttft_ns: int
    total_ns: int
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., queue_ns: _Optional[int] = ..., ttft_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class GenerateError(_message.Message):
    __slots__ = ("code", "message", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    field: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "tokenizer_id", "vocab_size", "max_model_len", "eos_token_ids", "bos_token_id", "draft_kind", "draft_model_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tokenizer_id: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    draft_kind: _common_pb2.DraftKind
    draft_model_id: str
    def __init__(self, model_id: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., draft_kind: _Optional[_Union[_common_pb2.DraftKind, str]] = ..., draft_model_id: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LaneInfo(_message.Message):
    __slots__ = ("lane_id", "num_requests", "speculation", "accept_length")
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    lane_id: int
    num_requests: int
    speculation: _common_pb2.SpeculationParams
    accept_length: float
    def __init__(self, lane_id: _Optional[int] = ..., num_requests: _Optional[int] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., accept_length: _Optional[float] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "speculation", "lanes", "draft_state", "target_kv_usage", "draft_kv_usage", "num_running", "num_waiting", "uptime_ns", "target_connected", "verify_steps", "drafted_steps", "steps_without_tree", "spec_policy", "max_running", "max_queue")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    UPTIME_NS_FIELD_NUMBER: _ClassVar[int]
    TARGET_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_WITHOUT_TREE_FIELD_NUMBER: _ClassVar[int]
    SPEC_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    version: str
    speculation: _common_pb2.SpeculationParams
    lanes: _containers.RepeatedCompositeFieldContainer[LaneInfo]
    draft_state: _common_pb2.DraftState
    target_kv_usage: _common_pb2.KvUsage
    draft_kv_usage: _common_pb2.KvUsage
    num_running: int
    num_waiting: int
    uptime_ns: int
    target_connected: bool
    verify_steps: int
    drafted_steps: int
    steps_without_tree: _common_pb2.StepsWithoutTree
    spec_policy: _common_pb2.SpecPolicy
    max_running: int
    max_queue: int
    def __init__(self, version: _Optional[str] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., lanes: _Optional[_Iterable[_Union[LaneInfo, _Mapping]]] = ..., draft_state: _Optional[_Union[_common_pb2.DraftState, str]] = ..., target_kv_usage: _Optional[_Union[_common_pb2.KvUsage, _Mapping]] = ..., draft_kv_usage: _Optional[_Union[_common_pb2.KvUsage, _Mapping]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., uptime_ns: _Optional[int] = ..., target_connected: _Optional[bool] = ..., verify_steps: _Optional[int] = ..., drafted_steps: _Optional[int] = ..., steps_without_tree: _Optional[_Union[_common_pb2.StepsWithoutTree, _Mapping]] = ..., spec_policy: _Optional[_Union[_common_pb2.SpecPolicy, str]] = ..., max_running: _Optional[int] = ..., max_queue: _Optional[int] = ...) -> None: ...
