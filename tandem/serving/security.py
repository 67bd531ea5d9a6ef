"""Transport security and authentication for Tandem's gRPC hops:
TLS on the gateway's public port, mutual TLS between the services, bearer tokens on the
public API.

Server side::

    tls = ServerTLS(cert=..., key=..., client_ca=..., require_client_cert=True)  # mTLS
    server = rpc.make_server(interceptors=[BearerTokenAuth(tokens)])  # public API only
    port = rpc.bind(server, "0.0.0.0:50051", server_credentials(tls))

Client side (the gateway's channel to the target, the target's to the draft)::

    tls = ClientTLS(ca=..., cert=..., key=...)  # cert/key only where the server wants mTLS
    channel = open_channel("target:50052", tls=tls, options=serving.channel_options(cap))
    # or, with a token for the gateway's public API:
    channel = open_channel("gw.example:50051", tls=ClientTLS(ca=...), token=token)

Every setting is checked when its dataclass is built: unreadable files, a PEM that holds no
certificate, a key that does not belong to its certificate or is encrypted, and contradictory
flags raise ValueError naming the field and the path, so a service refuses to start with a
readable reason instead of gRPC's "Failed to bind". The files are read again when credentials
are made, so a rotated certificate is picked up by the next server or connection (not by a
running listener: hot reload would need ``dynamic_ssl_server_credentials``).

Tokens: :class:`BearerTokenAuth` wants ``authorization: Bearer <token>`` metadata and answers
UNAUTHENTICATED otherwise, comparing with :func:`hmac.compare_digest` against every accepted
token (several may be valid at once while one is rotated out). ``grpc.health.v1.Health`` is
exempt on purpose: container and load-balancer probes hold no token, and the only thing it
reveals is SERVING or not. :func:`open_channel` sends a token only over TLS or to a loopback
address (without TLS it uses gRPC's local credentials, which refuse any other peer), never in
clear text across a network; :func:`token_metadata` leaves that choice to its caller.

Flags: the dataclasses' fields are settings (``tandem.settings``); :func:`server_tls_flags` /
:func:`client_tls_flags` give every service the same TLS flags with ``TANDEM_<SERVICE>_*``
environment defaults, and the matching ``*_from_args`` build the dataclasses.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tandem.serving.rpc import channel_options
from tandem.settings import Flags, setting

logger = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
MIN_TOKEN_CHARS = 16  # shorter ones are guessable; secrets.token_urlsafe(32) gives 43


def _read(field: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path} ({exc.strerror or exc})") from None
    if not data.strip():
        raise ValueError(f"{field}: {path} is empty")
    return data


def _refuse_password() -> bytes:
    raise ValueError("the private key is encrypted; gRPC needs an unencrypted PEM key")


def _check_pair(cert_field: str, cert: Path, key_field: str, key: Path) -> None:
    """The certificate chain parses and the key is its unencrypted private key."""
    _read(cert_field, cert)
    _read(key_field, key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key, password=_refuse_password)
    except ValueError as exc:
        raise ValueError(f"{key_field}: {key}: {exc}") from None
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "MISMATCH" in reason.upper():
            raise ValueError(
                f"{key_field}: {key} is not the private key of {cert_field} {cert}"
            ) from None
        raise ValueError(
            f"{cert_field}/{key_field}: {cert}, {key}: not a PEM certificate and key ({reason})"
        ) from None


def _check_ca(field: str, path: Path) -> None:
    """The bundle holds at least one PEM certificate."""
    _read(field, path)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(
            f"{field}: {path} holds no PEM certificate ({exc.reason or exc})"
        ) from None


@dataclass(frozen=True, kw_only=True)
class ServerTLS:
    """What a server presents, and (mTLS) which CA its clients' certificates must chain to."""

    cert: Path = setting(  # leaf first
        help="PEM certificate chain to present; with --tls-key the port speaks TLS",
        env="TLS_CERT",
        flag="tls-cert",
    )
    key: Path = setting(help="its PEM private key, unencrypted", env="TLS_KEY", flag="tls-key")
    client_ca: Path | None = setting(
        None,
        help="PEM CA bundle client certificates must chain to (with --require-client-cert)",
        env="TLS_CLIENT_CA",
        flag="tls-client-ca",
    )
    require_client_cert: bool = setting(
        False,
        help="mutual TLS: refuse clients without a certificate from --tls-client-ca",
        env="REQUIRE_CLIENT_CERT",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "cert", Path(self.cert))
        object.__setattr__(self, "key", Path(self.key))
        if self.client_ca is not None:
            object.__setattr__(self, "client_ca", Path(self.client_ca))
        # gRPC Python either requires a verified client certificate or does not ask for one:
        # a CA without the requirement would silently check nothing.
        if self.require_client_cert and self.client_ca is None:
            raise ValueError("require_client_cert: needs client_ca, the CA clients must chain to")
        if self.client_ca is not None and not self.require_client_cert:
            raise ValueError(
                "client_ca: only used with require_client_cert (gRPC does not verify "
                "optional client certificates)"
            )
        _check_pair("cert", self.cert, "key", self.key)
        if self.client_ca is not None:
            _check_ca("client_ca", self.client_ca)


