"""The interface every drafter implements: one call per step, as on the wire."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tandem.spec.types import DraftAdmit, Tree, VerifyOutcome


class Drafter(ABC):
    """Proposes trees. ``target_layer_ids`` are the target features it needs (transformers'
    ``hidden_states`` numbering, concatenated in this order); empty for token-only drafts."""

    target_layer_ids: tuple[int, ...] = ()

    @abstractmethod
    def step(
        self,
        admits: Sequence[DraftAdmit],
        outcomes: Sequence[VerifyOutcome],
        released: Sequence[str],
    ) -> dict[str, Tree]:
        """Applies one step's updates and returns the next tree of each updated request. A
        request without a tree decodes without speculation this step (a late draft, say)."""

    def take_dropped(self) -> list[str]:
        """Requests whose draft state was lost since the last call (a full draft pool, a
        restarted draft service); they are not sent to the draft again."""
        return []

    def num_tracked(self) -> int:
        """Requests this drafter holds state for (0 after every release: a tested invariant)."""
        return 0
