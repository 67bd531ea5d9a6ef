"""Protobuf <-> domain conversion for the wire contract (``from tandem import wire``):
tensors and frames in ``frames`` (decoding) and ``framing`` (encoding), the contract's domain
messages in ``convert``, and the version of the target <-> draft protocol both ends check in
their hellos."""

from tandem.wire.convert import (
    HIDDEN_STATES,
    MAX_TEMPERATURE,
    admit_from_proto,
    admit_to_proto,
    admit_with_features,
    draft_kind_from_proto,
    draft_kind_to_proto,
    finish_reason_from_proto,
    finish_reason_to_proto,
    outcome_from_proto,
    outcome_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    spec_from_proto,
    spec_to_proto,
    tree_from_proto,
    tree_to_proto,
    usage_to_proto,
    without_tree_to_proto,
)
from tandem.wire.frames import (
    MAX_FRAME_BYTES,
    MAX_NDIM,
    Expected,
    FrameAssembler,
    proto_dtype,
    tensor_from_frames,
    tensor_from_proto,
    tensor_to_proto,
    torch_dtype,
)
from tandem.wire.framing import (
    EncodedFrame,
    encode_frames,
    length_tag,
    shared_frame,
    tensor_to_frames,
    varint,
)

# The Speculate stream's protocol: a draft service refuses a hello of another version.
PROTOCOL_VERSION = 1

__all__ = [
    "HIDDEN_STATES",
    "MAX_FRAME_BYTES",
    "MAX_NDIM",
    "MAX_TEMPERATURE",
    "PROTOCOL_VERSION",
    "EncodedFrame",
    "Expected",
    "FrameAssembler",
    "admit_from_proto",
    "admit_to_proto",
    "admit_with_features",
    "draft_kind_from_proto",
    "draft_kind_to_proto",
    "encode_frames",
    "finish_reason_from_proto",
    "finish_reason_to_proto",
    "length_tag",
    "outcome_from_proto",
    "outcome_to_proto",
    "proto_dtype",
    "sampling_from_proto",
    "sampling_to_proto",
    "shared_frame",
    "spec_from_proto",
    "spec_to_proto",
    "tensor_from_frames",
    "tensor_from_proto",
    "tensor_to_frames",
    "tensor_to_proto",
    "torch_dtype",
    "tree_from_proto",
    "tree_to_proto",
    "usage_to_proto",
    "varint",
    "without_tree_to_proto",
]
