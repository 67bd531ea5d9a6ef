"""Paged KV pool shared by the target and the draft services (docs/design.md section 4).

A pool is a fixed number of pages of ``page_size`` token slots each. ``PageAllocator`` does the
bookkeeping (free list, request -> page table, slot mapping); ``KVCache`` adds the per-layer K/V
tensors. Page 0 is the null page: it is never handed out, so padded page-table entries and
padding writes (CUDA-graph batch buckets) can point at it without touching live data.

A request's capacity is the number of token slots it holds; it always owns exactly
``ceil(capacity / page_size)`` pages. Speculation reserves slots with ``extend`` and gives back
the unaccepted ones with ``truncate``; retraction and completion call ``free``.

Argument errors raise plain ``ValueError``: callers are the services' own engines, so a bad
argument is a bug (INTERNAL), not a client's fault (INVALID_ARGUMENT). Nothing here is
thread-safe; each pool belongs to one engine thread.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from tandem.errors import KVExhausted, NotFound
from tandem.transfer import to_device

NULL_PAGE = 0


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Geometry of one model's KV pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    dtype: torch.dtype
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype: must be a torch.dtype, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: not a torch device: {self.device!r}") from exc

    @cached_property
    def bytes_per_page(self) -> int:
        """Bytes of K and V for one page across all layers."""
        per_layer = self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return 2 * self.num_layers * per_layer

    def pages_for_budget(self, num_bytes: int) -> int:
        """Usable pages that fit in ``num_bytes``, the reserved null page included in the cost."""
        num_pages = num_bytes // self.bytes_per_page - 1
        if num_pages < 1:
            raise ValueError(
                f"num_bytes: {num_bytes} bytes hold no usable page "
                f"(need {2 * self.bytes_per_page} for one page plus the null page)"
            )
        return num_pages


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")


class PageAllocator:
    """Bookkeeping only: which request owns which pages. Usable pages are 1..num_pages.

    The free list is a min-heap, so pages are handed out lowest id first (deterministic, and a
    lightly used pool stays compact). Every operation costs O(pages touched * log num_pages).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Ascending ids already satisfy the heap invariant.
        self._free: list[int] = list(range(1, num_pages + 1))
        self._pages: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def _pages_of(self, req_id: str) -> list[int]:
        try:
            return self._pages[req_id]
        except KeyError:
            raise NotFound(f"request {req_id!r} has no KV pages") from None

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_needed(self, req_id: str | None, num_tokens: int) -> int:
        """Extra pages to hold ``num_tokens`` more tokens for ``req_id`` (None: a new request)."""
        _check_count("num_tokens", num_tokens)
        if req_id is None:
            return self._pages_for(num_tokens)
        owned = len(self._pages_of(req_id))
        return max(0, self._pages_for(self._num_tokens[req_id] + num_tokens) - owned)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_needed(None, num_tokens) <= len(self._free)

    def can_extend(self, req_id: str, num_tokens: int) -> bool:
        return self.pages_needed(req_id, num_tokens) <= len(self._free)

    def _take(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise KVExhausted(
                f"need {num_pages} KV pages, {len(self._free)} of {self.num_pages} free"
            )
        return [heapq.heappop(self._free) for _ in range(num_pages)]

    def _give_back(self, pages: Sequence[int]) -> None:
        for page in pages:
            assert page != NULL_PAGE, "null page in a request's page list"
            heapq.heappush(self._free, page)

    def allocate(self, req_id: str, num_tokens: int) -> None:
        """Register a new request with capacity ``num_tokens`` (may be 0)."""
        if req_id in self._pages:
            raise ValueError(f"req_id: {req_id!r} already holds KV pages")
        pages = self._take(self.pages_needed(None, num_tokens))
        self._pages[req_id] = pages
        self._num_tokens[req_id] = num_tokens

    def extend(self, req_id: str, num_tokens: int) -> None:
        """Grow ``req_id``'s capacity by ``num_tokens``; on KVExhausted nothing changes."""
        new_pages = self._take(self.pages_needed(req_id, num_tokens))
        self._pages[req_id].extend(new_pages)
        self._num_tokens[req_id] += num_tokens

    def extend_all(self, grow: Sequence[tuple[str, int]]) -> bool:
        """Grows each ``(req_id, num_tokens)`` of ``grow`` (distinct requests) as ``extend``
        does, all or none: False, and nothing changed, when the free pages cannot hold them."""
        if sum(self.pages_needed(r, n) for r, n in grow) > len(self._free):
            return False
        for req_id, num_tokens in grow:
            self.extend(req_id, num_tokens)
        return True

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Shrink ``req_id``'s capacity to ``num_tokens``, freeing the pages it no longer needs."""
        pages = self._pages_of(req_id)
        capacity = self._num_tokens[req_id]
        if not 0 <= num_tokens <= capacity:
            raise ValueError(f"num_tokens: must be in [0, {capacity}], got {num_tokens}")
        keep = self._pages_for(num_tokens)
        self._give_back(pages[keep:])
        del pages[keep:]
        self._num_tokens[req_id] = num_tokens

    def free(self, req_id: str) -> None:
        """Release every page of ``req_id`` and forget it."""
        self._give_back(self._pages_of(req_id))
        del self._pages[req_id]
        del self._num_tokens[req_id]

    def num_tokens(self, req_id: str) -> int:
        """Current capacity of ``req_id`` in tokens."""
        self._pages_of(req_id)
        return self._num_tokens[req_id]

    def pages(self, req_id: str) -> list[int]:
        """Page ids of ``req_id`` in logical order (a copy)."""
        return list(self._pages_of(req_id))

    def slot(self, req_id: str, index: int) -> int:
        """Physical slot of logical token ``index`` of ``req_id``."""
        pages = self._pages_of(req_id)
        capacity = self._num_tokens[req_id]
        if not 0 <= index < capacity:
            raise ValueError(f"index: must be in [0, {capacity}), got {index}")
        return pages[index // self.page_size] * self.page_size + index % self.page_size

    def slot_mapping(self, req_id: str, start: int, end: int) -> list[int]:
        """Physical slots of logical token indices ``[start, end)`` of ``req_id``."""
        pages = self._pages_of(req_id)
        capacity = self._num_tokens[req_id]
        if not 0 <= start <= end <= capacity:
            raise ValueError(
                f"start, end: need 0 <= start <= end <= {capacity}, got [{start}, {end})"
            )
        size = self.page_size
        return [pages[i // size] * size + i % size for i in range(start, end)]

    def page_table(
        self,
        req_ids: Sequence[str],
        width: int | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Page ids of ``req_ids`` as rows padded with the null page.

        Returns an int32 tensor of shape [len(req_ids), width or the longest row].
        """
        rows = [self._pages_of(req_id) for req_id in req_ids]
        longest = max((len(row) for row in rows), default=0)
        if width is None:
            width = longest
        elif width < longest:
            raise ValueError(f"width: {width} is less than the longest page list ({longest})")
        padded = [row + [NULL_PAGE] * (width - len(row)) for row in rows]
        if not padded:
            return torch.zeros((0, width), dtype=torch.int32, device=device)
        return to_device(torch.tensor(padded, dtype=torch.int32), device)  # [num_reqs, width]


class KVCache:
    """The K/V tensors of one model plus the allocator that hands out their pages.

    Slot ``page * page_size + offset`` holds token ``offset`` of ``page``; slots of page 0 (the
    null page) take padding writes and are never read as live data.
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int) -> None:
        self.spec = spec
        self.allocator = PageAllocator(num_pages, spec.page_size)
        num_slots = (num_pages + 1) * spec.page_size
        shape = (num_slots, spec.num_kv_heads, spec.head_dim)
        # Zeroed so that reads of the null page (masked out anyway) never see NaN garbage.
        self.k_caches: list[torch.Tensor] = [  # per layer [num_slots, num_kv_heads, head_dim]
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]
        self.v_caches: list[torch.Tensor] = [  # per layer [num_slots, num_kv_heads, head_dim]
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]

    @classmethod
    def from_budget(cls, spec: KVCacheSpec, num_bytes: int) -> KVCache:
        """A pool with as many pages as ``num_bytes`` holds (null page included)."""
        return cls(spec, spec.pages_for_budget(num_bytes))

    def slot_mapping_tensor(
        self, req_ids: Sequence[str], starts: Sequence[int], ends: Sequence[int]
    ) -> torch.Tensor:
        """Slots of tokens ``[starts[i], ends[i])`` of each request, concatenated in order.

        Returns an int64 tensor of shape [sum(ends - starts)] on ``spec.device``.
        """
        if not len(req_ids) == len(starts) == len(ends):
            raise ValueError(
                f"req_ids, starts, ends: lengths differ ({len(req_ids)}, {len(starts)}, "
                f"{len(ends)})"
            )
        slots: list[int] = []
        for req_id, start, end in zip(req_ids, starts, ends, strict=True):
            slots.extend(self.allocator.slot_mapping(req_id, start, end))
        return to_device(torch.tensor(slots, dtype=torch.int64), self.spec.device)  # [num_tokens]
