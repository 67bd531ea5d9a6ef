"""Decoding ahead: the overlap inside a service (docs/design.md section 5).

In steady plain decoding (target-only, or the adaptive policy's K=0 steps) every request
commits exactly one token per step, and that token is the next step's input. So the host
launches step r+1 with its input ids taken on the device from step r's choices, and reads step
r only then: the GPU runs the steps back to back while the host stages the next one, commits
the last one and talks to clients. Nothing is read between a step's forward and the next
launch but the copy of the choices into pinned memory, which the host waits for after the next
launch.

What the host knows one step late, and how it stays exact:

- A request's KV progress (``num_computed``) advances at launch; its token is appended at the
  read. In between ``num_computed == num_tokens``.
- A request that will finish at step r by length (``max_new_tokens``, the context) is known at
  launch of r+1 and left out of it. One that stops on a token (EOS, a stop id) is only known at
  the read: its row of step r+1 is computed and dropped (its KV went to pages freed with it,
  written before any later step can reuse them: one stream orders them).
- A request aborted while its step is in flight is skipped at the read.

Decoding ahead covers rows with plain parameters (``SamplingParams.plain``): greedy ones take
``top1`` on the device; sampled ones (temperature, top-k, top-p, min-p) the exponential race
over their processed distribution, from their own generator drawn on the stream at launch in
the blocks the ordinary step draws (``coin_block`` coins, unused by a tree of one node, then
one Exp(1) vector), so a seeded request's tokens do not depend on the path. Anything else (a
waiting request, a prompt chunk, penalties, a speculative step, a full pool) first reads the
step in flight, then runs the ordinary synchronous step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.request import Request
from tandem.sampling import SamplingBatch, process_logits
from tandem.spec.types import NoTree
from tandem.spec.verify import Verified, decode_greedy, draw_randomness
from tandem.target.runner import ModelInputs, ModelOutputs
from tandem.target.scheduler import ScheduledBatch, Scheduler


@dataclass
class InFlight:
    """A launched plain decode step whose choices the host has not read yet."""

    batch: ScheduledBatch  # one token per request
    inputs: ModelInputs
    outputs: ModelOutputs
    ids: torch.Tensor  # [bs] int64 on the device: each row's choice (the next input)
    host_ids: torch.Tensor  # [bs] their copy on the host (pinned on CUDA)
    host_logprobs: torch.Tensor  # [bs] float32, each choice's log-probability
    copied: torch.cuda.Event | None  # recorded after the copies (None off CUDA)
    plain: NoTree = NoTree.POLICY  # why it decodes plainly (its steps' counters)

    def read(self) -> list[Verified | None]:
        """Waits for this step's choices (not for anything launched after it); each row's
        outcome, None where the request finished or was aborted meanwhile."""
        if self.copied is not None:
            self.copied.synchronize()
        ids, lps = self.host_ids.tolist(), self.host_logprobs.tolist()
        return [
            None if req.finished else Verified(accept_nodes=[0], new_tokens=[t], logprobs=[lp])
            for req, t, lp in zip(self.batch.requests, ids, lps, strict=True)
        ]


def launch(
    batch: ScheduledBatch, inputs: ModelInputs, outputs: ModelOutputs, coin_block: int = 1
) -> InFlight:
    """Chooses each row's token on the device after a launched forward and queues the copy of
    the choices to the host; the step is then in flight. ``coin_block``: the coins a sampled
    row's ordinary step draws (the engine's tree size)."""
    if all(req.params.greedy for req in batch.requests):
        ids, logprobs = decode_greedy(outputs.logits)
    else:
        ids, logprobs = _sample(outputs.logits, batch.requests, coin_block)
    on_cuda = ids.device.type == "cuda"
    step = InFlight(
        batch=batch,
        inputs=inputs,
        outputs=outputs,
        ids=ids,
        host_ids=torch.empty(len(batch), dtype=torch.int64, pin_memory=on_cuda),
        host_logprobs=torch.empty(len(batch), dtype=torch.float32, pin_memory=on_cuda),
        copied=torch.cuda.Event() if on_cuda else None,
    )
    step.host_ids.copy_(ids, non_blocking=on_cuda)
    step.host_logprobs.copy_(logprobs, non_blocking=on_cuda)
    if step.copied is not None:
        step.copied.record()
    return step


def _sample(
    logits: torch.Tensor,  # [bs, V]
    reqs: list[Request],
    coin_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [bs] int64 choices, [bs] float32 log-probabilities
    """Each row's token as ``tandem.spec.verify`` commits a tree of one node: greedy rows
    the target's choice, sampled rows the race ``argmax(p / E)`` with E ~ Exp(1) from the
    request's generator."""
    device = logits.device
    params = [req.params for req in reqs]
    generators = [req.generator for req in reqs]
    batch = SamplingBatch.build(params, generators, device)
    processed = process_logits(logits, batch, None)
    choice, top_logprobs = decode_greedy(processed)
    coins = torch.empty(len(reqs), coin_block, device=device)  # unused by one node
    noise = torch.ones_like(processed)
    draw_randomness(generators, coins, noise)  # greedy requests have no generator
    probs = processed.softmax(dim=-1)
    race = torch.where(probs > 0, probs / noise, -1.0).argmax(dim=-1)
    sampled = batch.temperature > 0  # greedy rows have temperature 0
    ids = torch.where(sampled, race, choice)
    picked = processed.gather(1, ids[:, None])[:, 0] - torch.logsumexp(processed, dim=-1)
    return ids, torch.where(sampled, picked, top_logprobs)


def eligible(req: Request) -> bool:
    """Whether ``req`` may decode ahead: plain parameters (greedy or sampled), no tree."""
    return req.tree is None and req.params.plain


def finishes_by_length(req: Request, max_model_len: int) -> bool:
    """Whether the token in flight for ``req`` (not appended yet) ends it by length."""
    outputs = len(req.output_ids) + 1
    return outputs >= req.params.max_new_tokens or req.num_tokens + 1 >= max_model_len


def next_requests(
    scheduler: Scheduler,
    flight: InFlight | None,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> list[Request] | None:
    """The requests of the next step if it may decode ahead (their next KV slot reserved),
    else None: every running request decodes with plain parameters without a tree, nobody
    waits to be admitted, and a step in flight holds every running request."""
    running = scheduler.running
    if scheduler.waiting and len(running) < max_num_seqs:
        return None
    if not running or not all(eligible(req) for req in running):
        return None
    if flight is None:
        reqs = list(running) if all(req.decoding for req in running) else []
    else:
        launched = set(flight.batch.requests)
        if any(req not in launched for req in running):
            return None
        reqs = [
            req
            for req in flight.batch.requests
            if not req.finished and not finishes_by_length(req, max_model_len)
        ]
    if not reqs or len(reqs) > max_num_batched_tokens:
        return None
    alloc = scheduler.allocator
    for req in reqs:  # never preempts: a full pool takes the ordinary step
        need = req.num_computed + 1 - alloc.num_tokens(req.request_id)
        if need > 0 and not alloc.can_extend(req.request_id, need):
            return None
        if need > 0:
            alloc.extend(req.request_id, need)
    return reqs
