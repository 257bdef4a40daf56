"""Gated delta rule: every implementation against the fp32 reference, and the reference against an
independent float64 derivation. Shapes are deliberately awkward (T = 1, 7, 8, 63, 65, 130; head
dims 24 / 40; grouped heads with ratios 2 and 3)."""

import pytest
import torch
import torch.nn.functional as F

from ninfer_bench.kernels import gdn
from ninfer_bench.kernels.gdn import (
    fla_available,
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_fla,
    gated_delta_rule_ref,
    gated_delta_rule_step,
    l2norm,
)

# relative RMS tolerances, ||a - b|| / ||b||, per tensor
REF_VS_F64 = {"o": 1e-5, "state": 1e-5}
CHUNKED_VS_REF = {"o": 1e-5, "state": 1e-5}
STEP_VS_REF = {"o": 1e-6, "state": 1e-6, "states": 1e-6}
SPLIT_VS_WHOLE = {"o": 1e-5, "state": 1e-5}
BF16_VS_REF = {"o": 1e-2, "state": 1e-2}  # same bf16 inputs; only the output rounding differs
FLA_BF16_VS_REF = {"o": 2e-2, "state": 2e-2}
FLA_FP32_VS_REF = {"o": 1e-3, "state": 1e-3}

IMPLS_CPU = ("ref", "chunked", "step", "auto")


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values (an unwritten element?)"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(B, T, Hk, Hv, dk, dv, *, seed=0, state=True, dtype=torch.float32, device="cpu"):
    """Normalised q/k, g from the model's parametrisation (-exp(A_log) * softplus(a + dt_bias))."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, Hk, dk, generator=gen))
    k = l2norm(torch.randn(B, T, Hk, dk, generator=gen))
    v = torch.randn(B, T, Hv, dv, generator=gen)
    a_log = torch.randn(Hv, generator=gen) * 0.5
    g = -a_log.exp() * F.softplus(torch.randn(B, T, Hv, generator=gen) - 1.0)
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=gen))
    S0 = torch.randn(B, Hv, dk, dv, generator=gen) * 0.5 if state else None
    q, k, v, beta = (x.to(device=device, dtype=dtype) for x in (q, k, v, beta))
    return (q, k, v, g.to(device), beta), (S0.to(device) if S0 is not None else None)


def f64_delta_rule(q, k, v, g, beta, scale, S0):
    """Independent float64 derivation: a python loop per (batch, v head) over time, in the product
    form S_t = e^(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t)."""
    B, T, Hk, dk = k.shape
    Hv, dv = v.shape[2:]
    group = Hv // Hk
    o = torch.full((B, T, Hv, dv), float("nan"), dtype=torch.float64)
    S_out = torch.full((B, Hv, dk, dv), float("nan"), dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    for b in range(B):
        for h in range(Hv):
            kh = h // group
            S = torch.zeros(dk, dv, dtype=torch.float64) if S0 is None else S0[b, h].double()
            for t in range(T):
                kt = k[b, t, kh].double()[:, None]  # [dk, 1]
                bt, decay = float(beta[b, t, h]), float(torch.exp(g[b, t, h].double()))
                S = decay * (eye - bt * kt @ kt.T) @ S + bt * kt @ v[b, t, h].double()[None, :]
                o[b, t, h] = S.T @ (scale * q[b, t, kh].double())
            S_out[b, h] = S
    return o, S_out


def check(got, want, tol, what=""):
    for name in tol:
        err = rel_rms(got[name], want[name])
        assert err <= tol[name], f"{what} {name}: rel RMS {err:.3g} > {tol[name]:g}"


# --- the reference itself -------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1, 2, 3])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_ref_matches_float64_derivation(ratio, state, scale):
    (q, k, v, g, beta), S0 = make_inputs(2, 9, 2, 2 * ratio, 5, 3, seed=ratio, state=state)
    o, S = gated_delta_rule_ref(q, k, v, g, beta, scale=scale, initial_state=S0)
    o64, S64 = f64_delta_rule(q, k, v, g, beta, 5 ** -0.5 if scale is None else scale, S0)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    check({"o": o, "state": S}, {"o": o64, "state": S64}, REF_VS_F64, "ref vs float64")


def test_l2norm():
    x = torch.randn(3, 7, 40) * 3
    want = x.double() / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)
    assert rel_rms(l2norm(x), want) < 1e-6
    xb = x.bfloat16()
    assert l2norm(xb).dtype == torch.bfloat16
    assert rel_rms(l2norm(xb), l2norm(xb.float())) < 1e-2


@pytest.mark.skipif(fla_available(), reason="HF would dispatch to fla instead of its torch code")
def test_ref_matches_hugging_face_conventions():
    """Grouped heads, scale and state layout agree with transformers' torch recurrence. Its model repeats each key
    head over its group (repeat_interleave) before the recurrence, which some releases of the function (5.17) then
    require: value head i reads key head i // (Hv / Hk) either way."""
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    (q, k, v, g, beta), S0 = make_inputs(2, 9, 2, 6, 24, 40, seed=12)
    o, S = gated_delta_rule_ref(q, k, v, g, beta, initial_state=S0)
    group = v.shape[2] // q.shape[2]
    qg, kg = (x.repeat_interleave(group, dim=2) for x in (q, k))
    o_hf, S_hf = hf.torch_recurrent_gated_delta_rule(qg, kg, v, g, beta, initial_state=S0, output_final_state=True)
    check({"o": o, "state": S}, {"o": o_hf, "state": S_hf}, REF_VS_F64, "ref vs transformers")


