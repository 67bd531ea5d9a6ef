from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_TRANSPORT_UNSPECIFIED: _ClassVar[TensorTransport]
    TENSOR_TRANSPORT_INLINE: _ClassVar[TensorTransport]
    TENSOR_TRANSPORT_SHM: _ClassVar[TensorTransport]
    TENSOR_TRANSPORT_CUDA_IPC: _ClassVar[TensorTransport]
TENSOR_TRANSPORT_UNSPECIFIED: TensorTransport
TENSOR_TRANSPORT_INLINE: TensorTransport
TENSOR_TRANSPORT_SHM: TensorTransport
TENSOR_TRANSPORT_CUDA_IPC: TensorTransport

class SpeculateHello(_message.Message):
    __slots__ = ("protocol_version", "tensor_transports", "max_message_bytes", "model_id", "instance_id", "prompt_buffer", "prompt_buffer_bytes", "device_uuid")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BUFFER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    tensor_transports: _containers.RepeatedScalarFieldContainer[TensorTransport]
    max_message_bytes: int
    model_id: str
    instance_id: str
    prompt_buffer: bytes
    prompt_buffer_bytes: int
    device_uuid: str
    def __init__(self, protocol_version: _Optional[int] = ..., tensor_transports: _Optional[_Iterable[_Union[TensorTransport, str]]] = ..., max_message_bytes: _Optional[int] = ..., model_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., prompt_buffer: _Optional[bytes] = ..., prompt_buffer_bytes: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("hello", "step_id", "lane_id", "speculation", "deadline_ns", "outcomes", "new_requests", "prompt_frames", "released_request_ids", "chain_begin", "chain_step", "chain_end")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_BEGIN_FIELD_NUMBER: _ClassVar[int]
    CHAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    CHAIN_END_FIELD_NUMBER: _ClassVar[int]
    hello: SpeculateHello
    step_id: int
    lane_id: int
    speculation: _common_pb2.SpeculationParams
    deadline_ns: int
    outcomes: _containers.RepeatedCompositeFieldContainer[VerifyOutcome]
    new_requests: _containers.RepeatedCompositeFieldContainer[DraftAdmit]
    prompt_frames: _containers.RepeatedCompositeFieldContainer[PromptFrames]
    released_request_ids: _containers.RepeatedScalarFieldContainer[str]
    chain_begin: ChainBegin
    chain_step: ChainStep
    chain_end: ChainEnd
    def __init__(self, hello: _Optional[_Union[SpeculateHello, _Mapping]] = ..., step_id: _Optional[int] = ..., lane_id: _Optional[int] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., deadline_ns: _Optional[int] = ..., outcomes: _Optional[_Iterable[_Union[VerifyOutcome, _Mapping]]] = ..., new_requests: _Optional[_Iterable[_Union[DraftAdmit, _Mapping]]] = ..., prompt_frames: _Optional[_Iterable[_Union[PromptFrames, _Mapping]]] = ..., released_request_ids: _Optional[_Iterable[str]] = ..., chain_begin: _Optional[_Union[ChainBegin, _Mapping]] = ..., chain_step: _Optional[_Union[ChainStep, _Mapping]] = ..., chain_end: _Optional[_Union[ChainEnd, _Mapping]] = ...) -> None: ...

class ChainBegin(_message.Message):
    __slots__ = ("run_id", "batch_size", "num_steps", "request_ids", "committed_lens", "chains", "event")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENS_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    run_id: int
    batch_size: int
    num_steps: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    committed_lens: _containers.RepeatedScalarFieldContainer[int]
    chains: _containers.RepeatedScalarFieldContainer[bytes]
    event: bytes
    def __init__(self, run_id: _Optional[int] = ..., batch_size: _Optional[int] = ..., num_steps: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., committed_lens: _Optional[_Iterable[int]] = ..., chains: _Optional[_Iterable[bytes]] = ..., event: _Optional[bytes] = ...) -> None: ...

class ChainStep(_message.Message):
    __slots__ = ("run_id", "step", "committed_lens", "unread")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENS_FIELD_NUMBER: _ClassVar[int]
    UNREAD_FIELD_NUMBER: _ClassVar[int]
    run_id: int
    step: int
    committed_lens: _containers.RepeatedScalarFieldContainer[int]
    unread: int
    def __init__(self, run_id: _Optional[int] = ..., step: _Optional[int] = ..., committed_lens: _Optional[_Iterable[int]] = ..., unread: _Optional[int] = ...) -> None: ...

class ChainEnd(_message.Message):
    __slots__ = ("run_id", "rows", "abandoned")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    run_id: int
    rows: _containers.RepeatedCompositeFieldContainer[ChainRow]
    abandoned: bool
    def __init__(self, run_id: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[ChainRow, _Mapping]]] = ..., abandoned: _Optional[bool] = ...) -> None: ...

