"""The v3 decode/verify path: the same layer math as :mod:`engine.model`, through the fused Triton kernels.

Per GDN layer one ``gdn_decode`` (conv, norms, gates, recurrence, gated RMSNorm) replaces the eager T-step
loop; per attention layer ``attn_prologue`` (q/k norms, partial RoPE, the K/V cache write, int8 quantization)
+ ``decode_attention`` + ``sigmoid_mul``; between layers ``add_rms_norm`` folds each residual add into the
next norm, and ``silu_mul`` the MLP gate. Used on CUDA (runtime v3) for decode and verify steps; prefill
keeps the eager path (its matmuls are compute-bound and fla runs its recurrence). Under ``TRITON_INTERPRET=1``
the same code runs on CPU tensors, which is how the tests check it against the eager path.

Inside a CUDA-graph capture (``side_stream``, on by default) the GDN layer's b / a projection (a few row tiles)
runs on a side stream, forked after the layer's norm and joined before its token mixing: a branch of the graph
that runs beside the qkvz projection (hundreds of tiles) instead of a launch of its own in the chain.

Speculative rollback with these kernels: ``recompute`` verifies with ``write_state=False`` (the cache keeps the
pre-verify state) and commits by re-running the block's recurrence with ``keep``; ``snapshot`` verifies
writing the state after every position into a buffer and commits by gathering from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import fused
from ..kernels.attention_triton import decode_attention
from ..kernels.gdn_triton import gdn_decode
from .cache import HybridCache, PendingGDN


@dataclass(slots=True)
class GDNParams:
    """A GDN layer's small tensors in the layout the kernel wants (made once)."""

    conv_w: torch.Tensor  # [C, W] fp32 contiguous
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_w: torch.Tensor


def available() -> bool:
    from ..kernels.attention_triton import triton_available

    return triton_available()


