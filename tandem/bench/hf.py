"""Baselines in the same run: transformers' ``generate`` (greedy) and assisted generation with
a fixed number of assistant tokens (``num_assistant_tokens=S``, constant schedule, confidence
threshold 0: the draft always proposes S tokens).

Per batch size: a warm-up call, a 1-token call (time to first token) and the measured call;
TPOT = (t_measured - t_first) / (new_tokens - 1), the same for every request of the batch.
The accept length of assisted generation is new tokens per target forward (its first forward
runs the prompt and verifies the first candidates), counted by a forward hook. transformers
runs assisted generation at batch size 1 only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tandem.bench.inprocess import Workload, fill_latency
from tandem.bench.report import Row
from tandem.config import torch_dtype


def load(path: Path, dtype: str, device: str) -> Any:
    import importlib.util

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # a benchmark's output is its table
    hf_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if importlib.util.find_spec("accelerate") is not None:
        kwargs["device_map"] = device  # load straight onto the device
    model: Any = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to(device).eval()


def _left_padded(batch: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids [bs, longest] left-padded with 0 and their attention mask (real prompts differ in
    length)."""
    longest = max(len(p) for p in batch)
    ids = [[0] * (longest - len(p)) + p for p in batch]
    mask = [[0] * (longest - len(p)) + [1] * len(p) for p in batch]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _timed(
    model: Any,
    batch: tuple[torch.Tensor, torch.Tensor],  # ids, attention mask
    new_tokens: int,
    assistant: Any,
    assist: dict[str, Any],
) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # no early EOS: every request makes new_tokens
        do_sample=False,
        pad_token_id=0,
        **assist,
    )
    ids, mask = batch
    device = str(ids.device)
    _sync(device)
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=mask,
        generation_config=config,
        assistant_model=assistant,
    )
    _sync(device)
    return time.perf_counter() - start


def run(
    model: Any,
    batch_size: int,
    w: Workload,
    *,
    assistant: Any | None = None,
    num_assistant_tokens: int = 3,
) -> Row:
    """``generate`` (or, with ``assistant``, assisted generation) at ``batch_size``."""
    mode = "hf-generate" if assistant is None else "hf-assisted"
    vocab = model.config.vocab_size
    device = str(model.device)
    assist: dict[str, Any] = {}
    if assistant is not None:
        assist = {
            "num_assistant_tokens": num_assistant_tokens,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,
        }
    forwards = [0]
    hook = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        if w.warmup_tokens:
            batch = _left_padded(w.batch(vocab, batch_size, 99), device)
            _timed(model, batch, w.warmup_tokens, assistant, assist)
        row = Row(mode=mode, batch_size=batch_size)
        tpots: list[float] = []
        ttfts: list[float] = []
        forwards_total = 0
        for r in range(w.rounds):
            batch = _left_padded(w.batch(vocab, batch_size, r), device)
            # The fastest of three: a stall in the one-token run alone would read as a
            # shorter (even negative) TPOT below.
            first = min(_timed(model, batch, 1, assistant, assist) for _ in range(3))
            forwards[0] = 0
            total = _timed(model, batch, w.new_tokens, assistant, assist)
            forwards_total += forwards[0]
            row.duration_s += total
            row.output_tokens += batch_size * w.new_tokens
            ttfts += [first * 1e3] * batch_size
            if w.new_tokens > 1:
                tpots += [(total - first) * 1e3 / (w.new_tokens - 1)] * batch_size
    finally:
        hook.remove()
    row.num_requests = batch_size * w.rounds
    row.tokens_per_s = row.output_tokens / row.duration_s
    fill_latency(row, tpots, ttfts)
    if assistant is not None and forwards_total:
        # Tokens per target forward; the first forward verifies too (prefill + candidates).
        row.accept_length = w.new_tokens * w.rounds / forwards_total
    return row
