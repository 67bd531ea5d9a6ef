"""What every Tandem gRPC server shares: options, the error interceptor, health, reflection,
graceful shutdown, environment defaults and logging (docs/design.md section 8).

Error mapping lives here and only here: servicers and engines raise the domain exceptions of
``tandem.errors`` and :class:`ErrorInterceptor` turns them into status codes with a readable
message (``google.rpc.Status`` details through grpc-status):

| exception | code | details |
|---|---|---|
| ``InvalidRequest`` | INVALID_ARGUMENT | ``google.rpc.BadRequest`` naming the field |
| a request message that does not parse | INVALID_ARGUMENT | ``BadRequest`` naming ``request`` |
| ``NotFound`` | NOT_FOUND | |
| ``KVExhausted`` | RESOURCE_EXHAUSTED | ``google.rpc.RetryInfo`` (retry in 1 s) |
| any other ``TandemError`` | INTERNAL | deliberate, so logged without a traceback |
| anything else | INTERNAL | ``<Type>: <message>``, logged with its traceback |

A request that does not parse (garbage, a truncated message, invalid UTF-8 in a string field)
never reaches a servicer: the interceptor's deserializer hands the guard a marker instead of
raising inside gRPC (which would answer UNKNOWN), and the guard answers INVALID_ARGUMENT, for a
unary request before the method runs, for a request stream when the method reads that message.
A method's screen (``make_server(screens=...)``) sees the bytes first: a request that its sizes
alone refuse is refused the same way, by the InvalidRequest the screen raised, unparsed.

Other ``TandemError`` s (e.g. ``CheckpointError``) are server-side conditions a caller cannot
fix by changing its request, so INTERNAL (CONTRIBUTING.md: "else INTERNAL") rather than
FAILED_PRECONDITION. A servicer that aborts by itself (``context.abort``, e.g. UNAVAILABLE
while a model loads) passes through untouched.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2  # type: ignore[import-untyped]
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_status import rpc_status

from tandem.errors import InvalidRequest, KVExhausted, NotFound, TandemError

logger = logging.getLogger(__name__)

MiB = 1 << 20
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB  # finite on purpose: hidden states travel chunked
ENV_PREFIX = "TANDEM_"
_PING_INTERVAL_MS = 10_000  # the server tolerates client pings this often (SMG's value)
_KEEPALIVE_TIME_MS = 20_000  # client pings; must stay >= the server's permitted interval
_KEEPALIVE_TIMEOUT_MS = 10_000


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel arguments of every Tandem server: finite message caps and keepalive permits
    that do not GOAWAY clients pinging during a long prefill (C-core's default is 300 s)."""
    if max_message_bytes < 1:
        raise ValueError(f"max_message_bytes: must be >= 1, got {max_message_bytes}")
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", _PING_INTERVAL_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),  # a second server on a taken port fails instead of sharing it
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Client channel arguments paired with :func:`server_options` (keepalive within permits)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def status_for(exc: BaseException) -> status_pb2.Status:
    """The ``google.rpc.Status`` an exception maps to (the table in the module docstring)."""
    details: list[Any] = []
    if isinstance(exc, InvalidRequest):
        code, message = code_pb2.INVALID_ARGUMENT, str(exc)
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=exc.field, description=exc.reason
        )
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    elif isinstance(exc, NotFound):
        code, message = code_pb2.NOT_FOUND, str(exc)
    elif isinstance(exc, KVExhausted):
        code, message = code_pb2.RESOURCE_EXHAUSTED, str(exc) or "KV pool exhausted"
        details.append(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1)))
    elif isinstance(exc, TandemError):
        code, message = code_pb2.INTERNAL, f"{type(exc).__name__}: {exc}"
    else:
        code, message = code_pb2.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    packed = []
    for detail in details:
        any_msg = any_pb2.Any()
        any_msg.Pack(detail)
        packed.append(any_msg)
    return status_pb2.Status(code=code, message=message, details=packed)


