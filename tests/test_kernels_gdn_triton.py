"""gdn_decode (Triton: one GDN layer's decode / verify token mixing in one launch) against gdn_decode_ref.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported).
Shapes are small and awkward: dk / dv 16 / 32 / 24 (not multiples of 128), Hv / Hk = 1, 2, 3, slots out of order.
"""

import os

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)

from ninfer_bench.kernels import gdn_triton as gt  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# relative RMS vs the fp32 reference, per tensor. The kernel loads exactly the values the reference reads, so only
# the order of fp32 operations differs; bf16 outputs add their rounding (the interpreter truncates bf16 stores).
TOL = {
    torch.float32: {"out": 2e-5, "ssm": 2e-5, "states_out": 2e-5},
    torch.bfloat16: {"out": 8e-3, "ssm": 2e-5, "states_out": 2e-5},
}
# the conv state is a copy of inputs: compared bit for bit

pytestmark = pytest.mark.skipif(not gt.triton_available(),
                                reason=f"triton does not import: {gt._triton_import_error()}")


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Outputs and workspaces start as NaN, so an element the kernels never write fails the comparison."""
    monkeypatch.setattr(gt, "_new_buffer", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                 device=device))


def make_case(B, T, Hk, Hv, dk, dv, *, S=5, W=4, dtype=torch.float32, seed=0):
    """Random projections and caches of S slots; row i reads slot perm[i] (out of order)."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * dk + Hv * dv
    # qkv / z / b / a as views of one fused projection output (row stride wider than each piece)
    proj = torch.randn(B, T, C + Hv * dv + 2 * Hv + 3, generator=g).to(dtype)
    qkv, z, b, a, _ = torch.split(proj, [C, Hv * dv, Hv, Hv, 3], dim=-1)
    c = dict(
        qkv=qkv, z=z, b=b, a=a - 1.0,
        conv_state=torch.randn(S, C, W - 1, generator=g).to(dtype),
        conv_w=torch.randn(C, W, generator=g) * 0.5,
        ssm=torch.randn(S, Hv, dk, dv, generator=g) * 0.5,
        slots=torch.randperm(S, generator=g)[:B],
        A_log=torch.randn(Hv, generator=g) * 0.5,
        dt_bias=torch.randn(Hv, generator=g),
        norm_w=1.0 + 0.2 * torch.randn(dv, generator=g),
    )
    c = {k: v.to(DEVICE) for k, v in c.items()}
    c["eps"] = 1e-6
    return c


def clone(c):
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in c.items()}


def rel_rms(out, ref):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite values (an unwritten element?)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def run_both(c, config=None, **kw):
    """Kernel and reference on separate copies of the caches: (kernel case, kernel out, ref case, ref out)."""
    ck, cr = clone(c), clone(c)
    kw_k = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kw.items()}
    out = gt.gdn_decode(**ck, **kw_k, config=config)
    ref = gt.gdn_decode_ref(**cr, **kw)
    return ck, out, kw_k, cr, ref, kw


def check(c, ck, out, cr, ref, dtype, kw_k=None, kw_r=None):
    tol = TOL[dtype]
    assert out.dtype == c["qkv"].dtype
    assert rel_rms(out, ref) <= tol["out"], f"out: {rel_rms(out, ref):.2e}"
    assert rel_rms(ck["ssm"], cr["ssm"]) <= tol["ssm"], f"ssm: {rel_rms(ck['ssm'], cr['ssm']):.2e}"
    assert torch.equal(ck["conv_state"], cr["conv_state"]), "conv state differs"
    if kw_k and kw_k.get("states_out") is not None:
        err = rel_rms(kw_k["states_out"], kw_r["states_out"])
        assert err <= tol["states_out"], f"states_out: {err:.2e}"
    untouched = torch.ones(c["ssm"].shape[0], dtype=torch.bool, device=DEVICE)
    untouched[c["slots"]] = False
    assert torch.equal(ck["ssm"][untouched], c["ssm"][untouched]), "a slot outside `slots` changed (ssm)"
    assert torch.equal(ck["conv_state"][untouched], c["conv_state"][untouched]), "a slot outside `slots` changed"


