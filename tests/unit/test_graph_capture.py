"""CUDA-graph capture's guard against garbage collection (``no_collection``): no automatic
collection runs inside it, and the collector's state is restored after it, an exception
included."""

from __future__ import annotations

import gc

import pytest

from tandem.graphs.base import no_collection


class _Cycle:
    def __init__(self, freed: list[int]) -> None:
        self.me = self
        self.freed = freed

    def __del__(self) -> None:
        self.freed.append(1)


def test_no_automatic_collection_runs_inside() -> None:
    freed: list[int] = []
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at almost every allocation
    try:
        with no_collection():
            assert not gc.isenabled()
            for _ in range(200):
                _Cycle(freed)
                [object() for _ in range(10)]  # allocations that would trigger collections
            assert freed == []  # the cycles wait: no finalizer ran inside
        gc.collect()
        assert len(freed) == 200
    finally:
        gc.set_threshold(*threshold)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_state_is_restored(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with pytest.raises(RuntimeError), no_collection():
            raise RuntimeError("capture failed")
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
