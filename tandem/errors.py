"""Domain exceptions shared by every service.

Each maps to one gRPC status code in the services' error interceptor, so the core never imports
grpc and a caller always gets a readable reason.
"""


class TandemError(Exception):
    """Base class of the errors Tandem raises on purpose."""


class InvalidRequest(TandemError, ValueError):
    """A request or argument failed validation (INVALID_ARGUMENT). The message names the field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotFound(TandemError, KeyError):
    """A request id or resource that does not exist (NOT_FOUND)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class KVExhausted(TandemError):
    """The paged KV pool has too few free pages for an allocation (RESOURCE_EXHAUSTED)."""


class CheckpointError(TandemError, ValueError):
    """A checkpoint directory is missing files, tensors or config keys this runtime needs."""
