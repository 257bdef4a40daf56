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


def link_case(n, dtype, seed, *, stops=(), done=False, fill=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, n, generator=g).to(dtype)
    if fill is not None:
        fill(logits)
    state = dict(picked=torch.zeros(1, dtype=torch.long), ids=torch.full((1,), 5, dtype=torch.long),
                 pos=torch.full((1,), 41, dtype=torch.long), done=torch.tensor([done]),
                 slots=torch.full((1,), 3, dtype=torch.long))
    stop = torch.full((64,), -1, dtype=torch.long)
    stop[:len(stops)] = torch.tensor(list(stops), dtype=torch.long)
    return logits.to(DEVICE), stop.to(DEVICE), torch.full((1,), 3, dtype=torch.long, device=DEVICE), \
        {k: v.to(DEVICE) for k, v in state.items()}


def _ties(x):  # the largest value three times (bf16 logits tie often): the first of them is the argmax
    x[0, [40_000 % x.shape[1], 9, 17_000 % x.shape[1]]] = 50.0


def _zeros(x):  # -0.0 before +0.0 as the largest value: torch's argmax takes them as equal
    x.clamp_(max=-1.0)
    x[0, 7], x[0, 30] = -0.0, 0.0


def _nan(x):  # a NaN counts as the largest value
    x[0, 2] = 100.0
    x[0, x.shape[1] - 3] = float("nan")


def _neg_inf(x):  # every value -inf: the first column
    x.fill_(float("-inf"))


@pytest.mark.parametrize("n,dtype,fill", [(8192, torch.bfloat16, None), (8192, torch.bfloat16, _ties),
                                          (50_000, torch.float32, _ties), (50_000, torch.bfloat16, None),
                                          (300, torch.float32, _zeros), (20_000, torch.float32, _nan),
                                          (1000, torch.float32, _neg_inf)],
                         ids=["8k", "8k-ties", "50k-ties-programs", "50k-bf16", "zeros", "nan", "neg-inf"])
def test_chain_link_equals_reference(n, dtype, fill):
    """One launch writes what the torch link writes: the argmax (torch's choice on ties, zeros of either sign, NaN and
    an all -inf row) as the picked token and the next input, the position advanced, the slot kept (no stop id)."""
    logits, stop, own, got = link_case(n, dtype, 1, stops=(n + 5,), fill=fill)
    _, _, _, want = link_case(n, dtype, 1, stops=(n + 5,), fill=fill)
    work = sel.LinkScratch(n, logits.device)
    assert (work.programs == 1) == (n <= sel.LINK_CHUNK)  # one program writes the link from its own maximum
    for step in range(3):  # the counter is back at 0 after every launch: the same scratch serves the next one
        sel.chain_link(logits, stop, own, 7, work=work, **got)
        sel.chain_link_ref(logits, stop, own, 7, **want)
        for key in want:
            assert torch.equal(got[key], want[key]), (key, step)
    assert int(got["picked"]) == int(logits.float().argmax()) and int(got["pos"]) == 44
    assert int(work.count) == 0


@pytest.mark.parametrize("stops,done", [((11, 12), False), ((), True), ((11,), True)])
def test_chain_link_stops(stops, done):
    """A picked stop id sets done and switches the slot to the scratch slot; once done it stays so."""
    n = 4096

    def fill(x):
        x[0, 12] = 30.0

    logits, stop, own, got = link_case(n, torch.float32, 2, stops=stops, done=done, fill=fill)
    _, _, _, want = link_case(n, torch.float32, 2, stops=stops, done=done, fill=fill)
    sel.chain_link(logits, stop, own, 7, work=sel.LinkScratch(n, logits.device), **got)
    sel.chain_link_ref(logits, stop, own, 7, **want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert bool(got["done"]) == (done or 12 in stops) and int(got["slots"]) == (7 if got["done"] else 3)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs an sm_90+ GPU")
def test_chain_link_under_pdl_in_a_graph():
    """In a captured step the link launches under PDL while the lm_head's qmv (which lets its dependents launch as it
    starts) still writes the logits: the link reads them only after it is done, every replay."""
    from ninfer_bench.kernels import _triton, qmv_cuda, quant
    from ninfer_bench.kernels.qlinear import PackedLinear

    if not qmv_cuda.available():
        pytest.skip(f"qmv_cuda cannot run here: {qmv_cuda.import_error()}")
    n, k = 50_000, 256
    g = torch.Generator().manual_seed(5)
    lin = PackedLinear(quant.pack(torch.randn(n, k, generator=g) * 0.05, "q8_g32_fp16"), "q8_g32_fp16", (n, k),
                       "cuda")
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).cuda()
    logits = torch.empty(1, n, dtype=torch.float32, device="cuda")
    _, stop, own, got = link_case(n, torch.float32, 4, stops=(n + 5,))
    want = {key: v.clone() for key, v in got.items()}
    work = sel.LinkScratch(n, logits.device)
    _triton.set_pdl(True)
    try:
        qmv_cuda.qmv(x, lin, logits, pdl=True, out_f32=True)  # compile outside the capture
        sel.chain_link(logits, stop, own, 7, work=work, **{key: v.clone() for key, v in got.items()})
        graph = torch.cuda.CUDAGraph()
        with _triton.graph_scope(), torch.cuda.graph(graph):
            assert _triton.pdl_args(logits.device)["PDL"]
            qmv_cuda.qmv(x, lin, logits, pdl=True, out_f32=True)
            sel.chain_link(logits, stop, own, 7, work=work, **got)
    finally:
        _triton.set_pdl(False)
    for step in range(4):
        x.copy_(torch.randn(1, k, generator=g).to(torch.bfloat16))  # a new argmax each replay
        logits.fill_(float("nan"))  # logits read before the qmv is done would give a NaN's column
        graph.replay()
        torch.cuda.synchronize()
        sel.chain_link_ref(qmv_cuda.qmv(x, lin).float(), stop, own, 7, **want)
        for key in want:
            assert torch.equal(got[key], want[key]), (key, step)
    assert int(work.count) == 0


def test_chain_link_names_bad_buffers():
    logits, stop, own, got = link_case(100, torch.float32, 3)
    with pytest.raises(ValueError, match="V = 99"):
        sel.chain_link(logits, stop, own, 7, work=sel.LinkScratch(99, logits.device), **got)
    got["pos"] = got["pos"].int()
    with pytest.raises(ValueError, match="pos"):
        sel.chain_link(logits, stop, own, 7, work=sel.LinkScratch(100, logits.device), **got)
