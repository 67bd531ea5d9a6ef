"""Each Control stream's request ids are its own (docs/design.md, "Isolation").

The target may serve several gateways (replicas in front of one target), each naming its
requests as it likes, and a stream must not reach another's requests: an abort or a lane move
naming an id another stream admitted, or an admit reusing one, would otherwise act on, or
reveal, a request that is not its own. So the servicer scopes every id a stream sends with the
stream's number before the engine sees it (``inward``), and strips the scope from every commit
the stream gets back (``outward``). The engine, its spans and the draft see the scoped ids; a
stream only ever sees its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.v1 import target_pb2


class StreamScope:
    """The id space of one Control stream."""

    def __init__(self, stream_id: int) -> None:
        # A stream number has no "/", so the first "/" ends the scope: ids of two streams
        # never collide, whatever either sends.
        self.prefix = f"{stream_id}/"

    def inward(self, request_id: str) -> str:
        """The engine's id for the stream's ``request_id``."""
        return self.prefix + request_id

    def inward_all(self, request_ids: Iterable[str]) -> list[str]:
        return [self.prefix + request_id for request_id in request_ids]

    def outward(self, message: target_pb2.ControlResponse) -> target_pb2.ControlResponse:
        """``message`` as the stream knows it: its commits under the stream's own ids (a
        step report is built for one stream, so it is changed in place)."""
        if message.HasField("step"):
            for commit in message.step.commits:
                commit.request_id = commit.request_id.removeprefix(self.prefix)
        return message
