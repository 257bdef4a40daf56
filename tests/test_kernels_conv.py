"""Depthwise causal conv1d: fast version against the fp32 reference, the reference against a float64
loop, state continuation and per-position states, on awkward shapes (T = 1, 7, 8, 63, 130)."""

import math

import pytest
import torch
import torch.nn.functional as F

from ninfer_bench.kernels.conv import causal_conv1d, causal_conv1d_ref, causal_conv1d_states

# relative RMS tolerances, ||a - b|| / ||b||, per tensor
REF_VS_F64 = {"y": 1e-6}
FAST_VS_REF = {"y": 1e-6}
SPLIT_VS_WHOLE = {"y": 1e-6}
BF16_VS_REF = {"y": 1e-2}  # output rounding to bf16 only

IMPLS = {"ref": causal_conv1d_ref, "fast": causal_conv1d}


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values (an unwritten element?)"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(B, T, C, W=4, *, seed=0, state=True, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(C, W, generator=gen) * 0.5).to(device)
    s = torch.randn(B, C, W - 1, generator=gen).to(device=device, dtype=dtype) if state else None
    return x, w, s


def f64_conv(x, w, state, activation):
    """Float64 loop over batch, channel, time and taps: the definition written out."""
    B, T, C = x.shape
    W = w.shape[1]
    hist = torch.zeros(B, C, W - 1, dtype=torch.float64) if state is None else state.double()
    y = torch.full((B, T, C), float("nan"), dtype=torch.float64)
    new_state = torch.full((B, C, W - 1), float("nan"), dtype=torch.float64)
    for b in range(B):
        for c in range(C):
            seq = list(hist[b, c]) + list(x[b, :, c].double())
            for t in range(T):
                acc = sum(float(w[c, j]) * float(seq[t + j]) for j in range(W))
                y[b, t, c] = acc / (1.0 + math.exp(-acc)) if activation else acc
            new_state[b, c] = torch.tensor([float(s) for s in seq[len(seq) - (W - 1):]], dtype=torch.float64)
    return y, new_state


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("T", [1, 2, 7])
def test_ref_matches_float64_loop(activation, state, T):
    x, w, s = make_inputs(2, T, 5, seed=T, state=state)
    y, ns = causal_conv1d_ref(x, w, s, activation=activation)
    y64, ns64 = f64_conv(x, w, s, activation)
    assert rel_rms(y, y64) <= REF_VS_F64["y"]
    assert torch.equal(ns.double(), ns64)  # the state is a copy of inputs: exact


