"""The in-process target-only engine: schedule -> run -> postprocess, one step at a time.

The target service wraps this loop on its own thread; ``tandem generate`` drives it directly.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.config import EngineConfig
from tandem.errors import InvalidRequest
from tandem.kv import KVCache, KVCacheSpec
from tandem.models import DecoderLM, load_model
from tandem.request import FinishReason, Request, RequestOutput
from tandem.runner import ModelRunner
from tandem.sampling import SamplingParams, make_generator
from tandem.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Without a size, a CPU pool gets this budget (capped by what max_num_seqs full contexts need).
_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    finish_reason: FinishReason
    num_preemptions: int


class Engine:
    """Batches ragged requests through prefill (chunked) and decode on one model."""

    def __init__(self, config: EngineConfig, model: DecoderLM | None = None) -> None:
        self.config = config
        if model is None:
            model = load_model(config.model, dtype=config.torch_dtype, device=config.device)
        self.model = model
        mc = model.config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        spec = KVCacheSpec(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            page_size=config.page_size,
            dtype=config.torch_dtype,
            device=config.device,
        )
        self.kv = KVCache(spec, self._num_pages(spec))
        logger.info(
            "KV pool: %d pages of %d tokens (%.1f MiB)",
            self.kv.allocator.num_pages,
            config.page_size,
            spec.bytes_per_page * (self.kv.allocator.num_pages + 1) / 2**20,
        )
        self.runner = ModelRunner(model, self.kv)
        self.scheduler = Scheduler(
            self.kv.allocator,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=mc.eos_token_ids,
        )
        self._requests: dict[str, Request] = {}
        self._next_id = 0

    def _num_pages(self, spec: KVCacheSpec) -> int:
        c = self.config
        full = c.max_num_seqs * -(-self.max_model_len // c.page_size)
        if c.num_pages is not None:
            return c.num_pages
        if c.kv_cache_bytes is not None:
            return spec.pages_for_budget(c.kv_cache_bytes)
        if c.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(c.device))
            budget = int(free * c.gpu_memory_utilization)
        else:
            budget = _CPU_KV_BYTES
        return max(1, min(full, spec.pages_for_budget(budget)))

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise InvalidRequest("prompt_ids", "empty prompt")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest("prompt_ids", f"ids must be in [0, {vocab})")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self._requests:
            raise InvalidRequest("request_id", f"{request_id!r} is already in use")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            generator = make_generator(seed, self.config.device)
        req = Request(
            request_id=request_id, prompt_ids=list(prompt_ids), params=params, generator=generator
        )
        self.scheduler.add(req)
        self._requests[request_id] = req
        return request_id

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled = self.runner.run(batch)
        return self.scheduler.postprocess(batch, sampled)

    def pop_finished(self, request_id: str) -> GenerationResult:
        req = self._requests.pop(request_id)
        assert req.finish_reason is not None, "pop_finished on a running request"
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason,
            num_preemptions=req.num_preemptions,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        progress: Callable[[int], None] | None = None,
    ) -> list[GenerationResult]:
        """Runs prompts to completion; ``progress(num_new_tokens)`` is called after each step."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise InvalidRequest("params", "one SamplingParams per prompt expected")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, per_prompt, strict=True):
                ids.append(self.add_request(prompt, sp))
        except InvalidRequest:
            for request_id in ids:  # all or nothing
                self.abort(request_id)
                self._requests.pop(request_id)
            raise
        while self.has_unfinished():
            outputs = self.step()
            if progress is not None:
                progress(sum(len(o.new_token_ids) for o in outputs))
        return [self.pop_finished(i) for i in ids]
