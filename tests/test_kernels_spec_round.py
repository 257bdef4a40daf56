"""A greedy round's integer glue (kernels/spec_round.py): the Triton launches against their torch references, bit
for bit, on rounds built to hit every branch (nothing accepted, everything accepted, a stop id among the drafts or as
the bonus, the length limit, rows already finished). Without CUDA the kernels run in Triton's interpreter."""

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)

from ninfer_bench.kernels import spec_round as sr

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not sr.triton_available(), reason="triton does not import")


def rounds(b: int, k: int, s: int, seed: int):
    """Drafts and the target's argmax sharing a random prefix per row (0 .. K), stop ids drawn from the same small
    vocabulary (so they hit), padded with -1, and a random number of tokens still allowed (0 .. K + 2)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 12, (b, k + 1), generator=g)
    drafts = torch.randint(0, 12, (b, k), generator=g)
    n = torch.randint(0, k + 1, (b,), generator=g)
    for r in range(b):
        drafts[r, : n[r]] = target[r, : n[r]]
        if n[r] < k and drafts[r, n[r]] == target[r, n[r]]:
            drafts[r, n[r]] = (target[r, n[r]] + 1) % 12
    stops = torch.randint(0, 12, (b, s), generator=g)
    stops[torch.rand(b, s, generator=g) < 0.5] = -1
    left = torch.randint(0, k + 3, (b,), generator=g)
    return [x.to(DEVICE) for x in (drafts, target, stops, left)]


@pytest.mark.parametrize("b,k,s", [(1, 7, 64), (5, 3, 4), (9, 1, 1), (4, 15, 3)])
def test_accept_keep_equals_reference(b, k, s):
    for seed in range(6):
        args = rounds(b, k, s, seed)
        got, want = sr.accept_keep(*args), sr.accept_keep_ref(*args)
        for name, x, y in zip(("n_acc", "bonus", "keep", "tokens", "stopped"), got, want):
            assert x.dtype == y.dtype and torch.equal(x, y), (seed, name, x, y)


def test_accept_keep_edges():
    """All drafts accepted and the bonus a stop id; a stop id at the first draft; nothing allowed any more."""
    drafts = torch.tensor([[4, 5, 6], [7, 5, 6], [1, 2, 3]], device=DEVICE)
    target = torch.tensor([[4, 5, 6, 9], [7, 5, 1, 1], [1, 2, 3, 4]], device=DEVICE)
    stops = torch.tensor([[9, -1], [7, -1], [-1, -1]], device=DEVICE)
    left = torch.tensor([10, 10, 0], device=DEVICE)
    n_acc, bonus, keep, tokens, stopped = sr.accept_keep(drafts, target, stops, left)
    assert n_acc.tolist() == [3, 2, 3] and bonus.tolist() == [9, 1, 4]
    assert keep.tolist() == [4, 1, 0] and stopped.tolist() == [True, True, False]
    assert tokens.tolist() == [[4, 5, 6, 9], [7, 5, 1, 1], [1, 2, 3, 4]]


@pytest.mark.parametrize("b,k", [(1, 7), (6, 3)])
def test_chain_update_equals_reference(b, k):
    for seed in range(6):
        drafts, target, stops, left = rounds(b, k, 3, seed)
        n_acc, bonus, keep, tokens, stopped = sr.accept_keep_ref(drafts, target, stops, left)
        g = torch.Generator().manual_seed(100 + seed)
        state = {"done": (torch.rand(b, generator=g) < 0.3).to(DEVICE),
                 "last": torch.randint(0, 12, (b,), generator=g).to(DEVICE),
                 "length": torch.randint(10, 90, (b,), generator=g).to(DEVICE),
                 "ntok": torch.randint(1, 9, (b,), generator=g).to(DEVICE), "left": left.clone(),
                 "slot": torch.zeros(b, dtype=torch.long, device=DEVICE),
                 "own": torch.arange(b, device=DEVICE), "scratch": torch.full((b,), 99, device=DEVICE),
                 "out": torch.full((b, 3 + k), -7, device=DEVICE)}
        mine = {n: v.clone() for n, v in state.items()}
        order = ("done", "last", "length", "ntok", "left", "slot", "own", "scratch", "out")
        sr.chain_update(keep, tokens, stopped, *(mine[n] for n in order), n_acc, bonus, drafts)
        sr.chain_update_ref(keep, tokens, stopped, *(state[n] for n in order), n_acc, bonus, drafts)
        for n in order:
            assert torch.equal(mine[n], state[n]), (seed, n, mine[n], state[n])


def test_bad_shapes_name_the_problem():
    drafts, target, stops, left = rounds(2, 3, 2, 0)
    with pytest.raises(ValueError, match="target"):
        sr.accept_keep(drafts, target[:, :3], stops, left)
    with pytest.raises(ValueError, match="stops"):
        sr.accept_keep(drafts, target, stops[:1], left)
    with pytest.raises(ValueError, match="drafts"):
        sr.accept_keep(drafts.t(), target, stops, left)