@pytest.mark.parametrize("T", [1, 7, 8, 63, 130])
@pytest.mark.parametrize("C", [24, 200])
@pytest.mark.parametrize("B,state", [(1, False), (3, True)])
@pytest.mark.parametrize("activation", ["silu", None])
def test_fast_matches_ref(T, C, B, state, activation):
    x, w, s = make_inputs(B, T, C, seed=T + C, state=state)
    y, ns = causal_conv1d(x, w, s, activation=activation)
    y_ref, ns_ref = causal_conv1d_ref(x, w, s, activation=activation)
    assert y.shape == (B, T, C) and ns.shape == (B, C, 3)
    assert rel_rms(y, y_ref) <= FAST_VS_REF["y"]
    assert torch.equal(ns, ns_ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T,cut", [(9, 1), (9, 2), (40, 17), (40, 39)])
def test_split_equals_single_call(impl, T, cut):
    """Two calls passing the state == one call (cuts shorter than W-1 included)."""
    fn = IMPLS[impl]
    x, w, s = make_inputs(2, T, 24, seed=cut)
    y, ns = fn(x, w, s)
    y1, s1 = fn(x[:, :cut], w, s)
    y2, s2 = fn(x[:, cut:], w, s1)
    assert rel_rms(torch.cat([y1, y2], 1), y) <= SPLIT_VS_WHOLE["y"]
    assert torch.equal(s2, ns)


@pytest.mark.parametrize("impl", IMPLS)
def test_token_by_token_decode(impl):
    """T = 1 calls, one after another, reproduce the prefill."""
    fn = IMPLS[impl]
    x, w, _ = make_inputs(1, 11, 40, seed=4, state=False)
    y, ns = fn(x, w)
    state, ys = None, []
    for t in range(11):
        y_t, state = fn(x[:, t:t + 1], w, state)
        ys.append(y_t)
    assert rel_rms(torch.cat(ys, 1), y) <= SPLIT_VS_WHOLE["y"]
    assert torch.equal(state, ns)


@pytest.mark.parametrize("T", [1, 2, 7, 8])
@pytest.mark.parametrize("state", [False, True])
def test_states_after_each_position(T, state):
    x, w, s = make_inputs(3, T, 24, seed=T, state=state)
    states = causal_conv1d_states(x, w, s)
    assert states.shape == (3, T, 24, 3)
    for t in range(T):
        _, ns_t = causal_conv1d_ref(x[:, :t + 1], w, s)
        assert torch.equal(states[:, t], ns_t)
    y, ns, states2 = causal_conv1d(x, w, s, return_states=True)
    assert torch.equal(states2, states) and torch.equal(states[:, -1], ns)
    # rolling back to position t and continuing equals running straight through
    if T > 1:
        t = T // 2 - 1
        y_rest, _ = causal_conv1d(x[:, t + 1:], w, states[:, t])
        assert rel_rms(y_rest, y[:, t + 1:]) <= SPLIT_VS_WHOLE["y"]


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_inputs_and_state_dtype(impl):
    fn = IMPLS[impl]
    x, w, s = make_inputs(2, 9, 24, seed=1, dtype=torch.bfloat16)
    y, ns = fn(x, w, s.float())
    assert y.dtype == torch.bfloat16 and ns.dtype == torch.float32
    y_ref, _ = causal_conv1d_ref(x.float(), w, s.float())
    assert rel_rms(y, y_ref) <= BF16_VS_REF["y"]
    _, ns_b = fn(x, w, s)
    assert ns_b.dtype == torch.bfloat16 and torch.equal(ns_b, ns.bfloat16())
    _, ns_none = fn(x, w)
    assert ns_none.dtype == torch.bfloat16


def test_matches_grouped_conv1d_with_left_padding():
    """Without a state the op is F.conv1d(groups=C, padding=W-1) truncated to T (Hugging Face's form)."""
    x, w, _ = make_inputs(2, 33, 24, seed=2, state=False)
    want = F.silu(F.conv1d(x.transpose(1, 2), w.unsqueeze(1), padding=3, groups=24)[..., :33]).transpose(1, 2)
    for fn in IMPLS.values():
        assert rel_rms(fn(x, w)[0], want) <= FAST_VS_REF["y"]


def test_matches_hugging_face_decode_update():
    """transformers' causal_conv1d_update ([B, C, T] layout, state updated in place) agrees."""
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    x, w, s = make_inputs(2, 3, 24, seed=8)
    hf_state = s.clone()
    y_hf = hf.causal_conv1d_update(x.transpose(1, 2), hf_state, w, None, "silu").transpose(1, 2)
    y, ns = causal_conv1d(x, w, s)
    assert rel_rms(y, y_hf) <= FAST_VS_REF["y"]
    assert torch.equal(ns, hf_state)


def test_bad_arguments_are_reported():
    x, w, s = make_inputs(2, 5, 24)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, s, activation="gelu")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_ref(x, w[:10], s)
    with pytest.raises(ValueError, match="state"):
        causal_conv1d(x, w, s[:, :, :2])
    with pytest.raises(ValueError, match="state"):
        causal_conv1d_states(x, w, s[:1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 7, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_ref(T, dtype):
    x, w, s = make_inputs(3, T, 200, seed=T, dtype=dtype, device="cuda")
    y, ns, states = causal_conv1d(x, w, s, return_states=True)
    y_ref, ns_ref = causal_conv1d_ref(x.float().cpu(), w.cpu(), s.float().cpu())
    tol = FAST_VS_REF if dtype == torch.float32 else BF16_VS_REF
    assert rel_rms(y.cpu(), y_ref) <= tol["y"]
    assert torch.equal(ns.float().cpu(), ns_ref) and torch.equal(states[:, -1], ns)
