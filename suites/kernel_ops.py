"""The kernels suite's op families other than the projections (``suites/kernel_projections.py``): the hot decode
ops of the hybrid model at a model config's real shapes.

Each entry builds, for T new tokens of one sequence, seeded random inputs, an fp32 reference and the v2 / v3
implementations (suites/kernels.py says what the variants are and what a record holds). Families:

  projection  every weight projection of a decode step, in its stored format, and the row-concatenations v3
              launches as one: ``suites/kernel_projections.py``
  attention   decode attention over one layer's int8 K/V cache, at each context length
  gdn         the gated delta rule step from an fp32 state; the fused GDN token mixer (conv, gates, L2 norms,
              recurrence, gated norm) when kernels/gdn_triton.py imports
  conv        the GDN depthwise causal conv1d with its state
  norm        zero-centred RMSNorm over the hidden size; gated RMSNorm per GDN head
  glue        kernels/fused.py, when it imports: add + RMSNorm, SiLU * up, the attention prologue
  sampling    temperature / top-k / top-p over the vocabulary, every row in one batched call (the engine's
              sample_rows); reference: the distribution in fp64

Importing this module registers them (``suites/kernel_registry.py`` imports both family modules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine.sampling import RowSampling, SamplingParams, batch_probs, sample_rows
from ..kernels import attn_cuda
from ..kernels.attention import attention
from ..kernels.attention_triton import decode_attention, decode_attention_ref
from ..kernels.attention_triton import triton_available as attention_triton_available
from ..kernels.conv import causal_conv1d, causal_conv1d_ref
from ..kernels.gdn import gated_delta_rule_ref, gated_delta_rule_step, l2norm
from ..kernels.kv_quant import KV_GROUP, dequantize_kv, quantize_kv
from ..kernels.norm import gated_rms_norm, gated_rms_norm_ref, rms_norm, rms_norm_ref
from ..kernels.rope import apply_rope, rope_tables
from .kernel_cases import Case, Impl, KernelContext, optional_kernels, register, v3_impl

F32 = torch.float32


# ---- attention ---------------------------------------------------------------------------------------------
def _int8_cache(ctx: KernelContext, length: int):
    """One layer's K/V of one slot: int8 codes [1, Hkv, L, hd] and fp16 scales [1, Hkv, L, ceil(hd/64)], each."""
    c = ctx.cfg
    g = ctx.generator("attn.cache", length)
    k, ks = quantize_kv(ctx.randn(1, c.num_key_value_heads, length, c.head_dim, gen=g, dtype=F32))
    v, vs = quantize_kv(ctx.randn(1, c.num_key_value_heads, length, c.head_dim, gen=g, dtype=F32))
    return k, v, ks, vs


@register(op="attn.decode_int8", family="attention", tolerance=(1e-4, 1.5e-2), params=lambda ctx: ctx.contexts)
def _attention(ctx: KernelContext, t: int, length: int) -> Case:
    c = ctx.cfg
    h, hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    kc, vc, ks, vs = ctx.memo(("kv", length), lambda: _int8_cache(ctx, length))
    q = ctx.randn(1, t, h, hd, gen=ctx.generator("attn.q", length, t))  # [B, T, H, hd]
    gate = ctx.randn(1, t, h * hd, gen=ctx.generator("attn.gate", length, t))  # the output gate (q_proj's half)
    slots = torch.zeros(1, dtype=torch.long, device=ctx.device)
    q_pos = torch.arange(length - t, length, device=ctx.device)[None]  # the T new tokens end the context
    scale = hd ** -0.5

    def eager():  # runtime v2: HybridCache.read_kv dequantizes the valid length, SDPA, then the output gate
        kk = dequantize_kv(kc[slots, :, :length], ks[slots, :, :length], ctx.dtype)
        vv = dequantize_kv(vc[slots, :, :length], vs[slots, :, :length], ctx.dtype)
        return attention(q, kk, vv, q_pos, scale) * torch.sigmoid(gate.view(1, t, h, hd))

    def fast():  # runtime v3: the gate applied as the kernel stores the output (engine/model/fused_forward.py)
        return decode_attention(q, kc, vc, ks, vs, slots, q_pos, scale, kv_len_max=length, gate=gate)

    cuda_split = attn_cuda.wanted(q, kc, vc, ks, vs, slots, q_pos)  # the kernel decode_attention takes here
    what = (f"tensor-core {'attn_split' if t == 1 else 'attn_verify'} (kernels/attn_cuda.cu) + Triton combine"
            if cuda_split else "Triton decode attention")
    cache_bytes = 2 * (kc.numel() + 2 * ks.numel())  # codes + fp16 scales of K and V for the valid length
    return Case([1, hkv, length, hd], cache_bytes + 3 * q.numel() * ctx.elt,
                lambda: decode_attention_ref(q.float(), kc, vc, ks, vs, slots, q_pos, scale, gate=gate.float()),
                {"v2": Impl(eager, "dequantized K/V copy + SDPA + o * sigmoid(gate)"),
                 "v3": v3_impl(ctx, Impl(fast, f"{what} on the int8 cache, gated as it stores"),
                           Impl(eager, "dequantized K/V copy + SDPA + o * sigmoid(gate)"),
                           attention_triton_available())},
                {"context": length, "kv_dtype": "int8"})


