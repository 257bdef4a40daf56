"""draft_attention (Triton: a drafted block against the drafter's cached context read in place) against its fp32
reference, and the reference against the drafter's torch path (the gathered rows, the mask, sdpa).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by triton_interp before triton is
imported) on fp32 inputs; on CUDA the same cases run compiled, and bf16 cases at the 27B drafter's shape, eager and
replayed from a CUDA graph.
"""

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)
from ninfer_bench.kernels import draft_attention as da
from ninfer_bench.kernels.attention import sdpa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

pytestmark = pytest.mark.skipif(not da.triton_available(), reason=f"triton does not import: {da._triton.import_error()}")


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Outputs and partials start as NaN, so anything the kernels leave unwritten fails the comparison."""
    monkeypatch.setattr(da, "_new_buffer", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                 device=device))


def make_case(b, s, h, hkv, hd, cap, window, lengths, n_slots=4, dtype=torch.float32, seed=0, holes=True):
    """Random q and block K/V, and a cache of ``n_slots`` slots of ``cap + s + 1`` rows (the drafter's layout: context,
    room for a block, a discard row) whose rows hold the positions a drafter leaves there after decoding
    ``lengths[i]`` tokens into row i's slot: with a window, position p in row p % cap (the ring, wrapped when
    lengths > cap); without, in row p. ``holes``: a few written rows are emptied (-1, a rejected draft's row) and one
    row holds a position at or past the length (not visible). Rows of other slots are random."""
    g = torch.Generator().manual_seed(seed)
    rows = cap + s + 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    q, kb, vb = rnd(b, s, h, hd), rnd(b, s, hkv, hd), rnd(b, s, hkv, hd)
    rk, rv = rnd(n_slots, rows, hkv, hd), rnd(n_slots, rows, hkv, hd)
    pos = torch.full((n_slots, rows), -1, dtype=torch.long)
    slots = torch.randperm(n_slots, generator=g)[:b]
    for slot, n in zip(slots.tolist(), lengths):
        p = torch.arange(max(0, n - (window or n)) if window else 0, n)
        pos[slot, p % cap if window else p] = p
        if holes and n > 4:
            pos[slot, (p[torch.randperm(len(p), generator=g)[:3]] % cap) if window else p[:3]] = -1
            if not window and n < cap:
                pos[slot, n] = n  # a row past the length: invisible
    pos[slots.new_tensor([i for i in range(n_slots) if i not in slots.tolist()])] = 7  # other slots: never read
    return dict(q=q, k_blk=kb, v_blk=vb, ring_k=rk, ring_v=rv, slots=slots.to(DEVICE), ring_pos=pos.to(DEVICE),
                length=torch.tensor(lengths, device=DEVICE), cap=cap, window=window, scale=hd ** -0.5)


# (B, S, H, Hkv, hd, cap, window, lengths): a wrapped ring, a ring not yet full, no window (rows = positions, the
# range stopping at the length), groups 1 / 4, S and hd not powers of two, one row seeing nothing but its block
CASES = {
    "ring-wrapped-g4": (2, 5, 8, 2, 32, 96, 96, [250, 130]),
    "ring-partial-g1": (1, 8, 3, 3, 16, 64, 64, [40]),
    "window-under-cap-g2": (2, 3, 4, 2, 24, 80, 50, [200, 79]),
    "no-window": (3, 4, 6, 2, 32, 200, 0, [150, 3, 70]),
    "empty-context": (2, 6, 2, 1, 16, 64, 64, [0, 33]),
}


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(case, splits):
    c = make_case(*CASES[case])
    out = da.draft_attention(**c, splits=splits)
    ref = da.draft_attention_ref(**c)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_reference_is_the_drafters_torch_path():
    """The reference equals what engine/model/dflash.py's torch path computes: the slot's rows gathered, the block's
    keys after them, sdpa under the mask BlockDraftRunner.block builds."""
    c = make_case(*CASES["ring-wrapped-g4"])
    s, cap = c["q"].shape[1], c["cap"]
    mask = da.block_mask(c["ring_pos"], c["slots"], c["length"], cap, c["window"], s)
    k = torch.cat([c["ring_k"][c["slots"], :cap], c["k_blk"]], dim=1).transpose(1, 2)
    v = torch.cat([c["ring_v"][c["slots"], :cap], c["v_blk"]], dim=1).transpose(1, 2)
    want = sdpa(c["q"].transpose(1, 2), k, v, mask, c["scale"]).transpose(1, 2)
    torch.testing.assert_close(da.draft_attention_ref(**c), want, rtol=1e-5, atol=1e-5)


def test_refuses_mismatched_inputs():
    c = make_case(*CASES["ring-partial-g1"])
    with pytest.raises(ValueError, match="multiple of Hkv"):
        da.draft_attention(**{**c, "q": c["q"][:, :, :2]})
    with pytest.raises(ValueError, match="cap=.* must fit"):
        da.draft_attention(**{**c, "cap": c["ring_k"].shape[1] + 1})
    with pytest.raises(ValueError, match="one dtype"):
        da.draft_attention(**{**c, "ring_k": c["ring_k"].double()})


def test_splits_cover_the_grid():
    """About two programs an SM, whole tiles a range, never more ranges than tiles."""
    assert da.draft_splits(1, 10, 2048, "cpu") == 2  # 8 "SMs" off CUDA: 16 programs wanted, 10 kv heads
    assert da.draft_splits(1, 1, 64, "cpu") == 1
    assert da.draft_splits(1, 1, 2048, "cpu") == 16


@CUDA
@pytest.mark.parametrize("batch,lengths", [(1, [5000]), (8, [2100 + 37 * i for i in range(8)])])
def test_bf16_27b_drafter_shape(batch, lengths):
    """The 27B drafter's layer (8-token block, 40 heads over 10 kv heads, head size 128, a 2,048-row ring): bf16
    against the fp32 reference, eager and replayed from a CUDA graph (the same bits)."""
    c = make_case(batch, 8, 40, 10, 128, 2048, 2048, lengths, n_slots=batch + 1, dtype=torch.bfloat16)
    ref = da.draft_attention_ref(**c)
    out = da.draft_attention(**c)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = da.draft_attention(**c)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
