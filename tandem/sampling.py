"""Logits processing and token sampling, shared by the engine and the speculative verifier.

`process_logits` turns raw logits into the distribution a request samples from, in transformers'
`generate` order: logit bias -> repetition penalty -> presence and frequency penalties ->
min_tokens -> temperature -> top-k -> top-p -> min-p, matching HF's processors value for value and
mask for mask (`sequence_bias` with one-token sequences, `min_new_tokens`; presence and frequency
as vLLM and OpenAI define them, over the generated tokens only). The verifier takes its target
probabilities from the same function (`probs_from_logits`), so speculative sampling preserves
exactly the distribution that target-only sampling draws from (FlashInfer's verify path forgot
min-p, SGLang #10617).

Sampling never waits on the host: per-row parameters are device tensors built once per batch
composition (`SamplingBatch.build`), the flags that skip unused processors are plain Python values
fixed at build time, and tokens come from the exponential race argmax(p / E), E ~ Exp(1), instead
of `torch.multinomial`. Each sampled row draws E from its own generator, so a seed gives the same
token stream whatever else is in the batch and in whichever row.

Known limitation: top-p sorts the whole vocabulary and top-k runs `torch.topk` up to the batch's
largest k, one launch per processor; the fused Triton sampler (kernels.md section 5) lifts this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import torch

import kernels
from tandem.errors import InvalidRequest
from tandem.penalties import apply_counts_penalty, apply_repetition_penalty
from tandem.transfer import to_device

_NEG_INF = float("-inf")
_MAX_SEED = 2**63
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (OpenAI takes 300)
MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's and vLLM's default bound)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InvalidRequest(name, f"must be a number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise InvalidRequest(name, f"must be finite, got {result}")
    return result


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise InvalidRequest(name, f"must be an integer, got {type(value).__name__}")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens; validated on construction.

    Numbers are normalised to Python `float`/`int` and `stop_token_ids` to a tuple, so equal
    requests compare and hash equal.
    """

    temperature: float = 0.0  # 0 = greedy (argmax after the repetition penalty)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # (0, 1]; 1 = off
    min_p: float = 0.0  # [0, 1); 0 = off
    repetition_penalty: float = 1.0  # > 0; HF semantics over prompt + generated tokens
    seed: int | None = None  # per-request random stream; None = the engine picks one
    max_new_tokens: int = 128  # >= 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2]: minus this on every token generated so far
    frequency_penalty: float = 0.0  # [-2, 2]: minus this per occurrence in the generated tokens
    min_tokens: int = 0  # EOS and the stop tokens are masked until this many are generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100])
    top_logprobs: int = 0  # the most likely tokens reported per position, [0, MAX_TOP_LOGPROBS]

    def __post_init__(self) -> None:
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0 (0 = greedy), got {temperature}")
        top_k = _integer("top_k", self.top_k)
        if top_k < 0:
            raise InvalidRequest("top_k", f"must be >= 0 (0 = off), got {top_k}")
        top_p = _real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {top_p}")
        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p < 1.0:
            raise InvalidRequest("min_p", f"must be in [0, 1), got {min_p}")
        penalty = _real("repetition_penalty", self.repetition_penalty)
        if not penalty > 0.0:
            raise InvalidRequest("repetition_penalty", f"must be > 0, got {penalty}")
        seed = None if self.seed is None else _integer("seed", self.seed)
        if seed is not None and not 0 <= seed < _MAX_SEED:
            raise InvalidRequest("seed", f"must be in [0, 2**63), got {seed}")
        max_new_tokens = _integer("max_new_tokens", self.max_new_tokens)
        if max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
        if not isinstance(self.stop_token_ids, tuple | list):
            raise InvalidRequest("stop_token_ids", "must be a sequence of token ids")
        stop_token_ids = tuple(_integer("stop_token_ids", t) for t in self.stop_token_ids)
        if any(t < 0 for t in stop_token_ids):
            raise InvalidRequest("stop_token_ids", f"ids must be >= 0, got {stop_token_ids}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest("ignore_eos", f"must be a bool, got {type(self.ignore_eos)}")
        presence = _real("presence_penalty", self.presence_penalty)
        frequency = _real("frequency_penalty", self.frequency_penalty)
        for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
            if not -2.0 <= value <= 2.0:
                raise InvalidRequest(name, f"must be in [-2, 2], got {value}")
        min_tokens = _integer("min_tokens", self.min_tokens)
        if not 0 <= min_tokens <= max_new_tokens:
            raise InvalidRequest("min_tokens", f"must be in [0, max_new_tokens], got {min_tokens}")
        logit_bias = _logit_bias(self.logit_bias)
        top_logprobs = _integer("top_logprobs", self.top_logprobs)
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        normalised = {
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
            "repetition_penalty": penalty,
            "seed": seed,
            "max_new_tokens": max_new_tokens,
            "stop_token_ids": stop_token_ids,
            "presence_penalty": presence,
            "frequency_penalty": frequency,
            "min_tokens": min_tokens,
            "logit_bias": logit_bias,
            "top_logprobs": top_logprobs,
        }
        for name, normal in normalised.items():
            object.__setattr__(self, name, normal)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """A processor reads the tokens so far (the repetition, presence or frequency penalty)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def plain(self) -> bool:
        """No processor that reads the tokens so far, no bias, no ``min_tokens``, no
        alternatives asked: each node's distribution is the logits' with this request's
        temperature and filters (what device-chain steps verify)."""
        return not (self.uses_history or self.min_tokens or self.logit_bias or self.top_logprobs)

    @property
    def plain_greedy(self) -> bool:
        """Greedy and ``plain``: the raw logits' argmax is all a step needs (the path that
        decodes ahead takes only these)."""
        return self.greedy and self.plain


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs, ids unique and >= 0 (below the vocabulary: the engine checks), biases
    finite in [-100, 100], at most ``MAX_LOGIT_BIAS``; sorted by id."""
    if isinstance(value, dict):
        value = tuple(value.items())
    if not isinstance(value, tuple | list):
        raise InvalidRequest("logit_bias", "must be (token id, bias) pairs")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    pairs: dict[int, float] = {}
    for entry in value:
        if not isinstance(entry, tuple | list) or len(entry) != 2:
            raise InvalidRequest("logit_bias", "must be (token id, bias) pairs")
        token, bias = _integer("logit_bias", entry[0]), _real("logit_bias", entry[1])
        if token < 0 or token in pairs:
            raise InvalidRequest("logit_bias", f"ids must be >= 0 and unique, got {token}")
        if not -100.0 <= bias <= 100.0:
            raise InvalidRequest("logit_bias", f"biases must be in [-100, 100], got {bias}")
        pairs[token] = bias
    return tuple(sorted(pairs.items()))