# ---- Gated DeltaNet ----------------------------------------------------------------------------------------
def _gdn_dims(c):
    return c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim


def _as_v2(impl: Impl) -> dict[str, Impl]:
    """v2 and v3 run the same torch op (v3's CUDA decode fuses it into gdn.mixer when that kernel is present)."""
    more = " (v3's CUDA decode fuses it into gdn.mixer)" if optional_kernels("gdn_triton", runnable=True) else ""
    return {"v2": impl, "v3": Impl(impl.run, f"{impl.note}, as v2{more}", impl.check)}


@register(op="gdn.step", family="gdn", tolerance=(1e-4, 1e-2))
def _gdn_step(ctx: KernelContext, t: int, _param) -> Case:
    c = ctx.cfg
    hk, hv, dk, dv = _gdn_dims(c)
    g = ctx.generator("gdn.step", t)
    q, k = (l2norm(ctx.randn(1, t, hk, dk, gen=g)) for _ in range(2))  # [B, T, Hk, dk]
    v = ctx.randn(1, t, hv, dv, gen=g)
    decay = -torch.exp(ctx.randn(hv, gen=g, dtype=F32)) * F.softplus(ctx.randn(1, t, hv, gen=g, dtype=F32))
    beta = torch.sigmoid(ctx.randn(1, t, hv, gen=g, dtype=F32))
    state = ctx.randn(1, hv, dk, dv, gen=g, dtype=F32, scale=0.1)  # [B, Hv, dk, dv]

    def step():
        return gated_delta_rule_step(q, k, v, decay, beta, state)

    moved = 2 * state.numel() * 4 + (2 * q.numel() + 2 * v.numel()) * ctx.elt + 2 * decay.numel() * 4
    return Case([1, hv, dk, dv], moved,
                lambda: gated_delta_rule_ref(q.float(), k.float(), v.float(), decay, beta, initial_state=state),
                _as_v2(Impl(step, "torch step loop")))


def _gdn_mixer_eager(cfg):
    """Runtime v2's GDN token mixing between the projections (engine/model/hybrid.py ``gated_deltanet``, decode),
    with gdn_decode's signature."""
    hk, hv, dk, dv = _gdn_dims(cfg)

    def mixer(qkv, z, b, a, conv_state, conv_w, ssm, slots, A_log, dt_bias, norm_w, eps):
        bsz, t, _ = qkv.shape
        y, conv_new = causal_conv1d(qkv, conv_w, conv_state[slots])
        q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k = l2norm(q.reshape(bsz, t, hk, dk)), l2norm(k.reshape(bsz, t, hk, dk))
        beta = torch.sigmoid(b.float())
        g = -torch.exp(A_log) * F.softplus(a.float() + dt_bias)
        o, state = gated_delta_rule_step(q, k, v.reshape(bsz, t, hv, dv), g, beta, ssm[slots])
        conv_state[slots] = conv_new.to(conv_state.dtype)
        ssm[slots] = state
        o = gated_rms_norm(o.to(qkv.dtype), z.view(bsz, t, hv, dv), norm_w, eps)
        return o.reshape(bsz, t, hv * dv)

    return mixer