class FastPath:
    """Decode / verify forwards of a :class:`HybridModel` through the fused kernels."""

    def __init__(self, model, *, side_stream: bool = True):
        self.m = model
        self.cfg, self.w = model.cfg, model.w
        self.gdn: dict[str, GDNParams] = {}
        # made here: not inside a capture
        self.side = torch.cuda.Stream(model.device) if side_stream and model.device.type == "cuda" else None
        self.branches = 0  # launch sequences captured on the side stream so far

    def _beside(self, short, long):
        """``(short(), long())``: two launch sequences that read the same inputs and not each other's outputs. In a
        CUDA-graph capture the short one goes on the side stream, a branch of the graph beside the long one, joined
        before anything after them; otherwise they run one after the other. The side stream waits for everything
        queued on the main one first, so a buffer it reuses is never still being read there."""
        if self.side is None or not torch.cuda.is_current_stream_capturing():
            return short(), long()
        main = torch.cuda.current_stream(self.m.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            first = short()
        self.branches += 1
        second = long()
        main.wait_stream(self.side)
        return first, second

    def params(self, p: str) -> GDNParams:
        if p not in self.gdn:
            a = f"{p}.linear_attn"
            v = self.w.vector
            self.gdn[p] = GDNParams(v(f"{a}.conv1d.weight").reshape(self.cfg.conv_dim, -1).float().contiguous(),
                                    v(f"{a}.A_log").float().contiguous(), v(f"{a}.dt_bias").float().contiguous(),
                                    v(f"{a}.norm.weight").float().contiguous())
        return self.gdn[p]

    def gated_deltanet(self, p: str, i: int, x, step, cache: HybridCache):
        cfg, m = self.cfg, self.m
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        (bb, aa), (qkv, z) = self._beside(
            lambda: m._proj(p, "linear_attn.in_proj_ba", ("linear_attn.in_proj_b", "linear_attn.in_proj_a"), [hv, hv],
                            x),
            lambda: m._proj(p, "linear_attn.in_proj_qkvz", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
                            [cfg.conv_dim, cfg.value_dim], x))
        prm = self.params(p)
        args = (cache.conv[i], prm.conv_w, cache.ssm[i], step.slots, prm.A_log, prm.dt_bias, prm.norm_w,
                cfg.rms_norm_eps)
        if step.mode == "verify":
            b, t, _ = qkv.shape
            rec = PendingGDN(conv_in=qkv, conv_old=None)
            if cache.rollback == "snapshot":
                rec.conv_old = cache.conv[i][step.slots]
                rec.states = torch.empty(b, t, hv, dk, dv, dtype=torch.float32, device=x.device)
                o = gdn_decode(qkv, z, bb, aa, *args, states_out=rec.states)
            else:
                rec.kernel = (bb, aa, prm)
                o = gdn_decode(qkv, z, bb, aa, *args, write_state=False)
            cache.record(i, rec)
        else:
            o = gdn_decode(qkv, z, bb, aa, *args)
        return self.w.linear(f"{p}.linear_attn.out_proj.weight")(o)

    def attention(self, p: str, key, x, step, cache: HybridCache):
        cfg, m, w = self.cfg, self.m, self.w
        b, t, _ = x.shape
        h, hd = cfg.num_attention_heads, cfg.head_dim
        qg, kv = m.attn_proj(p, x)
        c = cache.kv[key]
        q, gate = fused.attn_prologue(qg, kv, w.vector(f"{p}.self_attn.q_norm.weight"),
                                      w.vector(f"{p}.self_attn.k_norm.weight"), m.cos, m.sin, c.k, c.v,
                                      c.k_scale, c.v_scale, step.slots, step.pos, cfg.rms_norm_eps)
        o = decode_attention(q, c.k, c.v, c.k_scale, c.v_scale, step.slots, step.pos, m.scale,
                             kv_len_max=cache.capacity)
        return w.linear(f"{p}.self_attn.o_proj.weight")(fused.sigmoid_mul(o.reshape(b, t, h * hd), gate))

    def mlp(self, p: str, x):
        i = self.cfg.intermediate_size
        name = f"{p}.mlp.gate_up_proj.weight"
        if name in self.w.linears:
            act = fused.silu_mul(self.w.linear(name)(x), i)
        else:
            act = torch.nn.functional.silu(self.w.linear(f"{p}.mlp.gate_proj.weight")(x)) * \
                self.w.linear(f"{p}.mlp.up_proj.weight")(x)
        return self.w.linear(f"{p}.mlp.down_proj.weight")(act)

    def forward(self, step, cache: HybridCache):
        """Final-normed hidden ``[B, T, H]`` and tap outputs, with each residual add fused into the next norm."""
        cfg, w = self.cfg, self.w
        eps = cfg.rms_norm_eps
        names = [f"model.layers.{i}" for i in range(cfg.num_hidden_layers)]
        h = w.embed(step.ids)
        x = fused.rms_norm(h, w.vector(f"{names[0]}.input_layernorm.weight"), eps)
        taps = []
        for i, (p, kind) in enumerate(zip(names, cfg.layer_types)):
            y = self.gated_deltanet(p, i, x, step, cache) if kind == "linear_attention" \
                else self.attention(p, i, x, step, cache)
            x, h = fused.add_rms_norm(y, h, w.vector(f"{p}.post_attention_layernorm.weight"), eps)
            nxt = f"{names[i + 1]}.input_layernorm.weight" if i + 1 < len(names) else "model.norm.weight"
            x, h = fused.add_rms_norm(self.mlp(p, x), h, w.vector(nxt), eps)
            if i in step.taps:
                taps.append(h)
        return x, taps


def commit_kernel(cache: HybridCache, i: int, slots: torch.Tensor, rec: PendingGDN, keep: torch.Tensor) -> None:
    """``recompute`` rollback of one layer: re-run the verified block from the pre-verify state (still in the
    cache), applying only the first ``keep[b]`` positions, and write conv and recurrent state."""
    bb, aa, prm = rec.kernel
    gdn_decode(rec.conv_in, None, bb, aa, cache.conv[i], prm.conv_w, cache.ssm[i], slots, prm.A_log, prm.dt_bias,
               prm.norm_w, cache.cfg.rms_norm_eps, keep=keep)
