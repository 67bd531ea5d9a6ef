"""What K=0 steps hold back for the draft (``tandem.target.exchange``): each request's committed
steps merged (``Held``), and how many bytes of features all holds may take before runs go out.

The features stay on the device (for a draft service too, until they are sent), up to an
eighth of its memory free when K=0 first holds (``device_cap``), between ``HELD_BYTES`` and
``HELD_MAX_BYTES``. Read at call time, so tests may lower them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.spec.types import VerifyOutcome
from tandem.transfer import device_ints, nbytes

HELD_BYTES = 256 << 20  # features K=0 holds (all requests) at least, before runs go out
HELD_MAX_BYTES = 4 << 30  # at most (and at most 1/8 of free device memory)


def device_cap(device: torch.device | None) -> int:
    """An eighth of ``device``'s free memory, between ``HELD_BYTES`` and
    ``HELD_MAX_BYTES`` (``HELD_BYTES`` off CUDA, where the pools are host memory)."""
    if device is None or device.type != "cuda":
        return HELD_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return max(HELD_BYTES, min(HELD_MAX_BYTES, free // 8))


@dataclass
class Held:
    """A request's committed steps not sent to the draft yet: each step's bonus token is the
    next step's node 0, so tokens and features ([accepted + 1, F] per step) concatenate."""

    tokens: list[int] = field(default_factory=list)  # accepted drafts and bonus, step by step
    chunks: list[torch.Tensor] = field(default_factory=list)  # per step [accepted + 1, F]
    nbytes: int = 0  # of the chunks

    def add(self, tokens: list[int], chunk: torch.Tensor | None) -> None:
        self.tokens += tokens
        if chunk is not None:
            self.chunks.append(chunk)
        self.nbytes += nbytes(chunk)

    def outcome(self, request_id: str) -> VerifyOutcome:
        features = None
        chunks = self.chunks
        if chunks:
            features = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        return VerifyOutcome(
            request_id=request_id,
            accepted_token_ids=self.tokens[:-1],
            bonus_token_id=self.tokens[-1],
            features=features,
        )


def gather_rows(features: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``features[rows]`` ([len(rows), F]) without a host synchronisation: a run of rows is a view
    (plain decoding: every row in order), other rows go through an index in pinned memory (an index
    from pageable memory would wait for the step decoding ahead, tandem/target/ahead.py)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return features[rows[0] : rows[0] + len(rows)]
    return features[device_ints(rows, features.device)]
