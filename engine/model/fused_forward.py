"""The v3 decode/verify path: the same layer math as :mod:`engine.model.hybrid`, through the fused Triton kernels.

Per GDN layer one ``gdn_decode`` (conv, norms, gates, recurrence, gated RMSNorm) replaces the eager T-step
loop; per attention layer ``attn_prologue`` (q/k norms, partial RoPE, the K/V cache write, int8 quantization)
+ ``decode_attention`` (which applies the output gate as it stores the output); between layers ``add_rms_norm``
folds each residual add into the next norm, and ``silu_mul`` (or qmv's epilogue) the MLP gate. Used on CUDA
(runtime v3) for decode and verify steps. Prefill keeps the eager path (its matmuls are compute-bound and fla
runs its recurrence) except full attention, which with ``flash_prefill`` (the default) runs ``attn_prologue`` +
``prefill_attention_cached`` (kernels/attention_prefill.py: flash style over the chunk's keys, an int8 cache
dequantized to a bf16 copy first) through :meth:`FastPath.attention` too; with ``fused_prefill`` a whole chunk runs
:meth:`FastPath.forward` (``prefill=True``). Under ``TRITON_INTERPRET=1`` the same code runs on CPU tensors, which is
how the tests check it against the eager path.

Inside a CUDA-graph capture (``side_stream``, on by default) a GDN layer's b / a and z projections run on two side
streams, forked after the layer's norm: graph branches beside the main chain. b / a (a few row tiles) runs beside
the qkv projection and joins before the token mixing; z (whose weight the engine then keeps apart from qkv's) runs
beside the qkv projection and the latency-bound mixing kernels, and joins just before the gated norm reads it.
Those projections take K in one pass, branch or not (:func:`kernels._triton.single_pass`): a split-K launch on a
branch would share the device's split-K scratch with the main chain's launches running at the same time.

Speculative rollback with these kernels: ``recompute`` verifies with ``write_state=False`` (the cache keeps the
pre-verify state), each layer's prep outputs and conv inputs going to its slice of one stack over the GDN layers, and
commits by re-running the block's recurrence with ``keep`` over that stack (``gdn_commit``: one launch for all the
layers, no conv, norms or gates again); ``snapshot`` verifies writing the state after every position
into a buffer and commits by gathering from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import fused
from ...kernels._triton import single_pass
from ...kernels.attention_prefill import cudnn_past_ok, prefill_attention_cached
from ...kernels.attention_triton import decode_attention
from ...kernels.gdn_triton import gdn_decode, layer_of, new_stack
from .cache import HybridCache, PendingGDN
from .weights import GATE_UP_RUN


@dataclass(slots=True)
class GDNParams:
    """A GDN layer's small tensors in the layout the kernel wants (made once)."""

    conv_w: torch.Tensor  # [C, W] fp32 contiguous
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_w: torch.Tensor


def available() -> bool:
    from ...kernels.attention_triton import triton_available

    return triton_available()