@dataclass(frozen=True, kw_only=True)
class ClientTLS:
    """How a client verifies its server and (mTLS) which certificate it presents."""

    ca: Path | None = setting(  # None: the system's roots
        None,
        help="PEM CA bundle the server's certificate must chain to; turns TLS on",
        env="TLS_CA",
        flag="tls-ca",
    )
    cert: Path | None = setting(
        None,
        help="client certificate to present (mutual TLS; with its key)",
        env="TLS_CERT",
        flag="tls-cert",
    )
    key: Path | None = setting(
        None,
        help="the client certificate's PEM private key, unencrypted",
        env="TLS_KEY",
        flag="tls-key",
    )
    server_name: str | None = setting(
        None,
        help="name expected in the server's certificate when it is not the address's host",
        env="TLS_SERVER_NAME",
        flag="tls-server-name",
    )

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert: a client certificate and its key go together")
        if self.server_name is not None and not self.server_name.strip():
            raise ValueError("server_name: must not be empty")
        if self.ca is not None:
            _check_ca("ca", self.ca)
        if self.cert is not None and self.key is not None:
            _check_pair("cert", self.cert, "key", self.key)


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials:
    """Credentials for ``serving.bind`` (``add_secure_port``)."""
    root = None if tls.client_ca is None else _read("client_ca", tls.client_ca)
    pair = (_read("key", tls.key), _read("cert", tls.cert))
    return grpc.ssl_server_credentials(
        [pair], root_certificates=root, require_client_auth=tls.require_client_cert
    )


def channel_credentials(tls: ClientTLS, token: str | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials (with the client certificate when set), and the bearer token
    on every call when ``token`` is given. Works for sync and aio channels."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=None if tls.ca is None else _read("ca", tls.ca),
        private_key=None if tls.key is None else _read("key", tls.key),
        certificate_chain=None if tls.cert is None else _read("cert", tls.cert),
    )
    if token is None:
        return creds
    return grpc.composite_channel_credentials(creds, token_call_credentials(token))


def tls_channel_options(tls: ClientTLS | None) -> list[tuple[str, Any]]:
    """Channel arguments TLS needs beyond credentials (the expected server name)."""
    if tls is None or tls.server_name is None:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]


