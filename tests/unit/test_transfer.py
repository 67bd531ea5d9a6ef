"""Host-to-device helpers: segments of one upload keep their values and their alignment."""

from __future__ import annotations

import itertools

import pytest
import torch

from tandem import transfer
from tandem.transfer import device_segments


def test_segments_keep_values_and_start_on_16_bytes() -> None:
    for lengths in itertools.product(range(4), repeat=3):
        segments = [[10 * s + i for i in range(n)] for s, n in enumerate(lengths)]
        out = device_segments(segments, "cpu")
        assert [t.tolist() for t in out] == segments
        assert all(t.dtype == torch.int64 and t.data_ptr() % 16 == 0 for t in out), lengths
        # one upload: every segment is a view of the same storage
        assert len({t.untyped_storage().data_ptr() for t in out}) == 1


def test_to_host_passes_host_tensors_through_beside_device_ones() -> None:
    """A message mixing host tensors with device ones: host ones are cast, not copied again;
    on CPU nothing needs an event."""
    held = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    new = torch.ones(1, 2, dtype=torch.float32)
    out, event = transfer.to_host([held, new], torch.float16)
    assert event is None
    assert [t.dtype for t in out] == [torch.float16, torch.float16]
    assert torch.equal(out[0].float(), held) and torch.equal(out[1].float(), new)


@pytest.mark.gpu
def test_mixed_to_host_on_cuda() -> None:
    """On CUDA ``to_host`` copies device tensors (one event) and passes host ones through, in
    order."""
    expected = torch.arange(4096, dtype=torch.bfloat16).reshape(64, 64)
    host = expected.clone()
    new = torch.full((2, 64), 3.0, device="cuda", dtype=torch.bfloat16)
    out, event = transfer.to_host([host, new, host[:1]], torch.float32)
    assert event is not None
    event.synchronize()
    assert [t.device.type for t in out] == ["cpu"] * 3
    assert torch.equal(out[0], expected.float()) and torch.equal(out[1], new.float().cpu())
    assert torch.equal(out[2], expected[:1].float())
