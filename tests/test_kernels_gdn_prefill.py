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