@register(op="gdn.mixer", family="gdn", tolerance=(1e-4, 1e-2), requires="gdn_triton")
def _gdn_mixer(ctx: KernelContext, t: int, _param) -> Case:
    mod = optional_kernels("gdn_triton")
    c = ctx.cfg
    (_, hv, dk, dv), cdim, w = _gdn_dims(c), c.conv_dim, c.linear_conv_kernel_dim
    g = ctx.generator("gdn.mixer", t)
    qkv, z = ctx.randn(1, t, cdim, gen=g), ctx.randn(1, t, hv * dv, gen=g)
    b, a = ctx.randn(1, t, hv, gen=g), ctx.randn(1, t, hv, gen=g)
    conv_state = ctx.randn(1, cdim, w - 1, gen=g)  # [S, C, W-1]
    conv_w = ctx.randn(cdim, w, gen=g, dtype=F32, scale=0.5)
    ssm = ctx.randn(1, hv, dk, dv, gen=g, dtype=F32, scale=0.1)  # [S, Hv, dk, dv]
    A_log, dt_bias = ctx.randn(hv, gen=g, dtype=F32, scale=0.5), ctx.randn(hv, gen=g, dtype=F32, scale=0.5)
    norm_w = 1 + ctx.randn(dv, gen=g, dtype=F32, scale=0.1)
    slots = torch.zeros(1, dtype=torch.long, device=ctx.device)

    def impl(fn, note="", cast=None) -> Impl:
        """Timed on its own copy of the caches (updated every call); checked from fresh copies."""
        def call(cs, sm):
            ins = (qkv, z, b, a) if cast is None else tuple(x.to(cast) for x in (qkv, z, b, a))
            return fn(*ins, cs, conv_w, sm, slots, A_log, dt_bias, norm_w, c.rms_norm_eps)

        def check():
            cs, sm = conv_state.clone().to(cast or conv_state.dtype), ssm.clone()
            return call(cs, sm), cs, sm

        cs_run, sm_run = conv_state.clone(), ssm.clone()
        return Impl(lambda: call(cs_run, sm_run), note, check)

    eager = impl(_gdn_mixer_eager(c), "eager torch: conv, gates, step loop, gated norm")
    v3 = v3_impl(ctx, impl(mod.gdn_decode, "fused Triton gdn_decode"), eager, mod.triton_available())
    moved = (t * (cdim + hv * dv + 2 * hv) + 2 * conv_state.numel() + t * hv * dv) * ctx.elt \
        + (2 * ssm.numel() + conv_w.numel() + 2 * hv + dv) * 4
    return Case([1, hv, dk, dv], moved, impl(mod.gdn_decode_ref, cast=F32).check, {"v2": eager, "v3": v3})


@register(op="gdn.conv", family="conv", tolerance=(1e-5, 1e-2))
def _conv(ctx: KernelContext, t: int, _param) -> Case:
    c = ctx.cfg
    g = ctx.generator("gdn.conv", t)
    x = ctx.randn(1, t, c.conv_dim, gen=g)  # [B, T, C]
    w = ctx.randn(c.conv_dim, c.linear_conv_kernel_dim, gen=g, dtype=F32, scale=0.5)
    state = ctx.randn(1, c.conv_dim, c.linear_conv_kernel_dim - 1, gen=g)  # [B, C, W-1]
    moved = (2 * x.numel() + 2 * state.numel()) * ctx.elt + w.numel() * 4
    return Case([1, c.conv_dim, c.linear_conv_kernel_dim], moved,
                lambda: causal_conv1d_ref(x.float(), w, state.float()),
                _as_v2(Impl(lambda: causal_conv1d(x, w, state), "torch depthwise conv")))


# ---- norms and glue ----------------------------------------------------------------------------------------
@register(op="norm.rms", family="norm", tolerance=(1e-5, 1e-2))
def _rms(ctx: KernelContext, t: int, _param) -> Case:
    c, fused = ctx.cfg, optional_kernels("fused", runnable=True)
    g = ctx.generator("norm.rms", t)
    x, w = ctx.randn(t, c.hidden_size, gen=g), ctx.randn(c.hidden_size, gen=g, dtype=F32, scale=0.1)
    eager = Impl(lambda: rms_norm(x, w, c.rms_norm_eps), "torch F.rms_norm")
    fast = Impl(lambda: fused.rms_norm(x, w, c.rms_norm_eps), "Triton rms_norm (kernels/fused.py)")
    v3 = v3_impl(ctx, fast, eager, fused is not None)
    return Case([t, c.hidden_size], 2 * x.numel() * ctx.elt + w.numel() * 4,
                lambda: rms_norm_ref(x.float(), w, c.rms_norm_eps), {"v2": eager, "v3": v3})