# --- chunked ----------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 7, 8, 63, 64, 65, 130])
@pytest.mark.parametrize("ratio", [1, 2, 3])
@pytest.mark.parametrize("B,state", [(1, False), (3, True), (1, True)])
def test_chunked_matches_ref(T, ratio, B, state):
    dk, dv = (24, 40) if ratio != 2 else (40, 24)
    (q, k, v, g, beta), S0 = make_inputs(B, T, 2, 2 * ratio, dk, dv, seed=T + ratio, state=state)
    o, S = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=S0)
    o_ref, S_ref = gated_delta_rule_ref(q, k, v, g, beta, initial_state=S0)
    assert o.shape == (B, T, 2 * ratio, dv) and S.shape == (B, 2 * ratio, dk, dv)
    check({"o": o, "state": S}, {"o": o_ref, "state": S_ref}, CHUNKED_VS_REF, f"chunked T={T}")


@pytest.mark.parametrize("chunk_size,block_tokens", [(1, 512), (5, 512), (16, 32), (64, 64), (200, 512)])
def test_chunked_chunk_and_block_sizes(chunk_size, block_tokens, monkeypatch):
    """Any chunk size, and several blocks per call (the last one partial) give the same result."""
    monkeypatch.setattr(gdn, "_BLOCK_TOKENS", block_tokens)
    (q, k, v, g, beta), S0 = make_inputs(2, 130, 1, 3, 24, 40, seed=5)
    o, S = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=S0, chunk_size=chunk_size)
    o_ref, S_ref = gated_delta_rule_ref(q, k, v, g, beta, initial_state=S0)
    check({"o": o, "state": S}, {"o": o_ref, "state": S_ref}, CHUNKED_VS_REF, f"chunk {chunk_size}")


def test_chunked_block_writes_every_output():
    """The block kernel writes into a preallocated output: poison it with NaN."""
    (q, k, v, g, beta), S0 = make_inputs(2, 37, 2, 4, 24, 40, seed=6)
    out = torch.full((2, 37, 4, 40), float("nan"))
    S = gdn._chunked_block(q, k, v, g, beta, S0, 24 ** -0.5, 16, out)
    o_ref, S_ref = gated_delta_rule_ref(q, k, v, g, beta, initial_state=S0)
    check({"o": out, "state": S}, {"o": o_ref, "state": S_ref}, CHUNKED_VS_REF, "block")