class ChainRow(_message.Message):
    __slots__ = ("token_ids", "finished")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class VerifyOutcome(_message.Message):
    __slots__ = ("request_id", "accepted_token_ids", "bonus_token_id", "committed_len", "accepted_node_indices", "hidden_states")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODE_INDICES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bonus_token_id: int
    committed_len: int
    accepted_node_indices: _containers.RepeatedScalarFieldContainer[int]
    hidden_states: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorFrame]
    def __init__(self, request_id: _Optional[str] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ..., bonus_token_id: _Optional[int] = ..., committed_len: _Optional[int] = ..., accepted_node_indices: _Optional[_Iterable[int]] = ..., hidden_states: _Optional[_Iterable[_Union[_common_pb2.TensorFrame, _Mapping]]] = ...) -> None: ...

class DraftAdmit(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "verified_token_id", "draft_seed", "sampling", "speculation", "trace_context")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SEED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    verified_token_id: int
    draft_seed: int
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationParams
    trace_context: _common_pb2.TraceContext
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., verified_token_id: _Optional[int] = ..., draft_seed: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class PromptFrames(_message.Message):
    __slots__ = ("request_id", "frames")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    frames: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorFrame]
    def __init__(self, request_id: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[_common_pb2.TensorFrame, _Mapping]]] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("hello", "step_id", "lane_id", "trees", "dropped_request_ids", "kv_usage", "extend_ns", "draft_ns", "total_ns", "model_ns", "chain_ready", "chain_step_done")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    EXTEND_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_READY_FIELD_NUMBER: _ClassVar[int]
    CHAIN_STEP_DONE_FIELD_NUMBER: _ClassVar[int]
    hello: SpeculateHello
    step_id: int
    lane_id: int
    trees: _containers.RepeatedCompositeFieldContainer[Tree]
    dropped_request_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_usage: _common_pb2.KvUsage
    extend_ns: int
    draft_ns: int
    total_ns: int
    model_ns: int
    chain_ready: ChainReady
    chain_step_done: ChainStepDone
    def __init__(self, hello: _Optional[_Union[SpeculateHello, _Mapping]] = ..., step_id: _Optional[int] = ..., lane_id: _Optional[int] = ..., trees: _Optional[_Iterable[_Union[Tree, _Mapping]]] = ..., dropped_request_ids: _Optional[_Iterable[str]] = ..., kv_usage: _Optional[_Union[_common_pb2.KvUsage, _Mapping]] = ..., extend_ns: _Optional[int] = ..., draft_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., model_ns: _Optional[int] = ..., chain_ready: _Optional[_Union[ChainReady, _Mapping]] = ..., chain_step_done: _Optional[_Union[ChainStepDone, _Mapping]] = ...) -> None: ...

class ChainReady(_message.Message):
    __slots__ = ("run_id", "refused", "outcome", "event")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    run_id: int
    refused: str
    outcome: _containers.RepeatedScalarFieldContainer[bytes]
    event: bytes
    def __init__(self, run_id: _Optional[int] = ..., refused: _Optional[str] = ..., outcome: _Optional[_Iterable[bytes]] = ..., event: _Optional[bytes] = ...) -> None: ...

class ChainStepDone(_message.Message):
    __slots__ = ("run_id", "step", "failed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    run_id: int
    step: int
    failed: str
    def __init__(self, run_id: _Optional[int] = ..., step: _Optional[int] = ..., failed: _Optional[str] = ...) -> None: ...

class Tree(_message.Message):
    __slots__ = ("request_id", "token_ids", "parent_indices", "draft_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_indices: _containers.RepeatedScalarFieldContainer[int]
    draft_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., parent_indices: _Optional[_Iterable[int]] = ..., draft_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftServiceGetInfoResponse(_message.Message):
    __slots__ = ("draft_kind", "model_id", "target_model_id", "vocab_size", "target_vocab_size", "target_layer_ids", "hidden_size", "hidden_dtype", "speculation", "tensor_transports", "kv_usage", "version", "local_socket", "instance_id")
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    draft_kind: _common_pb2.DraftKind
    model_id: str
    target_model_id: str
    vocab_size: int
    target_vocab_size: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    hidden_dtype: _common_pb2.Dtype
    speculation: _common_pb2.SpeculationParams
    tensor_transports: _containers.RepeatedScalarFieldContainer[TensorTransport]
    kv_usage: _common_pb2.KvUsage
    version: str
    local_socket: str
    instance_id: str
    def __init__(self, draft_kind: _Optional[_Union[_common_pb2.DraftKind, str]] = ..., model_id: _Optional[str] = ..., target_model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., target_vocab_size: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., hidden_dtype: _Optional[_Union[_common_pb2.Dtype, str]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., tensor_transports: _Optional[_Iterable[_Union[TensorTransport, str]]] = ..., kv_usage: _Optional[_Union[_common_pb2.KvUsage, _Mapping]] = ..., version: _Optional[str] = ..., local_socket: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...
