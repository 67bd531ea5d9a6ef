"""The plain-torch verify_sampling reference (`kernels/reference.py`) against a scalar
walker (one request at a time, fp32 sums emulated) and a chi-square test of losslessness, which
must also catch the classic bug (acceptance without the cumulative sum)."""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from kernels.reference import build_tree_ref, verify_greedy_ref, verify_sampling_ref
from tests.helpers.kernel_oracles import (
    CHI2_CRITICAL_999_DF63,
    random_sampling_batch,
    tree,
    two_token_chi2,
)


def f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def scalar_sampling(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    coins: torch.Tensor,
    noise: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    num_nodes: torch.Tensor,
    width: int,
    *,
    cumulative: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verify_sampling one request at a time in plain Python, as a kernel thread walks a tree
    (fp32 sums emulated; no rounding fallback). `cumulative=False` is the classic bug: accept
    c_k when u < p(c_k); the chi-square test must catch it."""
    toks, p_all, u_all = tokens.tolist(), probs.tolist(), coins.tolist()
    e_all, fc, ns = noise.tolist(), first_child.tolist(), next_sibling.tolist()
    accept_index: list[list[int]] = []
    accept_len: list[int] = []
    bonus: list[int] = []
    for b in range(len(toks)):
        path = [0]
        while True:
            x, total, nxt, seen = path[-1], 0.0, -1, set()
            p, residual, c = p_all[b][x], list(p_all[b][x]), fc[b][x]
            while c != -1 and nxt == -1:
                t = toks[b][c]
                if t not in seen:  # a repeated sibling token is skipped
                    seen.add(t)
                    residual[t] = 0.0
                    total = f32(total + p[t]) if cumulative else p[t]
                    nxt = c if u_all[b][x] < total else -1
                c = ns[b][c]
            if nxt == -1:
                break
            path.append(nxt)
        race = [f32(r / e) if r > 0 else -1.0 for r, e in zip(residual, e_all[b], strict=True)]
        bonus.append(max(range(len(race)), key=lambda v: (race[v], -v)))
        accept_index.append(path + [-1] * (width - len(path)))
        accept_len.append(len(path))
    return torch.tensor(accept_index), torch.tensor(accept_len), torch.tensor(bonus)


def sample_one(
    p_root: list[float], coin: float, noise: list[float], children: list[int]
) -> list[Any]:
    tokens = [7, *children]  # node 0's token (here outside the vocabulary) is never read
    parents, num = tree([-1] + [0] * len(children))
    _, _, fc, ns = build_tree_ref(parents, num)
    probs = torch.tensor([[p_root] * len(tokens)])
    coins = torch.tensor([[coin] * len(tokens)])
    out = verify_sampling_ref(
        torch.tensor([tokens]), probs, coins, torch.tensor([noise]), fc, ns, num, 2
    )
    return [t[0].tolist() for t in out]


def test_verify_sampling_hand_coins() -> None:
    p, ones = [0.1, 0.2, 0.3, 0.4], [1.0] * 4
    # An accepted leaf draws the bonus from its own p: argmax p / 1 = token 3.
    assert sample_one(p, 0.1, ones, [1, 2]) == [[0, 1], 2, 3]  # 0.1 < 0.2: first child
    assert sample_one(p, 0.25, ones, [1, 2]) == [[0, 2], 2, 3]  # 0.25 < 0.2 + 0.3: second
    assert sample_one(p, 0.6, ones, [1, 2]) == [[0, -1], 1, 3]  # residual [.1, 0, 0, .4]
    assert sample_one(p, 0.6, [0.1, 1, 1, 1], [1, 2]) == [[0, -1], 1, 0]  # .1/.1 beats .4
    assert sample_one(p, 0.3, ones, [1, 1, 2]) == [[0, 3], 2, 3]  # the repeated 1 is skipped
    # A leaf draws from p itself, and a zero-probability token never wins the race.
    assert sample_one([0.0, 0.5, 0.5, 0.0], 0.5, [1e-30, 1, 2, 1e-30], []) == [[0, -1], 1, 1]
    # Rounding: the children hold all the mass, yet their fp32 sum ends just below u.
    below_one = 1.0 - 2.0**-24
    p_edge = [0.0, 0.5, 0.5 - 2.0**-24, 0.0]
    assert sample_one(p_edge, below_one, ones, [1, 2]) == [[0, 2], 2, 1]


def test_verify_sampling_matches_scalar_walker() -> None:
    args = random_sampling_batch(bs=300, n=9, vocab=5, seed=3)
    ours, scalar = verify_sampling_ref(*args), scalar_sampling(*args)
    for a, b in zip(ours, scalar, strict=True):
        assert torch.equal(a, b)
    assert (ours[1] > 1).any() and (ours[1] > 2).any()  # the walk went deep somewhere


def test_verify_sampling_one_hot_is_greedy() -> None:
    tokens, probs, coins, noise, fc, ns, num, n = random_sampling_batch(200, 8, 4, seed=5)
    target_ids = probs.argmax(dim=-1)
    one_hot = torch.nn.functional.one_hot(target_ids, 4).float()
    ours = verify_sampling_ref(tokens, one_hot, coins, noise, fc, ns, num, n)
    for a, b in zip(ours, verify_greedy_ref(tokens, target_ids, fc, ns, num, n), strict=True):
        assert torch.equal(a, b)


def test_verify_sampling_is_lossless() -> None:
    tail = torch.special.gammaincc(torch.tensor(63 / 2), torch.tensor(CHI2_CRITICAL_999_DF63 / 2))
    assert math.isclose(float(tail), 1e-3, rel_tol=1e-3)
    assert two_token_chi2(verify_sampling_ref) < CHI2_CRITICAL_999_DF63


def test_chi2_catches_acceptance_without_cumulative_sum() -> None:
    def wrong(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return scalar_sampling(*args, cumulative=False)

    assert two_token_chi2(wrong) > CHI2_CRITICAL_999_DF63
