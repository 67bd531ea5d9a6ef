from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]
    DTYPE_FLOAT64: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_INT8: _ClassVar[Dtype]
    DTYPE_INT16: _ClassVar[Dtype]

class DraftKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_KIND_UNSPECIFIED: _ClassVar[DraftKind]
    DRAFT_KIND_EAGLE3: _ClassVar[DraftKind]
    DRAFT_KIND_EAGLE: _ClassVar[DraftKind]
    DRAFT_KIND_MTP: _ClassVar[DraftKind]
    DRAFT_KIND_MODEL: _ClassVar[DraftKind]
    DRAFT_KIND_NGRAM: _ClassVar[DraftKind]

class SpecPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEC_POLICY_UNSPECIFIED: _ClassVar[SpecPolicy]
    SPEC_POLICY_FIXED: _ClassVar[SpecPolicy]
    SPEC_POLICY_ADAPTIVE: _ClassVar[SpecPolicy]
    SPEC_POLICY_K0: _ClassVar[SpecPolicy]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class DraftState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_STATE_UNSPECIFIED: _ClassVar[DraftState]
    DRAFT_STATE_DISABLED: _ClassVar[DraftState]
    DRAFT_STATE_CONNECTING: _ClassVar[DraftState]
    DRAFT_STATE_HEALTHY: _ClassVar[DraftState]
    DRAFT_STATE_UNHEALTHY: _ClassVar[DraftState]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_INT32: Dtype
DTYPE_INT64: Dtype
DTYPE_BOOL: Dtype
DTYPE_FLOAT64: Dtype
DTYPE_UINT8: Dtype
DTYPE_INT8: Dtype
DTYPE_INT16: Dtype
DRAFT_KIND_UNSPECIFIED: DraftKind
DRAFT_KIND_EAGLE3: DraftKind
DRAFT_KIND_EAGLE: DraftKind
DRAFT_KIND_MTP: DraftKind
DRAFT_KIND_MODEL: DraftKind
DRAFT_KIND_NGRAM: DraftKind
SPEC_POLICY_UNSPECIFIED: SpecPolicy
SPEC_POLICY_FIXED: SpecPolicy
SPEC_POLICY_ADAPTIVE: SpecPolicy
SPEC_POLICY_K0: SpecPolicy
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
DRAFT_STATE_UNSPECIFIED: DraftState
DRAFT_STATE_DISABLED: DraftState
DRAFT_STATE_CONNECTING: DraftState
DRAFT_STATE_HEALTHY: DraftState
DRAFT_STATE_UNHEALTHY: DraftState

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorFrame(_message.Message):
    __slots__ = ("name", "chunk_index", "num_chunks", "byte_offset", "total_bytes", "dtype", "shape", "data", "shared_offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    chunk_index: int
    num_chunks: int
    byte_offset: int
    total_bytes: int
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shared_offset: int
    def __init__(self, name: _Optional[str] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., byte_offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared_offset: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "max_new_tokens", "stop_token_ids", "stop_strings", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "min_tokens", "logit_bias", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: bool
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("enabled", "draft_kind", "num_steps", "topk", "num_draft_tokens")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    draft_kind: DraftKind
    num_steps: int
    topk: int
    num_draft_tokens: int
    def __init__(self, enabled: _Optional[bool] = ..., draft_kind: _Optional[_Union[DraftKind, str]] = ..., num_steps: _Optional[int] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens", "verify_steps", "accept_length", "drafted_steps", "steps_without_tree")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_WITHOUT_TREE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    accept_length: float
    drafted_steps: int
    steps_without_tree: StepsWithoutTree
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ..., accept_length: _Optional[float] = ..., drafted_steps: _Optional[int] = ..., steps_without_tree: _Optional[_Union[StepsWithoutTree, _Mapping]] = ...) -> None: ...

class StepsWithoutTree(_message.Message):
    __slots__ = ("policy", "late", "stale", "not_in_draft", "opted_out", "capacity")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    NOT_IN_DRAFT_FIELD_NUMBER: _ClassVar[int]
    OPTED_OUT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    policy: int
    late: int
    stale: int
    not_in_draft: int
    opted_out: int
    capacity: int
    def __init__(self, policy: _Optional[int] = ..., late: _Optional[int] = ..., stale: _Optional[int] = ..., not_in_draft: _Optional[int] = ..., opted_out: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("carrier",)
    class CarrierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CARRIER_FIELD_NUMBER: _ClassVar[int]
    carrier: _containers.ScalarMap[str, str]
    def __init__(self, carrier: _Optional[_Mapping[str, str]] = ...) -> None: ...

class KvUsage(_message.Message):
    __slots__ = ("pages_used", "pages_total", "page_size")
    PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    pages_used: int
    pages_total: int
    page_size: int
    def __init__(self, pages_used: _Optional[int] = ..., pages_total: _Optional[int] = ..., page_size: _Optional[int] = ...) -> None: ...

class ErrorStatus(_message.Message):
    __slots__ = ("code", "message", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    field: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...