def test_chunked_strong_decay_stays_finite():
    """Large |g| underflows e^G inside a chunk; no exponent may be positive (no inf * 0)."""
    (q, k, v, g, beta), S0 = make_inputs(1, 130, 2, 2, 24, 40, seed=7)
    g = g * 60.0
    o, S = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=S0)
    o_ref, S_ref = gated_delta_rule_ref(q, k, v, g, beta, initial_state=S0)
    check({"o": o, "state": S}, {"o": o_ref, "state": S_ref}, CHUNKED_VS_REF, "strong decay")


# --- step -------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 2, 7, 8, 16])
@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("B", [1, 3])
def test_step_matches_ref_with_states(T, ratio, B):
    (q, k, v, g, beta), S0 = make_inputs(B, T, 2, 2 * ratio, 24, 40, seed=10 * T + B)
    S0_copy = S0.clone()
    o, S, states = gated_delta_rule_step(q, k, v, g, beta, S0, return_states=True)
    assert torch.equal(S0, S0_copy), "step must not modify the state it was given"
    o_ref, S_ref, states_ref = gated_delta_rule_ref(q, k, v, g, beta, initial_state=S0, return_states=True)
    assert states.shape == (B, T, 2 * ratio, 24, 40)
    check({"o": o, "state": S, "states": states}, {"o": o_ref, "state": S_ref, "states": states_ref},
          STEP_VS_REF, f"step T={T}")
    assert torch.equal(states[:, -1], S)
    assert torch.equal(states_ref[:, -1], S_ref)
    # states[:, t] is the final state of a run over the first t + 1 tokens
    for t in range(T):
        _, S_t = gated_delta_rule_ref(q[:, :t + 1], k[:, :t + 1], v[:, :t + 1], g[:, :t + 1],
                                      beta[:, :t + 1], initial_state=S0)
        assert rel_rms(states[:, t], S_t) <= STEP_VS_REF["states"]
        assert rel_rms(states_ref[:, t], S_t) <= STEP_VS_REF["states"]
    # without return_states: same output and state
    o2, S2 = gated_delta_rule_step(q, k, v, g, beta, S0)
    assert torch.equal(o2, o) and torch.equal(S2, S)


def test_step_result_does_not_alias_inputs():
    (q, k, v, g, beta), S0 = make_inputs(1, 1, 1, 1, 8, 8, seed=11)
    _, S, states = gated_delta_rule_step(q, k, v, g, beta, S0, return_states=True)
    S.zero_()
    assert states.abs().sum() > 0
    _, S_empty = gated_delta_rule_step(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], S0)
    assert torch.equal(S_empty, S0) and S_empty.data_ptr() != S0.data_ptr()


# --- every implementation ---------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS_CPU)
@pytest.mark.parametrize("T,cut", [(12, 5), (37, 20), (130, 64), (130, 1)])
def test_split_equals_single_call(impl, T, cut):
    (q, k, v, g, beta), S0 = make_inputs(2, T, 2, 6, 24, 40, seed=T + cut)
    def run(sl, S):
        qs, ks, vs, gs, bs = (x[:, sl] for x in (q, k, v, g, beta))
        return gated_delta_rule(qs, ks, vs, gs, bs, initial_state=S, impl=impl)

    o, S = run(slice(None), S0)
    o1, S1 = run(slice(0, cut), S0)
    o2, S2 = run(slice(cut, None), S1)
    check({"o": torch.cat([o1, o2], 1), "state": S2}, {"o": o, "state": S}, SPLIT_VS_WHOLE, impl)


@pytest.mark.parametrize("impl", IMPLS_CPU)
@pytest.mark.parametrize("T", [1, 7, 63])
def test_dispatch_matches_ref_without_state(impl, T):
    (q, k, v, g, beta), _ = make_inputs(1, T, 1, 2, 24, 40, seed=T, state=False)
    o, S = gated_delta_rule(q, k, v, g, beta, impl=impl)
    o_ref, S_ref = gated_delta_rule_ref(q, k, v, g, beta)
    check({"o": o, "state": S}, {"o": o_ref, "state": S_ref}, CHUNKED_VS_REF, impl)


