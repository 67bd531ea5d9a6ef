"""The engine's side of the draft conversation (docs/design.md sections 3 and 5).

After a lane's step, ``submit`` hands the draft what the verification committed: admits for
requests whose prompt just finished (with the prompt's target features), outcomes (accepted
tokens, bonus token, the accepted path's features) and released ids. At the lane's next step,
``collect`` attaches the trees that came back. A tree answers only the submission it was
drafted for (``Request.draft_seq``): a request that stepped again in between (its tree was
late, say) decodes that step without one, never with a stale one; one the gateway moved to the
other lane has its old lane's answer collected first (``collect_moved``).

K=0 steps (the adaptive policy, ``tandem.target.policy``) submit with ``draft=False``: their
outcomes are held back per request and merged (tokens and features concatenate exactly as the draft
would have applied them one by one), so the draft does no work while the lane decodes plainly. They
go out in one extend when speculation resumes, or, while the features held for all requests pass the
cap, the longest runs go out until half of it is left (that answer's trees are unused while K=0
lasts); a request that finishes during K=0 sends nothing. The features stay where the step left them
(``hold.py``). To a draft service (``Drafter.remote``), waiting admits and held runs go out at most
``HELD_BYTES_PER_STEP`` of features per step, so a batch that pauses together does not resume in one
message over the stream's cap (``SHARED_HELD_BYTES_PER_STEP`` through a buffer the draft shares); a
request still holding decodes without a tree. In process a speculating step sends everything due at
once; only K=0 flushes (past the cap) are paced, to spread their draft work.

A new prompt's intake never takes trees away from the running requests. To a draft service whose
prompts are serialised (``Drafter.remote``, not ``shares_prompts``), admits go out in their own
message on the intake lane (``INTAKE_LANE``), after the lane's step, at most ``INTAKE_BYTES`` of
features at a time (one message outstanding); the admitted requests are parked
(``Request.parked``): speculating steps leave them out until that answer, their first trees, is
back (``settle_intake``: taken when it has come, waited for only when nothing else could step, as
in process). So the transport of a batch of prompts' features (24 KiB a token for an 8B EAGLE-3
head) costs the new requests a short wait, never the running ones their trees: every request
verifies a tree at every decode step, as in process. K=0 steps leave nothing out. A draft sharing
a prompt buffer on this host (``Drafter.shares_prompts``) and an in-process drafter take admits
with the lane's step, whose answer is waited for.
"""

from __future__ import annotations

import logging
import time

import torch

from tandem.request import Request
from tandem.spec.base import Drafter
from tandem.spec.types import DraftAdmit, NoTree, SpecConfig, VerifyOutcome
from tandem.spec.verify import Verified
from tandem.target import hold
from tandem.target.hold import Held
from tandem.target.readmit import readmit_lost
from tandem.target.runner import ModelInputs, ModelOutputs
from tandem.target.scheduler import ScheduledBatch, Scheduler
from tandem.target.step import MAX_LANES
from tandem.transfer import nbytes

logger = logging.getLogger(__name__)

HELD_BYTES_PER_STEP = 16 << 20  # features of held runs sent per step (beyond the first run)
# ... to a draft service whose buffer they go through (``Drafter.shares_prompts``): a quarter
# of its default 256 MiB, so two lanes' steps fit in it beside new prompts.
SHARED_HELD_BYTES_PER_STEP = 64 << 20
INTAKE_BYTES = 4 << 20  # prompt features per intake message (at least one prompt)
INTAKE_LANE = MAX_LANES  # the submissions that carry new prompts to a draft service