async def abort_overloaded(
    context: grpc.aio.ServicerContext, message: str, retry_after_s: float
) -> None:
    """Ends a call with RESOURCE_EXHAUSTED and a ``google.rpc.RetryInfo`` asking the client to
    come back in ``retry_after_s`` (raises, as ``context.abort`` does)."""
    retry = error_details_pb2.RetryInfo()
    retry.retry_delay.FromNanoseconds(int(retry_after_s * 1e9))
    detail = any_pb2.Any()
    detail.Pack(retry)
    status = rpc_status.to_status(
        status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message, details=[detail])
    )
    await context.abort(status.code, status.details, status.trailing_metadata)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping any servicer method (unary or streaming, either direction) to
    a status; the one place where domain errors become gRPC codes. ``screens``: by full method
    name, a check of a request's bytes before they are parsed (InvalidRequest refuses it)."""

    def __init__(self, screens: Mapping[str, Callable[[bytes], None]] | None = None) -> None:
        self.screens = dict(screens or {})

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        for kind in kinds:
            behavior = getattr(handler, kind)
            if behavior is not None:
                factory = getattr(grpc, f"{kind}_rpc_method_handler")
                return factory(
                    _guard(behavior, method, streaming_requests=kind.startswith("stream_")),
                    request_deserializer=_lenient(
                        handler.request_deserializer, self.screens.get(method)
                    ),
                    response_serializer=handler.response_serializer,
                )
        return handler