@register(op="norm.gated", family="norm", tolerance=(1e-5, 1e-2))
def _gated_norm(ctx: KernelContext, t: int, _param) -> Case:
    c = ctx.cfg
    _, hv, _, dv = _gdn_dims(c)
    g = ctx.generator("norm.gated", t)
    x, z = ctx.randn(1, t, hv, dv, gen=g), ctx.randn(1, t, hv, dv, gen=g)
    w = 1 + ctx.randn(dv, gen=g, dtype=F32, scale=0.1)
    return Case([1, t, hv, dv], 3 * x.numel() * ctx.elt + w.numel() * 4,
                lambda: gated_rms_norm_ref(x.float(), z.float(), w, c.rms_norm_eps),
                _as_v2(Impl(lambda: gated_rms_norm(x, z, w, c.rms_norm_eps), "torch F.rms_norm * silu(z)")))


def _glue(ctx: KernelContext, name: str, eager: Impl, fast, moved: int, shape, ref) -> Case:
    """A kernels/fused.py op: v2 the eager torch ops the engine runs, v3 the Triton kernel ``name`` (on CUDA)."""
    fast = fast if isinstance(fast, Impl) else Impl(fast)
    fast.note = f"Triton {name} (kernels/fused.py)"
    v3 = v3_impl(ctx, fast, eager, optional_kernels("fused", runnable=True) is not None)
    return Case(list(shape), moved, ref, {"v2": eager, "v3": v3})


@register(op="glue.add_rms_norm", family="glue", tolerance=(1e-5, 1e-2), requires="fused")
def _add_rms_norm(ctx: KernelContext, t: int, _param) -> Case:
    fz, c = optional_kernels("fused"), ctx.cfg
    g = ctx.generator("glue.add_rms_norm", t)
    x, res = ctx.randn(t, c.hidden_size, gen=g), ctx.randn(t, c.hidden_size, gen=g)
    w, eps = ctx.randn(c.hidden_size, gen=g, dtype=F32, scale=0.1), c.rms_norm_eps

    def eager():  # the decoder block's h = h + f(x); rms_norm(h)
        r = x + res
        return rms_norm(r, w, eps), r

    return _glue(ctx, "add_rms_norm", Impl(eager, "eager add + F.rms_norm"), lambda: fz.add_rms_norm(x, res, w, eps),
                 4 * x.numel() * ctx.elt + w.numel() * 4, x.shape,
                 lambda: fz.add_rms_norm_ref(x.float(), res.float(), w, eps))


@register(op="glue.silu_mul", family="glue", tolerance=(1e-5, 1e-2), requires="fused")
def _silu_mul(ctx: KernelContext, t: int, _param) -> Case:
    fz, inter = optional_kernels("fused"), ctx.cfg.intermediate_size
    gu = ctx.randn(t, 2 * inter, gen=ctx.generator("glue.silu_mul", t))  # [T, 2I]: gate | up

    def eager():  # engine/model/hybrid.py mlp: silu(gate) * up
        gate, up = gu.split(inter, dim=-1)
        return F.silu(gate) * up

    return _glue(ctx, "silu_mul", Impl(eager, "eager F.silu(gate) * up"), lambda: fz.silu_mul(gu, inter),
                 3 * t * inter * ctx.elt, gu.shape, lambda: fz.silu_mul_ref(gu.float(), inter))


def _prologue_eager(qg, kv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, k_scale, v_scale, slots, pos, eps):
    """Runtime v2's full attention between the projections and attention (engine/model/hybrid.py ``attention``)."""
    b, t, h, hd2 = qg.shape
    hd, hkv = hd2 // 2, k_cache.shape[1]
    q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, h * hd)
    k, v = kv.split(hkv * hd, dim=-1)
    q = rms_norm(q, q_norm_w, eps)
    k = rms_norm(k.view(b, t, hkv, hd), k_norm_w, eps)
    c, s = cos[pos], sin[pos]
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    sl = slots[:, None].expand(b, t)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v.view(b, t, hkv, hd))
    k_cache[sl, :, pos], v_cache[sl, :, pos], k_scale[sl, :, pos], v_scale[sl, :, pos] = kq, vq, ks, vs
    return q, gate


