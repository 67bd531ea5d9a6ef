"""Host-to-device helpers: segments of one upload keep their values and their alignment."""

from __future__ import annotations

import itertools

import torch

from tandem.transfer import device_segments


def test_segments_keep_values_and_start_on_16_bytes() -> None:
    for lengths in itertools.product(range(4), repeat=3):
        segments = [[10 * s + i for i in range(n)] for s, n in enumerate(lengths)]
        out = device_segments(segments, "cpu")
        assert [t.tolist() for t in out] == segments
        assert all(t.dtype == torch.int64 and t.data_ptr() % 16 == 0 for t in out), lengths
        # one upload: every segment is a view of the same storage
        assert len({t.untyped_storage().data_ptr() for t in out}) == 1