class _Undecodable:
    """A request message that did not parse, in place of the message (``_lenient``)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def refusal(self) -> InvalidRequest:
        if isinstance(self.error, InvalidRequest):  # a screen's refusal
            return self.error
        return InvalidRequest("request", f"undecodable message ({self.error})")


def _lenient(
    deserializer: Callable[[bytes], Any] | None, screen: Callable[[bytes], None] | None = None
) -> Callable[[bytes], Any] | None:
    """``deserializer`` (after ``screen``) returning an ``_Undecodable`` instead of raising on
    bad bytes."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            if screen is not None:
                screen(data)
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, whatever its version calls it
            return _Undecodable(exc)

    return parse


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream whose undecodable message raises InvalidRequest where it is read."""
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.refusal()
        yield request


def _guard(
    behavior: Callable[..., Any], method: str, *, streaming_requests: bool
) -> Callable[..., Any]:
    """Wraps a handler, keeping its kind (async generator or coroutine)."""

    def requests(request: Any) -> Any:
        if streaming_requests:
            return _checked(request)
        if isinstance(request, _Undecodable):
            raise request.refusal()
        return request

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for response in behavior(requests(request), context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc, method)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(requests(request), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method)

    return call


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    status = status_for(exc)
    if isinstance(exc, InvalidRequest | NotFound):
        logger.info("%s: %s", method, exc)
    elif isinstance(exc, TandemError):
        logger.warning("%s: %s: %s", method, type(exc).__name__, exc)
    else:
        logger.error("%s failed", method, exc_info=exc)
    await context.abort_with_status(rpc_status.to_status(status))


def make_server(
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    maximum_concurrent_rpcs: int | None = None,
    screens: Mapping[str, Callable[[bytes], None]] | None = None,
) -> grpc.aio.Server:
    """A grpc.aio server with :func:`server_options`, ``interceptors`` (e.g.
    ``security.BearerTokenAuth``: a refusal comes before the request is parsed) and the
    :class:`ErrorInterceptor` innermost, around the servicers (with ``screens``, checks of
    requests' bytes before they are parsed). Call it inside the loop that will serve it;
    :func:`bind` adds its listening port."""
    return grpc.aio.server(
        interceptors=[*interceptors, ErrorInterceptor(screens)],
        options=server_options(max_message_bytes),
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )


def bind(
    server: grpc.aio.Server,
    address: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Listens on ``address`` (``HOST:PORT``, port 0 = any free one): TLS with
    ``credentials`` (``security.server_credentials``), plain without. Returns the bound port;
    OSError naming the address when it cannot listen."""
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
        raise OSError(f"cannot listen on {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port


class Health(health_aio.HealthServicer):
    """grpc_health's aio servicer, starting NOT_SERVING: a service reports SERVING only once
    its model is loaded and warmed up (``await health.set("", SERVING)``)."""

    def __init__(self, service_names: Sequence[str] = ()) -> None:
        super().__init__()
        # set() is a coroutine and this may run before a loop exists: write the initial state
        # directly, before any watcher can subscribe.
        for name in ("", *service_names):
            self._server_status[name] = NOT_SERVING

    async def set_serving(self, serving: bool = True) -> None:
        """Sets the overall status and every registered service's."""
        for name in list(self._server_status):
            await self.set(name, SERVING if serving else NOT_SERVING)


def add_health(server: grpc.aio.Server, service_names: Sequence[str] = ()) -> Health:
    """Registers grpc.health.v1 on ``server``; overall and ``service_names`` start NOT_SERVING."""
    health = Health(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    return health


def maybe_add_reflection(
    server: grpc.aio.Server, service_names: Sequence[str], enabled: bool
) -> None:
    """Server reflection for grpcurl and friends; off unless asked for (production gates it)."""
    if not enabled:
        return
    from grpc_reflection.v1alpha import reflection

    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)


async def serve(
    server: grpc.aio.Server,
    health: Health,
    *,
    grace: float,
    on_shutdown: Callable[[], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Runs a started server until SIGTERM/SIGINT (or ``stop`` is set), then shuts down in
    SMG's order: health NOT_SERVING, ``server.stop(grace)`` drains open calls, then
    ``on_shutdown`` (close the engine) — closing the engine first would fail draining calls."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    logger.info("shutting down: draining for up to %.1f s", grace)
    await health.enter_graceful_shutdown()
    await server.stop(grace)
    if on_shutdown is not None:
        result = on_shutdown()
        if inspect.isawaitable(result):
            await result
    logger.info("stopped")


T = TypeVar("T", str, int, float, bool)


def freeze_heap() -> None:
    """Once a service is loaded and warmed up: everything alive (the model, its graphs, a
    tokenizer's tables, the server) leaves the garbage collector's view (``gc.freeze`` after
    a full collection). Otherwise each generation-2 collection walks all of it again, a
    stalled step each on a large target (``TANDEM_TARGET_DIAGNOSTICS`` logs them)."""
    gc.collect()
    gc.freeze()


_gc_loggers: set[str] = set()


def log_gc_pauses(log: logging.Logger, min_ms: float = 2.0) -> None:
    """Logs (WARNING) every garbage collection of ``min_ms`` or more in this process, so that
    a slow step can be told from a collection (the benchmarks turn it on; once per logger)."""
    if log.name in _gc_loggers:
        return
    _gc_loggers.add(log.name)
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - started[0]) * 1e3
        if ms >= min_ms:
            log.warning(
                "gc generation %d took %.1f ms (%d collected)",
                info["generation"],
                ms,
                info["collected"],
            )

    gc.callbacks.append(on_gc)


@overload
def env_default(name: str, default: T) -> T: ...
@overload
def env_default(name: str, default: None) -> str | None: ...
def env_default(name: str, default: T | None) -> T | str | None:
    """The value of environment variable ``name`` (which must start with ``TANDEM_``),
    converted to ``default``'s type, else ``default``. A bad value raises ValueError naming the
    variable. Booleans accept 1/0, true/false, yes/no, on/off."""
    if not name.startswith(ENV_PREFIX):
        raise ValueError(f"{name}: Tandem's environment variables start with {ENV_PREFIX}")
    raw = os.environ.get(name)
    if raw is None or default is None:
        return raw if raw is not None else default
    try:
        if isinstance(default, bool):
            flag = raw.strip().lower()
            if flag not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(f"not a boolean: {raw!r}")
            return flag in ("1", "true", "yes", "on")
        return type(default)(raw)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


class _OneLineFormatter(logging.Formatter):
    """Keeps each record on one line (tracebacks included) so log collectors never split it."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


def configure_logging(level: str | int = "INFO") -> None:
    """Root logging to stderr: ``time level logger: message``, one line per record."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); ValueError when malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"address: expected HOST:PORT, got {address!r}")
    port = int(port_text)
    if not 0 <= port < 65536:
        raise ValueError(f"address: port {port} out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def format_address(host: str, port: int) -> str:
    """Inverse of :func:`parse_address` (brackets an IPv6 host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