@register(op="glue.attn_prologue", family="glue", tolerance=(1e-4, 1.5e-2), requires="fused")
def _attn_prologue(ctx: KernelContext, t: int, _param) -> Case:
    fz, c = optional_kernels("fused"), ctx.cfg
    h, hkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    cap, ng = max(256, 2 * t), -(-hd // KV_GROUP)
    g = ctx.generator("glue.attn_prologue", t)
    qg, kv = ctx.randn(1, t, h, 2 * hd, gen=g), ctx.randn(1, t, 2 * hkv * hd, gen=g)
    qw, kw = ctx.randn(hd, gen=g, dtype=F32, scale=0.1), ctx.randn(hd, gen=g, dtype=F32, scale=0.1)
    cos, sin = rope_tables(c.rotary_dim, c.rope_theta, cap, ctx.device)
    slots = torch.zeros(1, dtype=torch.long, device=ctx.device)
    pos = torch.arange(cap - t, cap, device=ctx.device)[None]  # [B, T]
    codes = torch.randint(-127, 128, (1, hkv, cap, hd), generator=g, device=ctx.device, dtype=torch.int8)
    scales = ctx.randn(1, hkv, cap, ng, gen=g, dtype=F32, scale=0.01).abs().to(torch.float16)

    def impl(fn, note="", cast=None) -> Impl:
        """Timed on its own copy of the cache; checked on a fresh one."""
        def call(cache):
            ins = (qg, kv) if cast is None else (qg.to(cast), kv.to(cast))
            return fn(*ins, qw, kw, cos, sin, *cache, slots, pos, eps)

        def check():  # outputs, and the K/V rows written into a fresh cache (dequantized)
            cache = (codes.clone(), codes.clone(), scales.clone(), scales.clone())
            q, gate = call(cache)
            rows = [dequantize_kv(x[0, :, pos[0]], s[0, :, pos[0]], F32) for x, s in zip(cache[:2], cache[2:])]
            return q, gate, *rows

        cache_run = (codes.clone(), codes.clone(), scales.clone(), scales.clone())
        return Impl(lambda: call(cache_run), note, check)

    moved = (qg.numel() + kv.numel() + 2 * t * h * hd) * ctx.elt + 2 * t * hkv * (hd + 2 * ng) \
        + (2 * t * c.rotary_dim + 2 * hd) * 4  # in, q and gate out, K/V rows written, cos/sin rows, norm weights
    return _glue(ctx, "attn_prologue", impl(_prologue_eager, "eager norms, RoPE, quantize_kv, cache writes"),
                 impl(fz.attn_prologue), moved, [1, t, h, 2 * hd], impl(fz.attn_prologue_ref, cast=F32).check)


# ---- sampling ----------------------------------------------------------------------------------------------
SAMPLING = SamplingParams(temperature=0.8, top_p=0.95, top_k=50)


def _probs_fp64(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling distribution of engine.sampling.probs, restated in fp64 (the reference)."""
    x = logits.double() / p.temperature
    kth = torch.topk(x, min(p.top_k, x.shape[-1]), dim=-1).values[..., -1:]
    pr = torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)
    sorted_p, order = torch.sort(pr, dim=-1, descending=True)
    keep = torch.zeros_like(pr, dtype=torch.bool).scatter(-1, order, sorted_p.cumsum(-1) - sorted_p < p.top_p)
    pr = pr * keep
    return pr / pr.sum(-1, keepdim=True)


@register(op="sample.top_k_top_p", family="sampling", tolerance=(1e-5, 1e-5))
def _sampling(ctx: KernelContext, t: int, _param) -> Case:
    vocab = ctx.cfg.vocab_size
    logits = ctx.randn(t, vocab, gen=ctx.generator("sample.logits", t), dtype=F32, scale=3.0)  # [T, V] fp32
    rows = RowSampling.make([SAMPLING] * t, list(range(t)), [0] * t, logits.device)  # a step's rows, made once
    run = Impl(lambda: sample_rows(logits, rows), "engine.sampling.sample_rows (one path in both runtimes)",
               check=lambda: batch_probs(logits, rows))
    return Case([t, vocab], t * vocab * 4 + t * 8, lambda: _probs_fp64(logits, SAMPLING), {"v2": run, "v3": run},
                {"temperature": SAMPLING.temperature, "top_k": SAMPLING.top_k, "top_p": SAMPLING.top_p})
