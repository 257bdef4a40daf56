"""DFlash2's selection kernels (kernels/select.py) against their torch references, bit for bit: the ordered top-k on
ties, signed zeros and infinities, vocabularies that are not a multiple of a chunk, bf16 and fp32 inputs; the greedy
walk on tied scores. Without CUDA the kernels run in Triton's interpreter."""

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)

from ninfer_bench.kernels import select as sel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not sel.triton_available(), reason="triton does not import")


@pytest.mark.parametrize("lead,n,k,dtype", [((7,), 8192, 16, torch.bfloat16), ((2, 3), 5000, 16, torch.float32),
                                            ((1,), 37, 5, torch.bfloat16), ((4,), 2048, 64, torch.float32),
                                            ((3,), 20000, 1, torch.bfloat16)])
def test_ordered_topk_equals_reference(lead, n, k, dtype):
    g = torch.Generator().manual_seed(n + k)
    x = (torch.randn(*lead, n, generator=g) * 4).round()  # integers: many ties, across chunks too
    x.view(-1, n)[:, :3] = torch.tensor([0.0, -0.0, float("-inf")])
    x = x.to(dtype).to(DEVICE)
    vals, cols = sel.ordered_topk(x, k)
    want_vals, want_cols = sel.ordered_topk_ref(x, k)
    assert vals.dtype == torch.float32 and cols.dtype == torch.int64
    assert torch.equal(cols, want_cols) and torch.equal(vals, want_vals)


def test_ordered_topk_names_a_bad_k():
    x = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="k must be"):
        sel.ordered_topk(x, 11)


@pytest.mark.parametrize("b,k,c", [(1, 7, 16), (3, 4, 5), (2, 1, 3), (2, 15, 16)])
def test_greedy_walk_equals_reference(b, k, c):
    g = torch.Generator().manual_seed(b * 31 + k)
    scores = (torch.randn(b, k, c, c, generator=g) * 2).round().to(DEVICE)  # ties: the first index wins
    cand = torch.randint(0, 1000, (b, k, c), generator=g).to(DEVICE)
    assert torch.equal(sel.greedy_walk(scores, cand), sel.greedy_walk_ref(scores, cand))
    with pytest.raises(ValueError, match="scores"):
        sel.greedy_walk(scores[:, :, :, :2], cand)