@dataclass(kw_only=True)
class SamplingBatch:
    """Per-row sampling state for one step, built once per batch composition.

    Tensors live on the logits' device. Greedy rows carry neutral filters (top_k 0, top_p 1,
    min_p 0) and no generator: they only take the repetition penalty, so their argmax is HF's
    greedy choice.
    """

    temperature: torch.Tensor  # [bs] float32; 0 = greedy row
    top_k: torch.Tensor  # [bs] int64; 0 = off
    top_p: torch.Tensor  # [bs] float32
    # 1 - top_p subtracted in float64 and rounded once, as HF's threshold; -1 where top-p is off.
    top_p_cutoff: torch.Tensor  # [bs] float32
    min_p: torch.Tensor  # [bs] float32
    repetition_penalty: torch.Tensor  # [bs] float32
    presence_penalty: torch.Tensor  # [bs] float32
    frequency_penalty: torch.Tensor  # [bs] float32
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, ids [E] int64, values [E] f32
    blocked: tuple[torch.Tensor, torch.Tensor]  # rows, ids [M] int64: masked (min_tokens)
    generators: list[torch.Generator | None]  # None for greedy rows
    # Fixed at build time, so the hot path skips unused processors without a host sync.
    all_greedy: bool
    any_top_k: bool
    max_top_k: int  # the largest top_k of the batch: torch.topk's k
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    any_counts: bool  # a presence or frequency penalty
    any_bias: bool
    any_blocked: bool

    @property
    def uses_history(self) -> bool:
        """`process_logits` needs the rows' token ids (and prompt lengths, for `any_counts`)."""
        return self.any_penalty or self.any_counts

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        blocked: Sequence[Sequence[int]] = (),
    ) -> SamplingBatch:
        """One row per request; `generators[i]` is row i's stream (ignored for greedy rows);
        `blocked[i]`, where given, the ids row i may not take this step (its EOS and stop tokens
        while it has fewer than `min_tokens`)."""
        if len(params) != len(generators):
            raise ValueError(f"{len(params)} params but {len(generators)} generators")
        if blocked and len(blocked) != len(params):
            raise ValueError(f"{len(params)} params but {len(blocked)} blocked rows")
        for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
            if not p.greedy and generator is None:
                raise ValueError(f"row {row} samples (temperature > 0) but has no generator")
        greedy = [p.greedy for p in params]
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy, strict=True)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        penalty = [p.repetition_penalty for p in params]

        bias = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
        block = [(row, t) for row, ids in enumerate(blocked) for t in ids]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        cutoff = [1.0 - p if p < 1.0 else -1.0 for p in top_p]
        # Two copies from pinned memory behind the stream (``to_device``), sliced on the
        # device: one from pageable memory per tensor waited for the step decoding ahead.
        bs, e, m = len(params), len(bias), len(block)
        rows = [[p.temperature for p in params], top_p, cutoff, min_p, penalty, presence, frequency]
        float_values = [v for row in rows for v in row] + [b for *_, b in bias]
        int_values = [*top_k, *(r for r, _, _ in bias), *(t for _, t, _ in bias)]
        int_values += [*(r for r, _ in block), *(t for _, t in block)]
        floats = to_device(torch.tensor(float_values, dtype=torch.float32), device)
        ints = to_device(torch.tensor(int_values, dtype=torch.int64), device)
        f = floats[: len(rows) * bs].view(len(rows), bs)
        i = ints[bs:].split([e, e, m, m])
        return cls(
            temperature=f[0],
            top_k=ints[:bs],
            top_p=f[1],
            top_p_cutoff=f[2],
            min_p=f[3],
            repetition_penalty=f[4],
            presence_penalty=f[5],
            frequency_penalty=f[6],
            bias=(i[0], i[1], floats[len(rows) * bs :]),
            blocked=(i[2], i[3]),
            generators=[None if g else gen for g, gen in zip(greedy, generators, strict=True)],
            all_greedy=all(greedy),
            any_top_k=any(k > 0 for k in top_k),
            max_top_k=max(top_k, default=0),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(p > 0.0 for p in min_p),
            any_penalty=any(p != 1.0 for p in penalty),
            any_counts=any(presence) or any(frequency),
            any_bias=bool(bias),
            any_blocked=bool(block),
        )


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`: one request's random stream."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _apply_top_k(
    logits: torch.Tensor,  # [bs, V] float32
    top_k: torch.Tensor,  # [bs] int64, 0 = off
    max_top_k: int,
) -> torch.Tensor:  # [bs, V] float32
    # As HF: drop what is below the k-th largest value, so ties with it are all kept.
    k = min(max_top_k, logits.shape[-1])
    top_values = torch.topk(logits, k, dim=-1).values  # [bs, k], descending
    kth = top_values.gather(-1, (top_k.clamp(min=1, max=k) - 1)[:, None])  # [bs, 1]
    kth = torch.where(top_k[:, None] > 0, kth, _NEG_INF)  # [bs, 1]
    return logits.masked_fill(logits < kth, _NEG_INF)


def _apply_top_p(
    logits: torch.Tensor,  # [bs, V] float32
    cutoff: torch.Tensor,  # [bs] float32, 1 - top_p; -1 = off
) -> torch.Tensor:  # [bs, V] float32
    # HF's exact recipe (ascending sort, cumulative sum from the least likely token) so that the
    # rounding and the order among tied logits, hence the kept set, are the same.
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1)  # [bs, V] ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [bs, V]
    remove = cumulative <= cutoff[:, None]  # [bs, V]
    remove[:, -1] = False  # the most likely token always stays (min_tokens_to_keep = 1)
    remove = remove.scatter(-1, sorted_ids, remove)  # [bs, V] back in vocabulary order
    return logits.masked_fill(remove, _NEG_INF)


def _apply_min_p(
    logits: torch.Tensor,  # [bs, V] float32
    min_p: torch.Tensor,  # [bs] float32, 0 = off
) -> torch.Tensor:  # [bs, V] float32
    # Relative to the top probability after temperature, as HF; the top token is never below it.
    probs = logits.softmax(dim=-1)  # [bs, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [bs, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def process_logits(
    logits: torch.Tensor,  # [bs, V] any float dtype
    batch: SamplingBatch,
    token_ids: torch.Tensor | None,  # [bs, T] int64 padded with -1; needed if uses_history
    prompt_lens: torch.Tensor | None = None,  # [bs] int64; needed if any_counts
) -> torch.Tensor:  # [bs, V] float32, filtered entries -inf
    """Bias -> penalties -> min_tokens -> temperature -> top-k -> top-p -> min-p, in HF
    `generate`'s order.

    Greedy rows get the bias, the penalties and min_tokens only. The result is `logits` itself
    when it is float32 and no processor applies: do not modify it in place.
    """
    x = logits.float()  # [bs, V]
    if batch.any_bias:
        rows, ids, values = batch.bias
        x = x.index_put((rows, ids), values, accumulate=True)  # a copy: logits stay as they are
    if batch.uses_history:
        if token_ids is None:
            raise ValueError("token_ids is required when a row has a penalty")
        if batch.any_penalty:
            x = apply_repetition_penalty(x, token_ids, batch.repetition_penalty)
        if batch.any_counts:
            if prompt_lens is None:
                raise ValueError("prompt_lens is required for presence and frequency penalties")
            x = apply_counts_penalty(
                x, token_ids, prompt_lens, batch.presence_penalty, batch.frequency_penalty
            )
    if batch.any_blocked:
        rows, ids = batch.blocked
        x = x.index_put((rows, ids), torch.tensor(_NEG_INF, device=x.device))
    if not batch.all_greedy:
        # Greedy rows divide by 1 (exact), so their values stay penalised logits.
        divisor = torch.where(batch.temperature > 0, batch.temperature, 1.0)  # [bs]
        x = x / divisor[:, None]
    if batch.any_top_k:
        x = _apply_top_k(x, batch.top_k, batch.max_top_k)
    if batch.any_top_p:
        x = _apply_top_p(x, batch.top_p_cutoff)
    if batch.any_min_p:
        x = _apply_min_p(x, batch.min_p)
    return x


def probs_from_logits(
    logits: torch.Tensor,  # [bs, V] any float dtype
    batch: SamplingBatch,
    token_ids: torch.Tensor | None,  # [bs, T] int64 padded with -1; needed if uses_history
    prompt_lens: torch.Tensor | None = None,  # [bs] int64; needed if any_counts
) -> torch.Tensor:  # [bs, V] float32, rows sum to 1, filtered entries 0
    """The distribution each row samples from: softmax of `process_logits`.

    Greedy rows get the softmax of their penalised logits (temperature 1); a greedy verifier
    takes their argmax instead. Rows `invalid_rows` flags come out NaN.
    """
    return process_logits(logits, batch, token_ids, prompt_lens).softmax(dim=-1)


def _exponential_noise(
    generators: list[torch.Generator | None],
    like: torch.Tensor,  # [bs, V] float32
) -> torch.Tensor:  # [bs, V] float32, Exp(1) for sampled rows, 1 for greedy rows
    noise = torch.ones_like(like)  # [bs, V]
    # One draw of V values per row from the row's own generator: the stream depends on the
    # seed and the step only, not on the batch. The only Python loop, over rows.
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # A draw of exactly 0 would make p / E inf (or NaN for p = 0) and win the argmax.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def sample(
    logits: torch.Tensor,  # [bs, V] any float dtype
    batch: SamplingBatch,
    token_ids: torch.Tensor | None,  # [bs, T] int64 padded with -1; needed if uses_history
    prompt_lens: torch.Tensor | None = None,  # [bs] int64; needed if any_counts
) -> torch.Tensor:  # [bs] int64
    """The next token of every row, without a host sync.

    Greedy rows take the argmax of their processed logits (the lowest id among ties). Sampled rows
    take argmax(p / E) with E ~ Exp(1) from the row's generator: P(v) = p(v), and a filtered
    token (p = 0) is never drawn.

    Broken rows never raise and always give an id in [0, V): a row of all -inf or all NaN logits
    gives 0, as does a sampled row with any NaN or +inf (its softmax is all NaN); a greedy row
    with a NaN gives its first NaN's id (torch's argmax ranks NaN highest). The engine finds such
    rows with `invalid_rows` and fails them.
    """
    processed = process_logits(logits, batch, token_ids, prompt_lens)  # [bs, V]
    if batch.all_greedy:
        return processed.argmax(dim=-1)
    noise = _exponential_noise(batch.generators, processed)  # [bs, V]
    # The race and the greedy rows' argmax: one fused kernel on CUDA (kernels/sample.py).
    return kernels.ops(processed.device).sample(processed, batch.temperature, noise)


def invalid_rows(logits: torch.Tensor) -> torch.Tensor:  # [bs, V] -> [bs] bool
    """Rows that cannot be sampled: a NaN or +inf logit, or no logit above -inf."""
    bad_value = (logits.isnan() | logits.isposinf()).any(dim=-1)  # [bs]
    return bad_value | (logits.amax(dim=-1) == _NEG_INF)
