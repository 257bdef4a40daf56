"""kernels/gdn_prefill (a GDN layer's prefill glue in Triton) against its fp32 references.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by triton_interp)."""

import os

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)

from ninfer_bench.kernels import gdn_prefill as gp
from ninfer_bench.kernels.conv import causal_conv1d
from ninfer_bench.kernels.gdn import l2norm
from ninfer_bench.kernels.norm import gated_rms_norm as gated_rms_norm_eager

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

pytestmark = pytest.mark.skipif(not gp.triton_available(), reason="triton does not import")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# (B, T, hk, hv, dk, dv, W): T shorter than the conv window's reach, T not a multiple of BLOCK_T, grouped value heads,
# key and value heads of different sizes (not powers of two)
SHAPES = {"b1-t37": (1, 37, 2, 6, 32, 32, 4), "b2-t3": (2, 3, 1, 2, 16, 16, 4), "b2-t20-w2": (2, 20, 2, 2, 64, 64, 2),
          "b1-t9-dk24-dv16": (1, 9, 2, 4, 24, 16, 4)}


def conv_case(b, t, hk, hv, dk, dv, w, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    wide = torch.randn(b, t, c + 8, generator=g)  # qkv as a view with a row stride past C (a split of qkvz)
    qkv = wide[..., :c].to(dtype).to(DEVICE)
    conv_w = (0.5 * torch.randn(c, w, generator=g)).to(DEVICE)
    state = torch.randn(b + 2, c, w - 1, generator=g).to(dtype).to(DEVICE)  # more slots than rows, read out of order
    slots = torch.tensor([b + 1, 0][:b]).to(DEVICE)
    return qkv, conv_w, state, slots


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_conv_qkv_matches_reference_and_the_eager_ops(shape):
    b, t, hk, hv, dk, dv, w = SHAPES[shape]
    qkv, conv_w, state, slots = conv_case(*SHAPES[shape])
    q, k, v = gp.conv_qkv(qkv, conv_w, state, slots, hk, dk, hv, dv)
    rq, rk, rv = gp.conv_qkv_ref(qkv, conv_w, state[slots], hk, dk, hv, dv)
    for name, out, ref in (("q", q, rq), ("k", k, rk), ("v", v, rv)):
        assert out.shape == ref.shape and out.is_contiguous(), name
        assert rel(out, ref) < 1e-5, name
    # the eager path's ops (kernels/conv.causal_conv1d, kernels/gdn.l2norm) compute the same in fp32
    y, _ = causal_conv1d(qkv.contiguous(), conv_w, state[slots])
    eq, ek, ev = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
    assert rel(q, l2norm(eq.reshape(b, t, hk, dk))) < 1e-5 and rel(k, l2norm(ek.reshape(b, t, hk, dk))) < 1e-5
    assert rel(v, ev.reshape(b, t, hv, dv)) < 1e-5


def test_conv_qkv_state_reaches_past_the_first_block(monkeypatch):
    """Blocks shorter than the conv window's reach: the second block's first taps still read the conv state (only a
    block starting within the first W - 1 tokens reads it)."""
    b, t, hk, hv, dk, dv, w = SHAPES["b1-t37"]
    qkv, conv_w, state, slots = conv_case(b, t, hk, hv, dk, dv, w)
    want = gp.conv_qkv(qkv, conv_w, state, slots, hk, dk, hv, dv)
    monkeypatch.setattr(gp, "BLOCK_T", 2)  # blocks at 0 and 2 start within the 3 tokens the state supplies
    got = gp.conv_qkv(qkv, conv_w, state, slots, hk, dk, hv, dv)
    refs = gp.conv_qkv_ref(qkv, conv_w, state[slots], hk, dk, hv, dv)
    for out, ref, other in zip(got, refs, want):
        assert rel(out, ref) < 1e-5 and rel(out, other) < 1e-5


# (B, T, C, W, n): a chunk longer than the window, one shorter (the old state shifts), padded rows (n < T, one row
# with no real token and one with fewer than W - 1), a width of 2, channels past one program's block
STATE_CASES = [(2, 9, 40, 4, None), (2, 2, 40, 4, None), (3, 7, 40, 4, [7, 0, 2]), (1, 5, 300, 2, [3]),
               (2, 1, 600, 4, None)]


@pytest.mark.parametrize("b,t,c,w,n", STATE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_state_update_matches_reference(b, t, c, w, n, dtype):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, t, c + 24, generator=g)[..., 5:c + 5].to(dtype).to(DEVICE)  # a strided view
    state = torch.randn(b + 3, c, w - 1, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([b + 2, 0, 3][:b]).to(DEVICE)  # out of order, not every slot
    nn = None if n is None else torch.tensor(n).to(DEVICE)
    got, want = state.clone(), state.clone()
    gp.conv_state_update(qkv, got, slots, nn)
    gp.conv_state_update_ref(qkv, want, slots, nn)
    assert torch.equal(got, want)  # exact copies of the inputs; the other slots untouched
    rows = list(range(b))
    for r in rows:  # spelled out: the last W - 1 inputs of cat(old state, the row's real tokens)
        k = t if n is None else n[r]
        seq = torch.cat([state[slots[r]], qkv[r, :k].transpose(0, 1)], dim=1)
        assert torch.equal(got[slots[r]], seq[:, -(w - 1):])


def test_conv_state_update_bad_shapes():
    qkv = torch.zeros(1, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="conv_state_update"):
        gp.conv_state_update(qkv, torch.zeros(2, 9, 3, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="conv_state_update"):
        gp.conv_state_update(qkv, torch.zeros(2, 8, 3, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE),
                             torch.zeros(2, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("b,t,hv,n", [(1, 70, 48, None), (2, 5, 3, [5, 2]), (3, 33, 6, [0, 33, 17])])
def test_gates_match_the_eager_ops(b, t, hv, n):
    g = torch.Generator().manual_seed(4)
    ba = (4 * torch.randn(b, t, 2 * hv + 3, generator=g)).to(torch.bfloat16).to(DEVICE)  # split views of b | a
    ba[0, 0, hv] = 30.0  # past softplus's threshold
    ba[0, -1, hv] = -60.0  # where 1 + e^x rounds to 1
    bb, aa = ba[..., :hv], ba[..., hv:2 * hv]
    A_log = torch.randn(hv, generator=g).to(DEVICE)
    dt_bias = torch.randn(hv, generator=g).to(DEVICE)
    nn = None if n is None else torch.tensor(n).to(DEVICE)
    gg, beta = gp.gates(bb, aa, A_log, dt_bias, nn)
    rg, rbeta = gp.gates_ref(bb, aa, A_log, dt_bias, nn)
    assert gg.dtype == beta.dtype == torch.float32 and gg.is_contiguous() and beta.is_contiguous()
    assert torch.allclose(gg, rg, rtol=1e-5, atol=1e-30) and torch.allclose(beta, rbeta, rtol=1e-5, atol=0)
    if not INTERPRET:  # compiled: torch's own float functions, so the eager ops' bits
        assert torch.equal(gg, rg) and torch.equal(beta, rbeta)
    if n is not None:  # padding: exactly zero
        for r in range(b):
            assert not gg[r, n[r]:].any() and not beta[r, n[r]:].any()


def test_conv_qkv_bf16():
    if INTERPRET:
        pytest.skip("the Triton interpreter rounds to bf16 by truncation (GPU only)")
    qkv, conv_w, state, slots = conv_case(1, 300, 4, 12, 128, 128, 4, dtype=torch.bfloat16)
    outs = gp.conv_qkv(qkv, conv_w, state, slots, 4, 128, 12, 128)
    refs = gp.conv_qkv_ref(qkv, conv_w, state[slots], 4, 128, 12, 128)
    assert all(o.dtype == torch.bfloat16 and rel(o, r) < 1e-2 for o, r in zip(outs, refs))


def test_conv_qkv_bad_shapes():
    qkv, conv_w, state, slots = conv_case(*SHAPES["b1-t37"])
    with pytest.raises(ValueError, match="channels"):
        gp.conv_qkv(qkv, conv_w, state, slots, 2, 32, 5, 32)  # 5 value heads: 32 channels short
    with pytest.raises(ValueError, match="slots"):
        gp.conv_qkv(qkv, conv_w, state, slots[:0], 2, 32, 6, 32)


@pytest.mark.parametrize("b,t,h,d", [(1, 5, 6, 32), (2, 3, 3, 64), (1, 4, 48, 128)])
def test_gated_rms_norm_matches_reference(b, t, h, d):
    g = torch.Generator().manual_seed(1)
    o = torch.randn(b, t, h, d, generator=g).to(DEVICE)
    zz = torch.randn(b, t, h * d + 16, generator=g).to(DEVICE)
    z = zz[..., 16:]  # a strided view, as the split of the qkvz projection gives
    wt = torch.randn(d, generator=g).to(DEVICE)
    y = gp.gated_rms_norm(o, z, wt, 1e-6)
    ref = gp.gated_rms_norm_ref(o, z, wt, 1e-6).reshape(b, t, h * d)
    assert y.shape == (b, t, h * d) and rel(y, ref) < 1e-5
    eager = gated_rms_norm_eager(o, z.reshape(b, t, h, d), wt, 1e-6).reshape(b, t, h * d)
    assert rel(y, eager) < 1e-5


def test_module_imports_without_triton():
    triton_interp.assert_imports_without_triton("gdn_prefill")