# (B, T, Hk, Hv, dk, dv): T = 1 / 3 / 8, B = 1 / 3, Hv / Hk = 1 / 2 / 3
SHAPES = {
    "B1-T1-r1": (1, 1, 2, 2, 16, 32),
    "B3-T1-r3": (3, 1, 1, 3, 32, 16),
    "B3-T3-r2": (3, 3, 2, 4, 16, 32),
    "B1-T8-r3": (1, 8, 1, 3, 16, 32),
    "B3-T8-r2": (3, 8, 2, 4, 32, 16),
    "B1-T3-dk24": (1, 3, 2, 4, 24, 24),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_matches_reference(shape, dtype):
    c = make_case(*SHAPES[shape], dtype=dtype)
    ck, out, _, cr, ref, _ = run_both(c)
    check(c, ck, out, cr, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dk,dv", [(16, 32), (128, 128)])
def test_tokens_give_the_bits_single_steps_give(dtype, dk, dv):
    """Token invariance (what exact speculative decoding needs): one call over T = 6 tokens gives, token by token,
    the outputs, conv windows and recurrent state of six T = 1 calls that each write the state back."""
    c = make_case(2, 6, 2, 4, dk, dv, dtype=dtype, seed=4)
    block = clone(c)
    out = gt.gdn_decode(**block)
    steps = clone(c)
    for t in range(6):
        one = {**steps, "qkv": c["qkv"][:, t:t + 1], "z": c["z"][:, t:t + 1], "b": c["b"][:, t:t + 1],
               "a": c["a"][:, t:t + 1]}
        assert torch.equal(gt.gdn_decode(**one)[:, 0], out[:, t]), f"token {t}"
    assert torch.equal(steps["ssm"], block["ssm"]) and torch.equal(steps["conv_state"], block["conv_state"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["B1-T8-r3"])
def test_states_out(shape, dtype):
    c = make_case(*SHAPES[shape], dtype=dtype, seed=1)
    B, T, _, Hv, dk, dv = SHAPES[shape]
    states = torch.full((B, T, Hv, dk, dv), float("nan"), device=DEVICE)
    ck, out, kk, cr, ref, kr = run_both(c, states_out=states)
    check(c, ck, out, cr, ref, dtype, kk, kr)
    assert torch.equal(kk["states_out"][:, -1], ck["ssm"][c["slots"]]), "last snapshot != written state"


@pytest.mark.parametrize("shape", ["B3-T8-r2"])
def test_split_v_blocks_norm_epilogue(shape):
    """block_v < dv: several programs per head (one warp each), o normalised by the second kernel."""
    c = make_case(*SHAPES[shape], seed=2)
    B, T, _, Hv, dk, dv = SHAPES[shape]
    cfg = gt.plan(dk, dv, block_v=8, num_warps=1)
    states = torch.full((B, T, Hv, dk, dv), float("nan"), device=DEVICE)
    ck, out, kk, cr, ref, kr = run_both(c, config=cfg, states_out=states)
    check(c, ck, out, cr, ref, torch.float32, kk, kr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("init", [True, False], ids=["init", "cache"])
def test_keep_rolls_back(dtype, init):
    """keep (random 1..T per row), as the speculative 'recompute' rollback: from conv_init / ssm_init (the pre-verify
    state) or from the cache; the written state equals running only the first keep[b] tokens."""
    B, T, Hk, Hv, dk, dv = 3, 8, 1, 3, 16, 32
    c = make_case(B, T, Hk, Hv, dk, dv, dtype=dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    keep = torch.tensor([1, T, int(torch.randint(2, T, (1,), generator=g))])[torch.randperm(B, generator=g)]
    keep = keep.to(DEVICE)
    kw = {"keep": keep}
    if init:
        # a pre-verify state unlike the cache rows (which the kernel must then not read)
        kw["conv_init"] = (torch.randn(B, *c["conv_state"].shape[1:], generator=g)).to(dtype).to(DEVICE)
        kw["ssm_init"] = (torch.randn(B, Hv, dk, dv, generator=g) * 0.5).to(DEVICE)
    ck, out, kk, cr, ref, kr = run_both(c, **kw)
    check(c, ck, out, cr, ref, dtype)
    # independent of the keep logic: row b run alone on its first keep[b] tokens
    for i in range(B):
        n = int(keep[i])
        one = clone(c)
        for name in ("qkv", "z", "b", "a"):
            one[name] = c[name][i:i + 1, :n]
        one["slots"] = c["slots"][i:i + 1]
        if init:
            one["conv_state"][one["slots"]] = kw["conv_init"][i:i + 1]
            one["ssm"][one["slots"]] = kw["ssm_init"][i:i + 1]
        gt.gdn_decode_ref(**one)
        s = int(c["slots"][i])
        assert rel_rms(ck["ssm"][s], one["ssm"][s]) <= TOL[dtype]["ssm"]
        assert torch.equal(ck["conv_state"][s], one["conv_state"][s])


def test_state_only_call():
    """z=None: no output, state written (the rollback form)."""
    c = make_case(*SHAPES["B3-T3-r2"], seed=5)
    keep = torch.tensor([2, 3, 1], device=DEVICE)
    ck, cr = clone(c), clone(c)
    assert gt.gdn_decode(**{**ck, "z": None}, keep=keep) is None
    gt.gdn_decode_ref(**cr, keep=keep)
    assert rel_rms(ck["ssm"], cr["ssm"]) <= TOL[torch.float32]["ssm"]
    assert torch.equal(ck["conv_state"], cr["conv_state"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layered_commit_equals_one_rollback_a_layer(dtype):
    """gdn_commit (every layer's rollback in one launch, over stacks of the caches and of the verify workspaces)
    writes bit for bit what one rollback a layer writes, and its fp32 reference agrees; verify calls writing into
    the stack give a plain verify's outputs and copy the raw conv inputs."""
    L, B, T, Hk, Hv, dk, dv = 2, 2, 5, 1, 2, 16, 24
    cases = [make_case(B, T, Hk, Hv, dk, dv, dtype=dtype, seed=20 + i) for i in range(L)]
    slots = cases[0]["slots"]
    keep = torch.tensor([T, 2], device=DEVICE)
    direct = []
    for c in cases:
        c["slots"] = slots
        d = clone(c)
        gt.gdn_decode(**{**d, "z": None}, keep=keep)
        direct.append(d)
    conv_all = torch.stack([c["conv_state"] for c in cases])
    ssm_all = torch.stack([c["ssm"] for c in cases])
    C = cases[0]["qkv"].shape[-1]
    stack = gt.new_stack(L, B, T, C, Hv, Hk, dtype, DEVICE)
    for i, c in enumerate(cases):
        own = {**c, "conv_state": conv_all[i], "ssm": ssm_all[i]}
        out = gt.gdn_decode(**own, write_state=False, workspace_out=gt.layer_of(stack, i))
        assert torch.equal(out, gt.gdn_decode(**clone(c), write_state=False))
        assert torch.equal(stack.inputs[i], c["qkv"])
    ref_conv, ref_ssm = conv_all.clone(), ssm_all.clone()
    gt.gdn_commit_ref(stack, ref_conv, ref_ssm, slots, keep)
    gt.gdn_commit(stack, conv_all, ssm_all, slots, keep)
    for i, d in enumerate(direct):
        assert torch.equal(conv_all[i], d["conv_state"]), f"layer {i} conv"
        assert torch.equal(ssm_all[i], d["ssm"]), f"layer {i} state"
    assert torch.equal(conv_all, ref_conv)
    assert rel_rms(ssm_all, ref_ssm) <= TOL[torch.float32]["ssm"]
    with pytest.raises(ValueError, match="keep"):
        gt.gdn_commit(stack, conv_all, ssm_all, slots, keep[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rollback_from_the_verify_workspace(dtype):
    """The fused 'recompute' rollback: a verify call that leaves the caches alone and writes its workspace
    (``workspace_out``), then the recurrence alone from that workspace with keep (``gdn_commit``), writes bit for bit
    what one call with keep writes (and the verify's outputs are a plain call's); a workspace of another shape is
    refused."""
    B, T, Hk, Hv, dk, dv = 3, 8, 2, 4, 16, 24
    c = make_case(B, T, Hk, Hv, dk, dv, dtype=dtype, seed=8)
    keep = torch.tensor([T, 1, 5], device=DEVICE)
    direct = clone(c)
    gt.gdn_decode(**{**direct, "z": None}, keep=keep)
    two = {**clone(c), "conv_state": c["conv_state"].clone()[None], "ssm": c["ssm"].clone()[None]}
    stack = gt.new_stack(1, B, T, c["qkv"].shape[-1], Hv, Hk, dtype, DEVICE)
    out = gt.gdn_decode(**{**two, "conv_state": two["conv_state"][0], "ssm": two["ssm"][0]}, write_state=False,
                        workspace_out=gt.layer_of(stack, 0))
    assert torch.equal(two["ssm"][0], c["ssm"]) and torch.equal(two["conv_state"][0], c["conv_state"])
    assert torch.equal(out, gt.gdn_decode(**clone(c), write_state=False))
    gt.gdn_commit(stack, two["conv_state"], two["ssm"], c["slots"], keep)
    assert torch.equal(two["ssm"][0], direct["ssm"]) and torch.equal(two["conv_state"][0], direct["conv_state"])
    short = {**clone(c), **{n: c[n][:, :4] for n in ("qkv", "z", "b", "a")}}
    with pytest.raises(ValueError, match="workspace"):
        gt.gdn_decode(**short, write_state=False, workspace_out=gt.layer_of(stack, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_state_false_leaves_caches(dtype):
    c = make_case(*SHAPES["B3-T3-r2"], dtype=dtype, seed=6)
    B, T, _, Hv, dk, dv = SHAPES["B3-T3-r2"]
    states = torch.full((B, T, Hv, dk, dv), float("nan"), device=DEVICE)
    ck, out, kk, cr, ref, kr = run_both(c, write_state=False, states_out=states)
    assert torch.equal(ck["ssm"], c["ssm"]) and torch.equal(ck["conv_state"], c["conv_state"])
    assert rel_rms(out, ref) <= TOL[dtype]["out"]
    assert rel_rms(kk["states_out"], kr["states_out"]) <= TOL[dtype]["states_out"]


def test_tokens_at_once_equal_one_at_a_time():
    """State continuation: T tokens in one call == T calls of one token (outputs and the final caches)."""
    c = make_case(2, 4, 1, 2, 16, 16, seed=7)
    whole = clone(c)
    out = gt.gdn_decode(**whole)
    step = clone(c)
    outs = []
    for t in range(4):
        one = {**step, **{n: c[n][:, t:t + 1] for n in ("qkv", "z", "b", "a")}}
        outs.append(gt.gdn_decode(**one))
    assert rel_rms(torch.cat(outs, 1), out) <= 2e-5
    assert rel_rms(step["ssm"], whole["ssm"]) <= 2e-5
    assert torch.equal(step["conv_state"], whole["conv_state"])


def test_plan_defaults():
    cfg = gt.plan(128, 128)
    assert cfg == gt.GDNConfig(block_v=32, num_warps=2)
    assert gt.plan(16, 24).block_v == 32 and gt.plan(16, 8).block_v == 8
    with pytest.raises(ValueError, match="block_v"):
        gt.GDNConfig(block_v=24, num_warps=4)
    with pytest.raises(ValueError, match="num_warps"):
        gt.GDNConfig(block_v=32, num_warps=3)


def test_bad_inputs_name_the_problem():
    c = make_case(*SHAPES["B3-T3-r2"])
    with pytest.raises(ValueError, match="z must be"):
        gt.gdn_decode(**{**c, "z": c["z"][:, :, :-1]})
    with pytest.raises(ValueError, match="ssm must be fp32"):
        gt.gdn_decode(**{**c, "ssm": c["ssm"].double()})
    with pytest.raises(ValueError, match="channels"):
        gt.gdn_decode(**{**c, "qkv": c["qkv"][..., :-1]})
    with pytest.raises(ValueError, match="T=17"):
        big = make_case(1, 17, 1, 1, 16, 16)
        gt.gdn_decode(**big)
    with pytest.raises(ValueError, match="keep must be"):
        gt.gdn_decode(**c, keep=torch.ones(2, dtype=torch.int64, device=DEVICE))


def test_module_imports_without_triton():
    triton_interp.assert_imports_without_triton("gdn_triton")
