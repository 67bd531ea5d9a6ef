"""`paged_inputs` (a graph bucket's per-step inputs from each row's base) against its reference:
the three uses of device-chain steps (the target's verify, the draft's extend with its kept
prefix and mask, a draft-loop step past the accepted tokens), odd batches and widths, page sizes
1 and 16, padding rows whose base is far past the page table, int32 and int64 outputs, and the
contract's errors. On a GPU the same tests compile the kernel; one adds a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels._interpret import DEVICE, check_mode  # sets Triton's mode: import first

# isort: split
from kernels.paged import _paged_inputs_kernel, paged_inputs
from kernels.reference_paged import paged_inputs_ref

check_mode(_paged_inputs_kernel)

# The three uses: (shift, offset, prefix_accepted, count_accepted, positions, mask)
USES = {
    "verify": (0, 0, False, False, True, False),
    "extend": (0, 0, False, True, True, True),  # EAGLE's shift 1: base + 1 - 1
    "loop": (1, 2, True, False, False, False),  # base + accepted + 2 - shift, step prev 2
}


def case(bs: int, w: int, page_size: int, words: int, seed: int, out_dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(seed)
    max_pages = 3 * w + 9
    live = bs - 1 if bs > 1 else bs  # the last row pads (base past the table)
    base = torch.randint(0, max_pages * page_size - 3 * w, (bs,), generator=g)
    base[live:] = 1 << 40
    accepted = torch.randint(0, w, (bs,), generator=g)
    alive = torch.arange(bs) < live
    table = torch.randperm(4000, generator=g)[: (bs + 1) * max_pages].view(bs + 1, max_pages)
    mask = torch.randint(-(1 << 62), 1 << 62, (bs * w, words), generator=g)
    return {
        "base": base.to(DEVICE),
        "accepted": accepted.to(DEVICE),
        "alive": alive.to(DEVICE),
        "page_table": table.to(torch.int32).to(DEVICE),
        "mask_src": mask.to(DEVICE),
        "out_dtype": out_dtype,
        "w": w,
    }


def outputs(c: dict, positions: bool, mask: bool) -> dict:
    bs, w = c["base"].shape[0], c["w"]
    fill = torch.full((bs * w,), 7, dtype=torch.int64, device=DEVICE)
    return {
        "slot_mapping": fill.clone(),
        "seq_lens": torch.full((bs,), 7, dtype=c["out_dtype"], device=DEVICE),
        "prefix_lens": torch.full((bs,), 7, dtype=c["out_dtype"], device=DEVICE),
        "positions": fill.clone() if positions else None,
        "mask_dst": torch.full_like(c["mask_src"], 7) if mask else None,
    }


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize(
    ("bs", "w", "page_size", "words", "out_dtype"),
    [(1, 1, 1, 1, torch.int64), (3, 4, 16, 1, torch.int32), (5, 7, 1, 2, torch.int64)],
)
def test_paged_inputs_match_reference(
    use: str, bs: int, w: int, page_size: int, words: int, out_dtype: torch.dtype
) -> None:
    shift, offset, prefix_accepted, count_accepted, positions, mask = USES[use]
    c = case(bs, w, page_size, words, seed=bs * 31 + w, out_dtype=out_dtype)
    ours, ref = outputs(c, positions, mask), outputs(c, positions, mask)
    for fn, out in ((paged_inputs, ours), (paged_inputs_ref, ref)):
        fn(
            c["base"], c["accepted"], c["alive"], c["page_table"],
            out["slot_mapping"], out["seq_lens"], out["prefix_lens"], out["positions"],
            c["mask_src"] if mask else None, out["mask_dst"],
            page_size=page_size, shift=shift, offset=offset,
            prefix_accepted=prefix_accepted, count_accepted=count_accepted,
        )  # fmt: skip
    for name in ref:
        if ref[name] is not None:
            assert torch.equal(ours[name], ref[name]), name
    live = c["alive"].cpu()
    assert (ref["slot_mapping"].view(bs, w)[~live] == -1).all()  # padding stores nothing
    assert (ref["seq_lens"].cpu()[~live] == 0).all()
    if count_accepted:  # the kept prefix: accepted + 1 tokens of each live row
        kept = (ref["slot_mapping"].view(bs, w) >= 0).sum(1).cpu()
        assert torch.equal(kept[live], (c["accepted"].cpu() + 1)[live])


def test_the_verify_formula_by_hand() -> None:
    """Row 0 at base 5, page size 4, pages [3, 8, 1]: indices 5..7 sit in page 8 at 1..3."""
    base = torch.tensor([5], device=DEVICE)
    table = torch.tensor([[3, 8, 1]], dtype=torch.int32, device=DEVICE)
    slots, seq, prefix = (torch.zeros(n, dtype=torch.int64, device=DEVICE) for n in (3, 1, 1))
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    alive = torch.tensor([True], device=DEVICE)
    paged_inputs(base, None, alive, table, slots, seq, prefix, pos, page_size=4)
    assert slots.tolist() == [33, 34, 35] and pos.tolist() == [5, 6, 7]
    assert (seq.item(), prefix.item()) == (8, 5)


def test_contract_errors() -> None:
    c = case(3, 4, 16, 1, seed=1, out_dtype=torch.int64)
    out = outputs(c, True, False)
    args = (c["base"], c["accepted"], c["alive"], c["page_table"])
    with pytest.raises(ValueError, match="accepted"):
        paged_inputs_ref(
            c["base"], None, c["alive"], c["page_table"], out["slot_mapping"],
            out["seq_lens"], out["prefix_lens"], page_size=16, count_accepted=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_inputs(*args, out["slot_mapping"][:-1], out["seq_lens"], out["prefix_lens"],
                     page_size=16)  # fmt: skip
    with pytest.raises(ValueError, match="give both"):
        paged_inputs(*args, out["slot_mapping"], out["seq_lens"], out["prefix_lens"], None,
                     c["mask_src"], page_size=16)  # fmt: skip
    with pytest.raises(ValueError, match="page_size"):
        paged_inputs(*args, out["slot_mapping"], out["seq_lens"], out["prefix_lens"],
                     page_size=0)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_inputs_in_a_cuda_graph() -> None:
    """Captured once, replayed after the bases move: the outputs follow the new bases."""
    c = case(5, 4, 16, 1, seed=3, out_dtype=torch.int32)
    ours, ref = outputs(c, True, True), outputs(c, True, True)

    def run(fn, out):  # type: ignore[no-untyped-def]
        fn(
            c["base"], c["accepted"], c["alive"], c["page_table"], out["slot_mapping"],
            out["seq_lens"], out["prefix_lens"], out["positions"], c["mask_src"], out["mask_dst"],
            page_size=16, count_accepted=True,
        )  # fmt: skip

    run(paged_inputs, ours)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(paged_inputs, ours)
    c["base"][:4] += 3
    c["accepted"].copy_(torch.tensor([3, 0, 1, 2, 0], device=DEVICE))
    graph.replay()
    run(paged_inputs_ref, ref)
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