@pytest.mark.parametrize("impl", IMPLS_CPU)
def test_bf16_inputs(impl):
    (q, k, v, g, beta), S0 = make_inputs(2, 21, 2, 4, 24, 40, seed=3, dtype=torch.bfloat16)
    o, S = gated_delta_rule(q, k, v, g, beta, initial_state=S0, impl=impl)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_ref, S_ref = gated_delta_rule_ref(*(x.float() for x in (q, k, v, g, beta)), initial_state=S0)
    check({"o": o, "state": S}, {"o": o_ref, "state": S_ref}, BF16_VS_REF, f"bf16 {impl}")


def test_bad_arguments_are_reported():
    (q, k, v, g, beta), S0 = make_inputs(1, 4, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="impl"):
        gated_delta_rule(q, k, v, g, beta, impl="triton")
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_rule_ref(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="state"):
        gated_delta_rule_chunked(q, k, v, g, beta, initial_state=S0[:, :2])
    with pytest.raises(ValueError, match="beta"):
        gated_delta_rule_step(q, k, v, g, beta[:, :2], S0)


@pytest.mark.skipif(fla_available(), reason="fla is importable here")
def test_fla_missing_is_a_clear_error():
    (q, k, v, g, beta), _ = make_inputs(1, 4, 1, 1, 8, 8)
    with pytest.raises(RuntimeError, match="flash-linear-attention|CUDA"):
        gated_delta_rule_fla(q, k, v, g, beta)


# --- fla (GPU) --------------------------------------------------------------------------------

needs_fla = pytest.mark.skipif(
    not torch.cuda.is_available() or not fla_available(), reason="needs CUDA and flash-linear-attention"
)


@pytest.mark.cuda
@needs_fla
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, FLA_BF16_VS_REF), (torch.float32, FLA_FP32_VS_REF)])
@pytest.mark.parametrize("T", [1, 7, 63, 130])
@pytest.mark.parametrize("ratio,dk,dv", [(1, 64, 64), (3, 128, 128), (2, 40, 24)])
def test_fla_matches_ref(dtype, tol, T, ratio, dk, dv):
    (q, k, v, g, beta), S0 = make_inputs(2, T, 2, 2 * ratio, dk, dv, seed=T, dtype=dtype, device="cuda")
    o, S = gated_delta_rule_fla(q, k, v, g, beta, initial_state=S0)
    assert o.dtype == dtype and S.dtype == torch.float32
    o_ref, S_ref = gated_delta_rule_ref(*(x.float() for x in (q, k, v, g, beta)), initial_state=S0)
    check({"o": o, "state": S}, {"o": o_ref, "state": S_ref}, tol, f"fla {dtype}")


@pytest.mark.cuda
@needs_fla
def test_fla_grouped_values_equal_repeated_heads(monkeypatch):
    """Where fla takes grouped values itself (v head j reads q/k head j // ratio), its output is what q and k
    repeated to the v heads give."""
    (q, k, v, g, beta), S0 = make_inputs(2, 130, 2, 6, 128, 128, seed=3, dtype=torch.bfloat16, device="cuda")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    if not gdn._fla_gva(chunk_gated_delta_rule):
        pytest.skip("this fla has no grouped-value support: q and k are repeated")
    o, S = gated_delta_rule_fla(q, k, v, g, beta, initial_state=S0)
    monkeypatch.setattr(gdn, "_fla_gva", lambda fn: False)
    o_rep, S_rep = gated_delta_rule_fla(q, k, v, g, beta, initial_state=S0)
    check({"o": o, "state": S}, {"o": o_rep, "state": S_rep}, FLA_BF16_VS_REF, "fla grouped values")


@pytest.mark.cuda
@needs_fla
def test_fla_split_equals_single_call():
    (q, k, v, g, beta), S0 = make_inputs(2, 150, 2, 6, 64, 64, seed=1, device="cuda")
    def run(sl, S):
        return gated_delta_rule_fla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=S)

    o, S = run(slice(None), S0)
    o1, S1 = run(slice(0, 70), S0)
    o2, S2 = run(slice(70, None), S1)
    check({"o": torch.cat([o1, o2], 1), "state": S2}, {"o": o, "state": S}, FLA_FP32_VS_REF, "fla split")