def open_channel(
    address: str,
    *,
    tls: ClientTLS | None = None,
    token: str | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: TLS when ``tls`` is set, plain otherwise.
    ``options`` default to :func:`tandem.serving.rpc.channel_options` (finite message caps);
    ``token`` adds ``authorization: Bearer`` to every call. Without TLS a token is only sent
    to a loopback address (gRPC local credentials); other addresses fail to connect."""
    opts = [*(channel_options() if options is None else options), *tls_channel_options(tls)]
    if tls is not None:
        return grpc.aio.secure_channel(address, channel_credentials(tls, token), options=opts)
    if token is not None:
        local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        creds = grpc.composite_channel_credentials(local, token_call_credentials(token))
        return grpc.aio.secure_channel(address, creds, options=opts)
    return grpc.aio.insecure_channel(address, options=opts)


def token_call_credentials(token: str) -> grpc.CallCredentials:
    """Per-call credentials sending ``authorization: Bearer <token>`` (secure channels)."""
    return grpc.access_token_call_credentials(_check_token(token, "token"))


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The same header as call metadata, for ``stub.Method(request, metadata=...)``."""
    return (("authorization", f"Bearer {_check_token(token, 'token')}"),)


def _check_token(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{where}: a token needs at least {MIN_TOKEN_CHARS} characters")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"{where}: a token is printable ASCII without spaces")
    return token


def load_tokens(token: str | None = None, token_file: Path | None = None) -> tuple[str, ...]:
    """Accepted tokens from a value and/or a file (one per line; blank lines and ``#``
    comments skipped). Empty when neither is given (authentication off)."""
    tokens: list[str] = []
    if token is not None:
        tokens.append(_check_token(token, "auth_token"))
    if token_file is not None:
        path = Path(token_file)
        text = _read("auth_token_file", path).decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                tokens.append(_check_token(line, f"auth_token_file: {path}:{number}"))
        if not tokens:
            raise ValueError(f"auth_token_file: {path} holds no token")
    return tuple(dict.fromkeys(tokens))


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid ``authorization: Bearer <token>`` with UNAUTHENTICATED;
    methods of ``exempt_services`` (health, by default) pass without one."""

    def __init__(
        self, tokens: Iterable[str], *, exempt_services: Sequence[str] = (HEALTH_SERVICE,)
    ) -> None:
        self._tokens = tuple(_check_token(t, "tokens").encode() for t in tokens)
        if not self._tokens:
            raise ValueError("tokens: at least one token is needed")
        self._exempt = tuple(f"/{name}/" for name in exempt_services)

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why a call with this metadata is refused; None when it carries an accepted token."""
        values = [v for k, v in metadata or () if k.lower() == "authorization"]
        if not values:
            return "missing bearer token (authorization metadata)"
        if len(values) > 1:
            return "more than one authorization header"
        value = values[0]
        raw = value if isinstance(value, bytes) else value.encode()
        scheme, _, presented = raw.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not presented:
            return "authorization is not a bearer token"
        presented = presented.strip()
        # Compare with every token, so timing says nothing about which one came close.
        matched = False
        for token in self._tokens:
            matched |= hmac.compare_digest(presented, token)
        return None if matched else "invalid bearer token"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(self._exempt):
            return await continuation(handler_call_details)
        reason = self.refusal(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if reason is None or handler is None:
            return handler
        logger.info("%s: refused: %s", method, reason)
        return _refusing(handler, reason)


def _refusing(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers UNAUTHENTICATED without running anything: a
    coroutine where the method answers once, an async generator where it streams (what
    wraps it, the telemetry's interceptor say, iterates a streaming method's handler)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # unreachable: abort raises; it makes this an async generator

    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind) is not None:
            factory = getattr(grpc, f"{kind}_rpc_method_handler")
            return factory(
                refuse_stream if kind.endswith("_stream") else refuse,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise AssertionError(f"a method handler of no known kind: {handler}")


# Flags. Each service lists these on its command line; variables follow its TANDEM_<SERVICE>_ rule.


def server_tls_flags(env_prefix: str) -> Flags:
    """``--tls-cert``, ``--tls-key``, ``--tls-client-ca``, ``--require-client-cert`` with
    ``<env_prefix>TLS_CERT`` ... ``<env_prefix>REQUIRE_CLIENT_CERT`` defaults."""
    names = ("cert", "key", "client_ca", "require_client_cert")
    return Flags(ServerTLS, names, env_prefix=env_prefix, title="TLS (server)", optional=True)


def server_tls_from_args(args: argparse.Namespace) -> ServerTLS | None:
    """The ServerTLS the flags describe, None when TLS is off; ValueError when incomplete."""
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_client_ca
    if cert is None and key is None:
        if ca is not None or args.require_client_cert:
            raise ValueError("tls_client_ca: client certificates need TLS (--tls-cert/--tls-key)")
        return None
    if cert is None or key is None:
        raise ValueError("tls_cert: --tls-cert and --tls-key go together")
    return ServerTLS(cert=cert, key=key, client_ca=ca, require_client_cert=args.require_client_cert)


def client_tls_flags(peer: str, env_prefix: str) -> Flags:
    """``--<peer>-tls-ca``, ``--<peer>-tls-cert``, ``--<peer>-tls-key``,
    ``--<peer>-tls-server-name`` with ``<env_prefix><PEER>_TLS_*`` defaults."""
    return Flags(
        ClientTLS,
        ("ca", "cert", "key", "server_name"),
        env_prefix=f"{env_prefix}{peer.upper()}_",
        flag_prefix=f"{peer}-",
        title=f"TLS to the {peer} service (client)",
    )


def client_tls_from_args(args: argparse.Namespace, peer: str) -> ClientTLS | None:
    """The ClientTLS for ``peer``'s flags; None (plain) when none of them is set."""
    values = {name: getattr(args, f"{peer}_tls_{name}") for name in ("ca", "cert", "key")}
    server_name = getattr(args, f"{peer}_tls_server_name")
    if all(v is None for v in values.values()):
        if server_name is not None:
            raise ValueError(f"{peer}_tls_server_name: only used with TLS (--{peer}-tls-ca)")
        return None
    return ClientTLS(**values, server_name=server_name)
