"""Request ids scoped to their principal (``tandem.serving.principal``): the gateway keys its
jobs by (principal, request id), and a principal's duplicate check sees only its own ids.

The id the target sees (``Job.target_id``, the client's id and the gateway's sequence number)
is unique at the gateway whoever sent it, so two principals may run the same id at once."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping

JobKey = tuple[str, str]  # (principal, request id)


class OwnedIds(Collection[str]):
    """The request ids one principal has queued or running, a live view of the gateway's jobs."""

    def __init__(self, jobs: Mapping[JobKey, object], principal: str) -> None:
        self._jobs = jobs
        self._principal = principal

    def __contains__(self, request_id: object) -> bool:
        return (self._principal, request_id) in self._jobs

    def __iter__(self) -> Iterator[str]:
        return (rid for principal, rid in self._jobs if principal == self._principal)

    def __len__(self) -> int:
        return sum(1 for _ in self)
