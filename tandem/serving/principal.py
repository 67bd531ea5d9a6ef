"""Who is calling: the authenticated principal of a public call, the scope of its request ids.

The gateway keys its requests by (principal, request id), so ``Abort`` and the duplicate-id
check see only the caller's own requests: a client cannot abort another's request, nor learn
from a refusal that an id is running elsewhere (docs/operations.md, "Isolation").

The principal is what the server authenticated, nothing a client merely claims:

- the bearer token, when the server checks tokens (``BearerTokenAuth`` let the call through, so
  the token is one of the accepted ones); kept as a digest, never the token itself;
- the client certificate's identities (its SANs, else its CN), when the server requires client
  certificates (mutual TLS: the handshake verified them);
- both, when it does both; one anonymous principal when it does neither.

Each accepted token is its own principal, so a client that switches tokens while one is rotated
out cannot abort, with the new token, what it started with the old one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

ANONYMOUS = "anonymous"


@dataclass(frozen=True, kw_only=True)
class Principals:
    """How a server names its callers: by token, by certificate, both or neither."""

    tokens: bool  # the server checks bearer tokens
    client_certs: bool  # the server requires verified client certificates

    def of(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's principal; ANONYMOUS when the server authenticates nobody."""
        parts = []
        if self.tokens:
            parts.append(f"token:{_token_digest(context.invocation_metadata())}")
        if self.client_certs:
            identities = context.peer_identities() or []
            names = sorted(i.decode(errors="replace") for i in identities)
            parts.append(f"cert:{','.join(names)}")
        return " ".join(parts) or ANONYMOUS


def _token_digest(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """A digest of the call's bearer token (the auth interceptor accepted it)."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            raw = value if isinstance(value, bytes) else value.encode()
            token = raw.strip().partition(b" ")[2].strip()
            return hashlib.sha256(token).hexdigest()[:32]
    return ""  # not reached behind BearerTokenAuth: it refuses calls without a token
