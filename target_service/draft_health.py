"""The draft's state in the target's gRPC health, as the service ``tandem.v1.DraftService``.

The target serves with a late or gone draft (its steps decode without trees), so its own health
(``""``, ``tandem.v1.TargetService``) stays SERVING; a probe, an orchestrator or an operator that
wants to know whether speculation is on asks for this name instead: SERVING while the draft is
HEALTHY, NOT_SERVING while it is connecting or UNHEALTHY (late, stalled or gone). Without a
draft the name is not registered (SERVICE_UNKNOWN). The gauge ``tandem.target.draft_state``
says the same to Prometheus: 1 for the state the draft is in now (attribute ``state``), 0 for
the others."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from opentelemetry import metrics

from tandem.serving import telemetry
from tandem.serving.rpc import NOT_SERVING, SERVING, Health
from tandem.spec.base import DraftState

DRAFT_SERVICE = "tandem.v1.DraftService"


async def mirror(health: Health, state: Callable[[], DraftState], interval_s: float) -> None:
    """Keeps ``DRAFT_SERVICE``'s health in step with ``state()``, polled every ``interval_s``,
    until cancelled."""
    telemetry.gauge(
        metrics.get_meter("tandem.target"),
        "tandem.target.draft_state",
        "",  # a 0/1 state, no unit (telemetry.gauge)
        "the draft's state now (attribute state): 1 for the current one",
        lambda: [(int(state() is s), {"state": s.name.lower()}) for s in DraftState],
    )
    last: bool | None = None
    while True:
        serving = state() is DraftState.HEALTHY
        if serving != last:
            await health.set(DRAFT_SERVICE, SERVING if serving else NOT_SERVING)
            last = serving
        await asyncio.sleep(interval_s)