class DraftExchange:
    def __init__(
        self,
        drafter: Drafter,
        spec: SpecConfig,
        requests: dict[str, Request],
        *,
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        self.drafter = drafter
        self.spec = spec
        self._requests = requests  # the engine's, by id
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # Per lane, the submission whose trees are not collected yet: request id -> draft_seq.
        self.awaiting: dict[int, dict[str, int]] = {}
        self.wait_ns = 0  # time in the drafter's submit/collect since the engine reset it
        self.held: dict[str, Held] = {}  # K=0 outcomes not sent yet
        self.unwaited_answers = 0  # answers a K=0 step went ahead of (still being drafted)
        # Waiting for a lane with no answer outstanding (K=0 steps never wait on the draft).
        self._deferred_admits: list[DraftAdmit] = []
        self._deferred_released: list[str] = []
        # Lanes whose outstanding answer drafts over held runs or admits (a catch-up).
        self._catching_up_lanes: set[int] = set()
        self._device_cap: int | None = None  # set when K=0 first holds

    @property
    def held_cap(self) -> int:
        """Bytes of features K=0 holds (runs and admits waiting) before runs go out."""
        return hold.HELD_BYTES if self._device_cap is None else self._device_cap

    @property
    def catching_up(self) -> bool:
        """Whether K=0 left the draft behind: runs or admits (not new prompts waiting for the
        intake lane) still to go out, or an answer to collect that catches up on them."""
        admits = bool(self._deferred_admits) and not self.separate_intake
        return bool(self.held or admits or self._catching_up_lanes)

    def held_tokens(self) -> int:
        """Tokens the draft would take in before its next trees: runs K=0 held and prompts
        waiting (the adaptive policy prices a re-check of speculation by them)."""
        runs = sum(len(h.tokens) for h in self.held.values())
        return runs + sum(len(a.token_ids) for a in self._deferred_admits)

    @property
    def separate_intake(self) -> bool:
        """Whether new prompts go out on the intake lane (see the module docstring)."""
        return self.drafter.remote and not self.drafter.shares_prompts

    def settle_intake(self, *, block: bool) -> None:
        """Takes the intake lane's answer if it is back (``block``: waits for it, when no
        request could step without it), unparking its requests; then sends the next prompts
        waiting, if any."""
        if INTAKE_LANE in self.awaiting and (block or not self.drafter.in_flight(INTAKE_LANE)):
            self.collect(INTAKE_LANE)
        self._send_intake()

    def _send_intake(self) -> None:
        """Sends the oldest admits waiting, up to ``INTAKE_BYTES`` of features (at least one),
        on the intake lane when it has no answer outstanding; a run K=0 held for one of them
        joins its admit."""
        if not self.separate_intake or INTAKE_LANE in self.awaiting or not self._deferred_admits:
            return
        # The admit of a request aborted meanwhile (gone from the engine) never goes out;
        # releases waiting for a lane stay waiting for its next submission.
        gone = [a.request_id for a in self._deferred_admits if a.request_id not in self._requests]
        admits, self._deferred_released = self._take_deferred(
            gone, admits=True, budget=INTAKE_BYTES
        )
        if not admits:
            return
        admits = [
            a.then(self.held.pop(a.request_id).outcome(a.request_id))
            if a.request_id in self.held
            else a
            for a in admits
        ]
        awaiting: dict[str, int] = {}
        for admit in admits:
            req = self._requests[admit.request_id]
            req.draft_seq += 1
            awaiting[admit.request_id] = req.draft_seq
        started = time.perf_counter_ns()
        self.drafter.submit(INTAKE_LANE, admits, [], [])
        self.wait_ns += time.perf_counter_ns() - started
        self.awaiting[INTAKE_LANE] = awaiting

    def collect_moved(self, lane: int) -> None:
        """Collects (waiting if need be) other lanes' answers that hold trees for requests now
        in ``lane`` (the gateway moved them), so a move costs no step its tree."""
        for other, awaiting in list(self.awaiting.items()):
            if other in (lane, INTAKE_LANE):
                continue
            moved = (self._requests.get(request_id) for request_id in awaiting)
            if any(req is not None and req.lane == lane for req in moved):
                self.collect(other)

    def other_lane_in_flight(self, lane: int) -> bool:
        """Whether another lane's trees are being drafted right now."""
        return any(self.drafter.in_flight(other) for other in self.awaiting if other != lane)

    def collect_idle(self, busy: set[int]) -> None:
        """Takes the answers of lanes not in ``busy`` (emptied by moves; every lane in a K=0
        step), without waiting for ones still being drafted."""
        for idle in [n for n in self.awaiting if n not in busy]:
            if not self.drafter.in_flight(idle):
                self.collect(idle)

    def skip(self, running: list[Request], num_lanes: int) -> int | None:
        """Readies a K=0 step of ``running`` without waiting on the draft (answers still
        being drafted go stale). Returns the lane its submission may go out on (one with no
        answer outstanding), None when there is none (nothing is sent then)."""
        self.collect_idle(set())
        self.unwaited_answers += len(self.awaiting)
        for req in running:
            req.tree = None
            req.draft_seq += 1
        return self.free_lane(num_lanes)

    def free_lane(self, num_lanes: int) -> int | None:
        """A lane with no answer outstanding (a submission may go out on it), or None."""
        return next((n for n in range(num_lanes) if n not in self.awaiting), None)

    def flush(self, released: list[str], lane: int) -> None:
        """Collects every outstanding answer; then tells the draft about ``released``."""
        admits, released = self._take_deferred(released, admits=True, budget=float("inf"))
        assert not admits and not self._deferred_admits, "a deferred admit outlived its request"
        for request_id in released:
            self.held.pop(request_id, None)
        for waiting in list(self.awaiting):
            self.collect(waiting)
        if released:
            self.drafter.submit(lane, [], [], released)
            self.drafter.collect(lane)
        self.drafter.poll()

    def submit(
        self,
        lane: int,
        batch: ScheduledBatch,
        inputs: ModelInputs,
        outputs: ModelOutputs,
        verified: list[Verified | None],
        released: list[str],
        *,
        draft: bool = True,
        send: bool = True,
        alone: bool = False,
    ) -> None:
        """Submits the step's outcome to the draft; the trees come at the lane's next step.
        ``released``: requests finished, aborted or preempted since the draft last heard.
        ``draft=False`` (a K=0 step): outcomes are held back (see the module docstring).
        ``send=False``: the lane still awaits an answer, so nothing goes out this step.
        ``alone``: no other lane steps before this lane's answer: a draft service's message
        leaves before the rest of the step's host work (the client's thread would otherwise
        wait for the GIL behind it, every cycle)."""
        self._apply_dropped()
        behind = bool(self.held or self._deferred_admits)  # before this step's outcomes
        admits: list[DraftAdmit] = []
        outcomes: list[VerifyOutcome] = []
        tracked: list[tuple[Request, Verified, list[int]]] = []  # (request, outcome, rows)
        features = outputs.features
        for i, req in enumerate(batch.requests):
            if not req.speculate:
                continue
            if req.finished:
                if req.in_draft:
                    released.append(req.request_id)
                    req.in_draft = False
                continue
            start, v = inputs.token_starts[i], verified[i]
            if not req.in_draft:
                # A prompt chunk: keep its features; once the prompt is done, admit it.
                if features is not None:
                    req.draft_features.append(features[start : start + batch.num_new_tokens[i]])
                if v is not None:
                    admit = self._admit(req)
                    if self._features_complete(admit):
                        admits.append(admit)
                    else:
                        # Features were not captured for the whole prompt (the draft connected
                        # while it was being prefilled): it is taken in later (``readmit``).
                        req.in_draft = req.parked = False
                continue
            assert v is not None, "a request the draft tracks ran without verification"
            tracked.append((req, v, [start + n for n in v.accept_nodes]))
        # One gather for the whole step; each request's features are a view of it.
        flat = [row for _, _, rows in tracked for row in rows]
        gathered = None if features is None or not flat else hold.gather_rows(features, flat)
        if not draft and self._device_cap is None:
            self._device_cap = hold.device_cap(None if features is None else features.device)
        offset = 0
        for req, v, rows in tracked:
            held = self.held.setdefault(req.request_id, Held())
            chunk = None if gathered is None else gathered[offset : offset + len(rows)]
            held.add(v.new_tokens, chunk)
            offset += len(rows)
        for request_id in released:
            self.held.pop(request_id, None)
        # During K=0 admits wait too (their prompt features held here), unless held features
        # pass the cap: then admits and the longest runs go out.
        over = self._held_bytes(admits) > self.held_cap
        self._deferred_admits += admits
        if not send:  # admits and releases wait for a lane with no answer outstanding
            self._deferred_released += released
            self._stale(tracked)
            return
        budget = self._step_bytes(draft)
        # New prompts go on the intake lane when they go separately (after this message: the
        # lane's trees do not wait for them), else with the lane's step.
        with_lane = (draft or over) and not (draft and self.separate_intake)
        admits, released = self._take_deferred(released, admits=with_lane, budget=budget)
        sent_bytes = sum(nbytes(a.features) for a in admits)
        waiting = {a.request_id for a in self._deferred_admits}
        due = [req for req, _, _ in tracked] if draft else self._overflow(tracked)
        for req in due:
            held = self.held[req.request_id]
            # Long held runs go out a few per step: one message stays far below its cap.
            if req.request_id in waiting or (
                (admits or outcomes) and sent_bytes + held.nbytes > budget
            ):
                continue
            outcomes.append(self.held.pop(req.request_id).outcome(req.request_id))
            sent_bytes += held.nbytes
        self._stale(tracked)
        # A run that goes out with its request's admit joins the admit (one update each).
        joining = {a.request_id: i for i, a in enumerate(admits)}
        for outcome in [o for o in outcomes if o.request_id in joining]:
            i = joining[outcome.request_id]
            admits[i] = admits[i].then(outcome)
            outcomes.remove(outcome)
        if not (admits or outcomes or released):
            if draft:
                self._send_intake()
            return  # a K=0 step with nothing to send: the draft does no work
        awaiting: dict[str, int] = {}
        for request_id in [a.request_id for a in admits] + [o.request_id for o in outcomes]:
            if request_id in self.held:
                continue  # an admit whose held run waits: its tree answers an older state
            req = self._requests[request_id]
            req.draft_seq += 1
            awaiting[request_id] = req.draft_seq
        started = time.perf_counter_ns()
        self.drafter.submit(lane, admits, outcomes, released)
        self.wait_ns += time.perf_counter_ns() - started
        self.awaiting[lane] = awaiting
        if draft and behind:
            self._catching_up_lanes.add(lane)
        if draft:
            self._send_intake()
        if alone and draft:
            started = time.perf_counter_ns()
            self.drafter.wait_sent(lane)
            self.wait_ns += time.perf_counter_ns() - started

    def _overflow(self, tracked: list[tuple[Request, Verified, list[int]]]) -> list[Request]:
        """During K=0: the requests whose held runs go out now, longest first, while all held
        features exceed the cap (down to half of it); none below it."""
        total, cap = self._held_bytes([]), self.held_cap
        if total <= cap:
            return []
        due = []
        reqs = sorted((r for r, _, _ in tracked), key=lambda r: -self.held[r.request_id].nbytes)
        for req in reqs:
            if total <= cap // 2:
                break
            due.append(req)
            total -= self.held[req.request_id].nbytes
        return due

    def collect(self, lane: int) -> None:
        """Attaches the trees answering the lane's last submission, where still current."""
        self._catching_up_lanes.discard(lane)
        awaiting = self.awaiting.pop(lane, None)
        if awaiting is None:
            return
        for request_id in awaiting:  # admits taken in (or given up on): they step again
            req = self._requests.get(request_id)
            if req is not None:
                req.parked = False
        started = time.perf_counter_ns()
        trees = self.drafter.collect(lane)
        self.wait_ns += time.perf_counter_ns() - started
        self._apply_dropped()
        for request_id, seq in awaiting.items():
            req = self._requests.get(request_id)
            tree = trees.get(request_id)
            if req is None:
                continue
            if tree is None or not req.in_draft or req.draft_seq != seq:
                # No tree (a late answer, say), or one for a state it has left.
                req.miss = NoTree.LATE if not trees and self.drafter.remote else NoTree.STALE
                continue
            problem = tree.check(
                vocab_size=self.vocab_size,
                max_nodes=self.spec.tree_size,
                verified_token=req.tokens[-1],
            )
            if problem is not None:
                logger.warning("request %s: draft tree rejected (%s)", req.request_id, problem)
                req.miss = NoTree.STALE
                continue
            room = req.length_limit(self.max_model_len) - req.num_computed
            req.tree = tree.prefix(max(1, room))

    def _take_deferred(
        self, released: list[str], *, admits: bool, budget: float
    ) -> tuple[list[DraftAdmit], list[str]]:
        """The waiting releases, and (``admits``) the waiting admits, oldest first, up to
        ``budget`` bytes of features (at least one). An admit of a request released meanwhile
        is never sent, nor is its release (the draft never knew it)."""
        released = [*self._deferred_released, *released]
        self._deferred_released = []
        gone = set(released)
        dropped = {a.request_id for a in self._deferred_admits if a.request_id in gone}
        waiting = [a for a in self._deferred_admits if a.request_id not in gone]
        taken: list[DraftAdmit] = []
        size = 0
        while admits and waiting:
            size += nbytes(waiting[0].features)
            if taken and size > budget:
                break
            taken.append(waiting.pop(0))
        self._deferred_admits = waiting
        return taken, [r for r in released if r not in dropped]

    def _step_bytes(self, draft: bool) -> float:
        """Features sent per step beyond the first update: ``HELD_BYTES_PER_STEP`` over a wire
        (``SHARED_HELD_BYTES_PER_STEP`` through a buffer the draft shares) and for K=0 flushes;
        everything due when an in-process draft is about to draft."""
        if draft and not self.drafter.remote:
            return float("inf")
        return SHARED_HELD_BYTES_PER_STEP if self.drafter.shares_prompts else HELD_BYTES_PER_STEP

    def _held_bytes(self, admits: list[DraftAdmit]) -> int:
        """Features held for the draft: runs, admits waiting, ``admits`` of this step."""
        runs = sum(h.nbytes for h in self.held.values())
        return runs + sum(nbytes(a.features) for a in [*self._deferred_admits, *admits])

    def _stale(self, tracked: list[tuple[Request, Verified, list[int]]]) -> None:
        """Requests still holding decode without a tree until sent: an answer still on its
        way was drafted before their held tokens (a step decoding ahead commits after its K=0
        launch went by, tandem/target/ahead.py)."""
        for req, _, _ in tracked:
            if req.request_id in self.held:
                req.draft_seq += 1

    def _apply_dropped(self) -> None:
        for request_id in self.drafter.take_dropped():
            self.held.pop(request_id, None)
            lost = self._requests.get(request_id)
            if lost is not None and lost.in_draft:
                # Its draft state is gone (and so are its prompt features here): it decodes
                # without trees until it is taken in again (``readmit``).
                logger.info("request %s: dropped by the draft", request_id)
                lost.in_draft = lost.parked = False

    def readmit(self, scheduler: Scheduler) -> None:
        """Takes in again the requests the draft lost, once it is healthy (``readmit.py``).
        Called between steps, with nothing launched."""
        self._apply_dropped()
        readmit_lost(scheduler, self.drafter, self.max_model_len)

    def _features_complete(self, admit: DraftAdmit) -> bool:
        if not self.drafter.target_layer_ids:
            return True
        needed = len(admit.token_ids) - 1
        return admit.features is not None and admit.features.shape[0] == needed

    def _admit(self, req: Request) -> DraftAdmit:
        features = None
        if req.draft_features:
            # Prompt positions only: the verified token's own features are not known yet.
            features = torch.cat(req.draft_features)[: req.num_tokens - 1]
        req.draft_features = []
        req.in_draft = True
        req.parked = self.separate_intake  # until its first trees are back
        return DraftAdmit(
            request_id=req.request_id,
            token_ids=req.tokens,
            features=features,
            spec=self.spec,
            temperature=req.params.temperature,
            trace_context=req.trace_context,
        )
