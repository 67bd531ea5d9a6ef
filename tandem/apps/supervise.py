"""Supervision of ``tandem serve``'s three processes: a service that exits is started again (same
flags, same port, its log appended to) after a backoff that doubles with each restart, while the
others keep serving. What each service's absence costs a client is in docs/operations.md
("Failure semantics"): a dead draft costs speed, a dead target holds in-flight requests at the
gateway until it is back (the gateway re-admits them), a dead gateway ends its clients' calls.

A service that dies again and again is given up on after ``max_restarts`` restarts in a row (a
restart counts unless the service then served for ``stable_s``): it stays down and the gateway
answers UNAVAILABLE naming the target. Without a gateway nothing serves, so giving up on it ends
``tandem serve``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.apps.launch import Service, Stack
from tandem.serving.rpc import channel_options

_PROBE_TIMEOUT_S = 0.5


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """How often and how soon a dead service is started again."""

    max_restarts: int = 5  # restarts in a row before giving up; 0 = never restart
    backoff_s: float = 0.5  # before the first restart; doubles with each further one
    backoff_max_s: float = 10.0
    stable_s: float = 60.0  # serving this long after a restart resets the count
    ready_timeout_s: float = 300.0  # a restart not SERVING by then has failed

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if not 0 < self.backoff_s <= self.backoff_max_s:
            raise ValueError("backoff_s: must be > 0 and at most backoff_max_s")

    def backoff(self, restarts: int) -> float:
        """The wait before restart number ``restarts + 1``."""
        return float(min(self.backoff_max_s, self.backoff_s * 2**restarts))


class Phase(enum.Enum):
    SERVING = "serving"
    WAITING = "waiting"  # dead, to be started again at `due`
    STARTING = "starting"  # started again, not SERVING yet
    GIVEN_UP = "given up"


@dataclass
class Watch:
    """The supervisor's record of one service."""

    service: Service
    phase: Phase = Phase.SERVING
    restarts: int = 0  # restarts in a row (reset once the service served for stable_s)
    since: float = 0.0  # when the phase began
    due: float = 0.0  # WAITING: when to start it again


class Supervisor:
    """Restarts the services of a started stack; ``tick`` does one round (call it often)."""

    def __init__(
        self,
        stack: Stack,
        policy: RestartPolicy,
        *,
        log_dir: Path | None,
        report: Callable[[str], None],
    ) -> None:
        now = time.monotonic()
        self.stack = stack
        self.policy = policy
        self.log_dir = log_dir
        self.report = report
        self.watches = [Watch(svc, since=now) for svc in stack.services]

    def phase(self, name: str) -> Phase:
        return next(w.phase for w in self.watches if w.service.name == name)

    @property
    def serving(self) -> bool:
        """False once the gateway is given up on: nothing can reach the stack any more."""
        return all(w.phase is not Phase.GIVEN_UP for w in self.watches if _public(w.service))

    def tick(self) -> None:
        now = time.monotonic()
        for watch in self.watches:
            self._step(watch, now)

    def _step(self, watch: Watch, now: float) -> None:
        svc = watch.service
        assert svc.proc is not None
        if watch.phase is Phase.SERVING and svc.proc.poll() is not None:
            if now - watch.since >= self.policy.stable_s:
                watch.restarts = 0
            self._failed(watch, now, f"{svc.name} exited with {svc.proc.returncode}")
        elif watch.phase is Phase.WAITING and now >= watch.due:
            watch.restarts += 1
            self.stack.launch(svc, self.log_dir)
            watch.phase, watch.since = Phase.STARTING, now
        elif watch.phase is Phase.STARTING:
            if svc.proc.poll() is not None:
                self._failed(watch, now, f"{svc.name} exited with {svc.proc.returncode} on restart")
            elif _answers(svc.port, serving=not _public(svc)):
                watch.phase, watch.since = Phase.SERVING, now
                self.report(f"{svc.name} restarted (restart {watch.restarts}), serving again")
            elif now - watch.since > self.policy.ready_timeout_s:
                svc.proc.kill()
                svc.proc.wait()
                self._failed(watch, now, f"{svc.name} was not SERVING after restart")

    def _failed(self, watch: Watch, now: float, what: str) -> None:
        log = f" (log: {watch.service.log})" if watch.service.log else ""
        if watch.restarts >= self.policy.max_restarts:
            watch.phase, watch.since = Phase.GIVEN_UP, now
            self.report(f"{what}; given up after {watch.restarts} restarts{log}")
            return
        wait = self.policy.backoff(watch.restarts)
        watch.phase, watch.since, watch.due = Phase.WAITING, now, now + wait
        self.report(f"{what}; restarting in {wait:.1f} s{log}")


def _public(svc: Service) -> bool:
    return svc.name == "gateway"


def _answers(port: int, *, serving: bool) -> bool:
    """Whether the service's health answers (SERVING, where ``serving``: the gateway is
    NOT_SERVING until the target is connected, which may be later)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=_PROBE_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
    return not serving or reply.status == health_pb2.HealthCheckResponse.SERVING