class FastPath:
    """Decode / verify forwards of a :class:`HybridModel` through the fused kernels."""

    def __init__(self, model, *, side_stream: bool = True):
        self.m = model
        self.cfg, self.w = model.cfg, model.w
        self.gdn: dict[str, GDNParams] = {}
        on = side_stream and model.device.type == "cuda"
        self.sides = [torch.cuda.Stream(model.device) for _ in range(2)] if on else []  # made here: not in a capture
        self.branches = 0  # launch sequences captured on side streams so far

    def _fork(self, side: int, launch):
        """``launch()`` and the join to call before the main stream reads its result. In a CUDA-graph capture it goes
        on side stream ``side``, a branch of the graph after everything queued on the main stream so far (so a
        buffer it reuses is never still being read there); otherwise it runs right here and the join is a no-op."""
        if not self.sides or not torch.cuda.is_current_stream_capturing():
            with single_pass():  # the same sums as on a branch, whether or not this runs on one
                return launch(), _no_join
        main, stream = torch.cuda.current_stream(self.m.device), self.sides[side]
        stream.wait_stream(main)
        with torch.cuda.stream(stream), single_pass():  # beside the main chain: no shared split-K scratch
            out = launch()
        self.branches += 1
        return out, lambda: main.wait_stream(stream)

    def _gdn_inputs(self, p: str, x):
        """A GDN layer's projections: qkv, z, b, a and the join to call before z is read (see the module doc)."""
        cfg, m = self.cfg, self.m
        hv = cfg.linear_num_value_heads
        (bb, aa), join_ba = self._fork(0, lambda: m._proj(p, "linear_attn.in_proj_ba", (
            "linear_attn.in_proj_b", "linear_attn.in_proj_a"), [hv, hv], x))
        if self.w.has(f"{p}.linear_attn.in_proj_qkvz.weight"):
            (qkv, z), join_z = m._proj(p, "linear_attn.in_proj_qkvz", (), [cfg.conv_dim, cfg.value_dim], x), _no_join
        else:
            z, join_z = self._fork(1, lambda: self.w.linear(f"{p}.linear_attn.in_proj_z.weight")(x))
            qkv = self.w.linear(f"{p}.linear_attn.in_proj_qkv.weight")(x)
        join_ba()
        return qkv, z, bb, aa, join_z

    def params(self, p: str) -> GDNParams:
        if p not in self.gdn:
            a = f"{p}.linear_attn"
            v = self.w.vector
            self.gdn[p] = GDNParams(v(f"{a}.conv1d.weight").reshape(self.cfg.conv_dim, -1).float().contiguous(),
                                    v(f"{a}.A_log").float().contiguous(), v(f"{a}.dt_bias").float().contiguous(),
                                    v(f"{a}.norm.weight").float().contiguous())
        return self.gdn[p]

    def gated_deltanet(self, p: str, i: int, x, step, cache: HybridCache):
        cfg = self.cfg
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv, z, bb, aa, join_z = self._gdn_inputs(p, x)
        prm = self.params(p)
        args = (cache.conv[i], prm.conv_w, cache.ssm[i], step.slots, prm.A_log, prm.dt_bias, prm.norm_w,
                cfg.rms_norm_eps)
        if step.mode == "verify" and cache.rollback == "snapshot":
            b, t, _ = qkv.shape
            rec = PendingGDN(conv_in=qkv, conv_old=cache.conv[i][step.slots],
                             states=torch.empty(b, t, hv, dk, dv, dtype=torch.float32, device=x.device))
            o = gdn_decode(qkv, z, bb, aa, *args, states_out=rec.states, before_z=join_z)
            cache.record(i, rec)
        elif step.mode == "verify":  # recompute: the cache keeps the pre-verify state; the rollback reruns the
            # recurrence of every layer at once (gdn_commit) from the workspaces the pass leaves in one stack
            pend = cache.pending
            ws = None
            if pend is not None:
                if pend.stack is None:
                    b, t, c = qkv.shape
                    pend.stack = new_stack(len(cache.gdn_index), b, t, c, hv, cfg.linear_num_key_heads, qkv.dtype,
                                           x.device)
                ws = layer_of(pend.stack, cache.gdn_index[i])
                pend.stacked.add(i)
            o = gdn_decode(qkv, z, bb, aa, *args, write_state=False, before_z=join_z, workspace_out=ws)
        else:
            o = gdn_decode(qkv, z, bb, aa, *args, before_z=join_z)
        return self.m._sum(self.w.linear(f"{p}.linear_attn.out_proj.weight")(o))

    def attention(self, p: str, key, x, step, cache: HybridCache, prefill: bool = False):
        """Full attention from the layer's normed input: the prologue (norms, RoPE, the cache write), then
        decode_attention (decode / verify) or, for a prompt chunk (``prefill``), prefill_attention_cached over the
        chunk's key range, the output gate applied as the output is stored."""
        q, gate = self._prologue(p, key, x, step, cache)
        return self._attend(p, key, q, gate, step, cache, prefill)

    def _prologue(self, p: str, key, x, step, cache: HybridCache):
        """(q, gate) of full-attention layer ``p`` from its normed input, the rows' keys and values written to the
        cache (fused.attn_prologue)."""
        cfg, m, w = self.cfg, self.m, self.w
        qg, kv = m.attn_proj(p, x)
        c = cache.kv[key]
        return fused.attn_prologue(qg, kv, w.vector(f"{p}.self_attn.q_norm.weight"),
                                   w.vector(f"{p}.self_attn.k_norm.weight"), m.cos, m.sin, c.k, c.v,
                                   c.k_scale, c.v_scale, step.slots, step.pos, cfg.rms_norm_eps)

    def _attend(self, p: str, key, q, gate, step, cache: HybridCache, prefill: bool, pos=None):
        """The attention of queries ``q [B, T, H, hd]`` (their output ``gate``) over the cache, then o_proj:
        ``prefill`` (a prompt chunk's rows) prefill_attention_cached over the chunk's key range, else decode_attention,
        each query over the keys up to its position (``pos [B, T]``, default the step's)."""
        cfg, m, w = self.cfg, self.m, self.w
        b, t = q.shape[:2]
        h, hd = cfg.num_attention_heads, cfg.head_dim
        c = cache.kv[key]
        if prefill:
            # the cuDNN split where it applies, in fp16 without a host read a chunk where the layer's weights bound
            # its values within fp16's range (worked out at the first such chunk)
            split = m.cudnn_prefill and step.start is not None and cudnn_past_ok(q, step.start)
            o = prefill_attention_cached(q, c.k, c.v, c.k_scale, c.v_scale, step.slots, step.pos, m.scale,
                                         kv_len=min(step.kv_len, cache.capacity), gate=gate, past_start=step.start,
                                         cudnn=split, fp16_safe=split and m.attention_fp16_safe(p))
        else:
            o = decode_attention(q, c.k, c.v, c.k_scale, c.v_scale, step.slots, step.pos if pos is None else pos,
                                 m.scale, kv_len_max=cache.capacity, gate=gate)
        return m._sum(w.project(f"{p}.self_attn.o_proj", o.reshape(b, t, h * hd)))

    def mlp(self, p: str, x):
        name = f"{p}.mlp.gate_up_proj.weight"
        act = None
        if name in self.w.interleaved:  # silu(g) * u in the projection's epilogue where its kernel runs
            act = getattr(self.w.linear(name), "silu_mul", lambda _: None)(x)
            if act is None:  # rows past the epilogue kernel's (a prompt chunk): one pass over the interleaved output
                act = fused.silu_mul(self.w.linear(name)(x), self.cfg.intermediate_size, run=GATE_UP_RUN)
        elif name in self.w.linears:
            act = fused.silu_mul(self.w.linear(name)(x), self.cfg.intermediate_size)
        if act is None:  # separate gate / up weights
            gate, up = self.m.gate_up(p, x)
            act = torch.nn.functional.silu(gate) * up
        return self.m._sum(self.w.linear(f"{p}.mlp.down_proj.weight")(act))

    def layer(self, p: str, key, h, step, cache: HybridCache):
        """One full-attention block outside the target's stack (the MTP head's layer, decode / verify): the norms
        fused (the residual add into the second), the attention and the MLP as the target's layers run them."""
        eps, w = self.cfg.rms_norm_eps, self.w
        x = fused.rms_norm(h, w.vector(f"{p}.input_layernorm.weight"), eps)
        x, h = fused.add_rms_norm(self.attention(p, key, x, step, cache), h,
                                  w.vector(f"{p}.post_attention_layernorm.weight"), eps)
        return h + self.mlp(p, x)

    def forward(self, step, cache: HybridCache, prefill: bool = False):
        """Final-normed hidden ``[B, T, H]`` and tap outputs, with each residual add fused into the next norm.
        ``prefill`` (a prompt chunk, ``EngineOptions.fused_prefill``): the GDN layers through the eager forward's
        prefill path (fla's recurrence, kernels/gdn_prefill's glue), full attention through prefill_attention_cached
        (or the eager attention with flash_prefill off), the MLP's silu(gate) * up by fused.silu_mul in one pass
        over the gate_up output (interleaved or not), the norms as here."""
        x, h = self._embed(step)
        taps = []
        for i in range(self.cfg.num_hidden_layers):
            x, h = self._layer(i, x, h, step, cache, prefill)
            if i in step.taps:
                taps.append(h)
        return x, taps

    def forward_layers(self, steps: list, cache: HybridCache, after_layer=None):
        """:meth:`forward` with ``prefill`` over consecutive chunks of one prompt (``steps``, in order), layer by
        layer: every chunk through layer i before layer i + 1. Each chunk meets the same operations as in its own
        forward and each layer's cache sees the chunks in the same order, so the results are the same; a packed
        weight that is dequantized for prefill is dequantized once for all the chunks of its layer
        (WeightStore.dense_scope). Returns each chunk's (final-normed hidden, taps). ``after_layer(i)`` follows the
        progress."""
        xs, hs = map(list, zip(*(self._embed(step) for step in steps)))
        taps: list[list] = [[] for _ in steps]
        for i in range(self.cfg.num_hidden_layers):
            with self.w.dense_scope(f"model.layers.{i}."):
                for c, step in enumerate(steps):
                    xs[c], hs[c] = self._layer(i, xs[c], hs[c], step, cache, True)
                    if i in step.taps:
                        taps[c].append(hs[c])
            if after_layer is not None:
                after_layer(i)
        return list(zip(xs, taps))

    def _embed(self, step):
        """A forward's start: the embedded ids ``h`` and the first layer's normed input ``x`` (one launch for both
        where the table is dense and whole: fused.embed_rms_norm, the bits of the lookup and rms_norm)."""
        norm_w, eps = self.w.vector("model.layers.0.input_layernorm.weight"), self.cfg.rms_norm_eps
        table = self.w.dense_table()
        if table is not None:
            return fused.embed_rms_norm(table, step.ids, norm_w, eps)
        h = self.w.embed(step.ids)
        return fused.rms_norm(h, norm_w, eps), h

    def _layer(self, i: int, x, h, step, cache: HybridCache, prefill: bool):
        """Decoder layer ``i`` from its normed input ``x`` and the residual ``h``: the next layer's normed input (the
        final norm after the last) and the new residual. The last layer of a prompt chunk read at ``step.rows`` alone
        goes through HybridModel.last_rows with this path's norms and MLP: (``step.head``, None) unless every row is
        read too."""
        cfg, w, m = self.cfg, self.w, self.m
        p, kind, eps = f"model.layers.{i}", cfg.layer_types[i], cfg.rms_norm_eps
        if prefill and step.rows is not None and i == cfg.num_hidden_layers - 1:
            x, h = m.last_rows(p, i, x, h, step, cache, lambda y, h, wt: fused.add_rms_norm(y, h, wt, eps), self.mlp)
            return (step.head, None) if x is None else (x, h)
        if kind == "linear_attention":
            y = m.gated_deltanet(p, i, x, step, cache) if prefill else self.gated_deltanet(p, i, x, step, cache)
        elif prefill and not m.flash_prefill:
            y = m.attention(p, i, x, step, cache)
        else:
            y = self.attention(p, i, x, step, cache, prefill=prefill)
        x, h = fused.add_rms_norm(y, h, w.vector(f"{p}.post_attention_layernorm.weight"), eps)
        nxt = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < cfg.num_hidden_layers else "model.norm.weight"
        return fused.add_rms_norm(self.mlp(p, x), h, w.vector(nxt), eps)


def _no_join() -> None:
    pass
