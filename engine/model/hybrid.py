"""The hybrid decoder forward (Gated DeltaNet + gated full attention) over a batch of cache slots.

One forward serves every phase: prefill of a chunk (B = 1, T = chunk), decode (B slots, T = 1) and
speculative verification (B slots, T = K + 1, recording what rollback needs). Host-side preparation
(positions, slots, the K/V length to read) arrives in a :class:`Step`; nothing here reads globals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...kernels import attention as attn_k
from ...kernels import gdn_prefill
from ...kernels.attention_prefill import FP16_MAX
from ...kernels.conv import causal_conv1d, causal_conv1d_state_at
from ...kernels.gdn import gated_delta_rule, gated_delta_rule_step, l2norm
from ...kernels.norm import gated_rms_norm, rms_norm
from ...kernels.rope import apply_rope, rope_tables
from .cache import HybridCache, PendingGDN
from .config import ModelConfig
from .rotary import mrope_cos_sin
from .weights import GATE_UP_RUN, WeightStore, product_fp32

PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"

# attention_value_bound's bound times this must fit FP16_MAX: room for the 16-bit roundings between the bound's
# exact arithmetic and the stored values (the normed input, the projection's output, the int8 cache's scale), each
# at most 2^-8 relative
FP16_MARGIN = 1.05
IDENTITY_ROWS = 512  # attention_value_bound's identity rows a projection call


@torch.inference_mode()
def attention_value_bound(model: HybridModel, p: str) -> float:
    """An upper bound on every ``|value|`` full-attention layer ``p`` can put in a query, a cached key or a cached
    value, from its weights alone (before 16-bit rounding), for any finite input:

    - queries and keys are zero-centred RMSNorms (weight ``w``) of a head, then rotated by RoPE: a normed head has
      L2 norm at most sqrt(hd) * max|1 + w|, and a rotation of pairs keeps every component within it;
    - a value row j is the projection of the layer's normed input (zero-centred RMSNorm of the hidden state, L2 norm
      at most sqrt(H) * max|1 + w_in|): by Cauchy-Schwarz at most that times row j's L2 norm, plus its bias.

    The value rows' norms come through the layer's own projection (``attn_proj``) of identity rows, so every weight
    layout the store holds (fused q | k | v, packed, dense, this rank's heads) reads as it computes."""
    cfg, w = model.cfg, model.w
    hsz, hd, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads

    def gain(name: str) -> float:
        return float((1.0 + w.vector(name).float()).abs().max())

    bq = hd ** 0.5 * gain(f"{p}.self_attn.q_norm.weight")
    bk = hd ** 0.5 * gain(f"{p}.self_attn.k_norm.weight")
    dev, dt = model.device, model.dtype
    bias = model.attn_proj(p, torch.zeros(1, 1, hsz, device=dev, dtype=dt))[1][0, 0, hkv * hd:].float()
    sq = torch.zeros(hkv * hd, device=dev, dtype=torch.float32)
    for r0 in range(0, hsz, IDENTITY_ROWS):
        n = min(IDENTITY_ROWS, hsz - r0)
        eye = torch.zeros(1, n, hsz, device=dev, dtype=dt)
        eye[0, torch.arange(n, device=dev), torch.arange(r0, r0 + n, device=dev)] = 1.0
        v = model.attn_proj(p, eye)[1][0, :, hkv * hd:].float() - bias  # rows r0 .. : W_v's columns
        sq += (v * v).sum(0)
    bv = hsz ** 0.5 * gain(f"{p}.input_layernorm.weight") * float(sq.sqrt().max()) + float(bias.abs().max())
    return max(bq, bk, bv)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x [B, T, ...]`` at ``rows [B, R]`` (per batch row): ``[B, R, ...]``, contiguous (no host read)."""
    idx = rows.reshape(*rows.shape, *([1] * (x.dim() - 2))).expand(*rows.shape, *x.shape[2:])
    return torch.gather(x, 1, idx)


@dataclass(slots=True)
class Step:
    """Host-prepared metadata of one forward.

    ids ``[B, T]`` token ids; pos ``[B, T]`` absolute positions; slots ``[B]`` cache slots;
    kv_len: how many cached K/V positions attention reads (>= max(pos) + 1);
    mode: prefill | decode | verify; taps: decoder layer indices whose outputs to return.
    valid ``[B]``: a prefill padded to a captured length; the first ``valid`` tokens of each row are real.
    Media (all None for text, which keeps the plain path): embeds ``[N, H]`` replace the token embeddings where
    embed_mask ``[B, T]`` is set (in order); rope_pos: rotary positions when they differ from the cache positions,
    ``[B, T]`` (text after media: pos + delta) or ``[3, B, T]`` (mRoPE t, h, w; see engine/media/prompt.py).
    """

    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    kv_len: int
    mode: str = DECODE
    taps: tuple[int, ...] = ()
    embeds: torch.Tensor | None = None
    embed_mask: torch.Tensor | None = None
    rope_pos: torch.Tensor | None = None
    valid: torch.Tensor | None = None  # [B] real tokens of a padded (graph-captured) prefill; positions past them
    #                                    are padding: inert in the recurrent state, never attended by a real token
    start: int | None = None  # the host's copy of pos[0, 0] for one row whose pos is the run start .. start + T - 1
    #                           (an eager prompt chunk), else None
    rows: torch.Tensor | None = None  # [B, R] (R = 0 or 1) a prompt chunk's rows whose final hidden state the caller
    #                                   reads (its last real token's, for the first token's logits; none: R = 0);
    #                                   None: every row. The forward sets ``head`` to them ([B, R, H]) and returns
    #                                   them as its hidden states unless ``all_rows``; the fused prefill then runs
    #                                   the last layer past its token mixing for those rows only
    all_rows: bool = False  # with ``rows``: every row's final hidden state is read too (prompt scores, a drafter
    #                         that reads them): the forward returns them all, and ``head`` is still computed alone
    head: torch.Tensor | None = None  # set by the forward where ``rows`` is given


class HybridModel:
    """Forward of a Qwen3.5 / Qwen3-Next text decoder with weights from a :class:`WeightStore`."""

    def __init__(self, cfg: ModelConfig, weights: WeightStore, *, max_positions: int, gdn_impl: str = "auto",
                 fused_kernels: bool = False, side_stream: bool = True, flash_prefill: bool = True,
                 fused_prefill: bool = True, cudnn_prefill: bool = True, tp=None):
        self.cfg, self.w, self.gdn_impl = cfg, weights, gdn_impl
        # tensor parallel (engine/model/tensor_parallel.TPGroup): cfg and weights are this rank's share; the
        # row-parallel products are summed over the ranks (_sum) and the vocabulary-parallel logits gathered
        self.tp = tp
        self.device, self.dtype = weights.device, weights.dtype
        self.cos, self.sin = rope_tables(cfg.rotary_dim, cfg.rope_theta, max_positions, self.device)
        self.scale = cfg.head_dim ** -0.5
        # decode and verify through the fused Triton kernels (engine/model/fused_forward.py); prefill stays eager
        self.fast = None
        if fused_kernels:
            from .fused_forward import FastPath

            self.fast = FastPath(self, side_stream=side_stream)
        # prompt chunks' full attention through the fused prologue and the flash-style kernel (with the fused kernels)
        self.flash_prefill = flash_prefill and self.fast is not None
        # with it, a long chunk's past keys through cuDNN's fused attention (kernels/attention_prefill.cudnn_past)
        self.cudnn_prefill = cudnn_prefill and self.flash_prefill
        self._fp16_safe: dict[str, bool] = {}  # attention_fp16_safe's answer a layer prefix
        # prompt chunks' GDN glue (kernels/gdn_prefill) and the norms between layers through Triton kernels
        self.fused_prefill = fused_prefill and self.fast is not None
        self.mrope_axes = None  # [rd] stream per rotary column, set by the engine for models with vision

    # ---- pieces ----------------------------------------------------------------------------------
    def _proj(self, prefix: str, fused: str, members: tuple[str, ...], sizes: list[int], x):
        """Outputs of the member projections (with their biases), through the fused linear when the store has one."""
        if f"{prefix}.{fused}.weight" in self.w.linears:
            return list(torch.split(self.w.project(f"{prefix}.{fused}", x), sizes, dim=-1))
        return [self.w.project(f"{prefix}.{m}", x) for m in members]

    def attn_proj(self, p: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full attention's input projections: ``qg [B, T, H, 2 hd]`` (query | gate per head) and ``kv [B, T,
        2 Hkv hd]`` (k | v), through the fused qkv (or kv) projection when the store has one (views then)."""
        cfg, w = self.cfg, self.w
        b, t, _ = x.shape
        h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if f"{p}.self_attn.qkv_proj.weight" in w.linears:
            qg, kv = torch.split(w.project(f"{p}.self_attn.qkv_proj", x), [2 * h * hd, 2 * hkv * hd], dim=-1)
        else:
            qg = w.project(f"{p}.self_attn.q_proj", x)
            kv = torch.cat(self._proj(p, "self_attn.kv_proj", ("self_attn.k_proj", "self_attn.v_proj"),
                                      [hkv * hd, hkv * hd], x), dim=-1)
        return qg.view(b, t, h, 2 * hd), kv

    def attention_fp16_safe(self, p: str) -> bool:
        """Whether full-attention layer ``p``'s queries, keys and values stay within fp16's range whatever the
        input, by its weights alone (:func:`attention_value_bound`, with FP16_MARGIN to spare): the cuDNN split
        then runs in fp16 without reading the cache's scales back to the host each chunk. Worked out once a layer
        (one host read then)."""
        ok = self._fp16_safe.get(p)
        if ok is None:
            ok = self._fp16_safe[p] = attention_value_bound(self, p) * FP16_MARGIN <= FP16_MAX
        return ok

    def gate_up(self, p: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's gate and up projections (from an interleaved fused weight too: WeightStore.interleaved)."""
        name = f"{p}.mlp.gate_up_proj.weight"
        if name in self.w.interleaved:
            runs = self.w.linear(name)(x).unflatten(-1, (-1, 2, GATE_UP_RUN))  # [..., I / run, gate | up, run]
            return runs[..., 0, :].flatten(-2), runs[..., 1, :].flatten(-2)
        i = self.cfg.intermediate_size
        return tuple(self._proj(p, "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), [i, i], x))

    def _sum(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: this rank's partial product summed over the ranks (tensor parallel)."""
        return y if self.tp is None else self.tp.reduce(y)

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(p, x)
        return self._sum(self.w.linear(f"{p}.mlp.down_proj.weight")(F.silu(gate) * up))

    def attention(self, p: str, key, x: torch.Tensor, step: Step, cache: HybridCache) -> torch.Tensor:
        q, gate = self._attn_prologue(p, key, x, step, cache)
        return self._attn_out(p, key, q, gate, step.pos, step, cache, step.mode == PREFILL)

    def _attn_prologue(self, p: str, key, x: torch.Tensor, step: Step, cache: HybridCache):
        """(q ``[B, T, H, hd]`` normed and rotated, gate ``[B, T, H * hd]``) of full-attention layer ``p``, every
        row's keys and values written to the cache."""
        cfg, w = self.cfg, self.w
        b, t, _ = x.shape
        h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg, kv = self.attn_proj(p, x)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, h * hd)
        k, v = torch.split(kv, [hkv * hd, hkv * hd], dim=-1)
        q = rms_norm(q, w.vector(f"{p}.self_attn.q_norm.weight"), cfg.rms_norm_eps)
        k = rms_norm(k.view(b, t, hkv, hd), w.vector(f"{p}.self_attn.k_norm.weight"), cfg.rms_norm_eps)
        cos, sin = self.rope(step)  # [B, T, rd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write_kv(key, step.slots, step.pos, k, v.view(b, t, hkv, hd))
        return q, gate

    def _attn_out(self, p: str, key, q, gate, pos, step: Step, cache: HybridCache, prefill: bool):
        """The attention of queries ``q [B, T, H, hd]`` at positions ``pos [B, T]`` over the cache, gated, o_proj."""
        b, t = q.shape[:2]
        kk, vv = cache.read_kv(key, step.slots, step.kv_len, q.dtype)
        o = attn_k.attention(q, kk, vv, pos, self.scale, prefill=prefill).reshape(b, t, -1)
        return self._sum(self.w.project(f"{p}.self_attn.o_proj", o * torch.sigmoid(gate)))

    def rope(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, T, rd]`` at the step's rotary positions."""
        if step.rope_pos is None:
            return self.cos[step.pos], self.sin[step.pos]
        if step.rope_pos.dim() == 2:
            return self.cos[step.rope_pos], self.sin[step.rope_pos]
        return mrope_cos_sin(self.cos, self.sin, step.rope_pos, self.mrope_axes)

    def gated_deltanet(self, p: str, i: int, x: torch.Tensor, step: Step, cache: HybridCache) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        b, t, _ = x.shape
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                          cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        a_ = f"{p}.linear_attn"
        qkv, z = self._proj(p, "linear_attn.in_proj_qkvz", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
                            [cfg.conv_dim, cfg.value_dim], x)
        bb, aa = self._proj(p, "linear_attn.in_proj_ba", ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
                            [hv, hv], x)
        conv_w = w.vector(f"{a_}.conv1d.weight").squeeze(1)
        A_log, dt_bias = w.vector(f"{a_}.A_log"), w.vector(f"{a_}.dt_bias")
        glue = self.fused_prefill and step.mode == PREFILL  # conv, SiLU, L2 norms, gates, gated norm in Triton
        if glue:
            q, k, v = gdn_prefill.conv_qkv(qkv, conv_w, cache.conv[i], step.slots, hk, dk, hv, dv)
            # the slot's new conv state written in place (after conv_qkv's read of the old one), the state after the
            # real tokens of a padded chunk; the gates zero past them too (padding is inert)
            gdn_prefill.conv_state_update(qkv, cache.conv[i], step.slots, step.valid)
            g, beta = gdn_prefill.gates(bb, aa, A_log, dt_bias, step.valid)
        else:
            conv_old = cache.conv[i].index_select(0, step.slots)  # [B, C, W-1] (index_select: cheaper than [slots])
            y, conv_new = causal_conv1d(qkv, conv_w, conv_old)
            q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            q = l2norm(q.reshape(b, t, hk, dk))
            k = l2norm(k.reshape(b, t, hk, dk))
            v = v.reshape(b, t, hv, dv)
            if step.valid is not None:  # the state after the real tokens, not after the padding
                conv_new = causal_conv1d_state_at(qkv, conv_old, step.valid)
            # padding writes nothing (beta = 0) and does not decay the state (g = 0): the eager ops of the gates
            g, beta = gdn_prefill.gates_ref(bb, aa, A_log, dt_bias, step.valid)
        ssm_old = cache.ssm[i].index_select(0, step.slots)
        if step.mode == PREFILL:
            o, state = gated_delta_rule(q, k, v, g, beta, initial_state=ssm_old, impl=self.gdn_impl)
        else:
            snap = step.mode == VERIFY and cache.rollback == "snapshot"
            res = gated_delta_rule_step(q, k, v, g, beta, ssm_old, return_states=snap)
            o, state = res[0], res[1]
            if step.mode == VERIFY:
                rec = PendingGDN(conv_in=qkv, conv_old=conv_old)
                if snap:
                    rec.states = res[2]
                else:
                    rec.ssm_old, rec.inputs = ssm_old, (q, k, v, g, beta)
                cache.record(i, rec)
        if not glue:
            cache.conv[i][step.slots] = conv_new.to(cache.conv[i].dtype)
        cache.ssm[i][step.slots] = state
        if glue:
            o = gdn_prefill.gated_rms_norm(o.to(x.dtype).contiguous(), z, w.vector(f"{a_}.norm.weight"),
                                           cfg.rms_norm_eps)
        else:
            o = gated_rms_norm(o.to(x.dtype), z.view(b, t, hv, dv), w.vector(f"{a_}.norm.weight"), cfg.rms_norm_eps)
        return self._sum(w.linear(f"{a_}.out_proj.weight")(o.reshape(b, t, hv * dv)))

    def layer(self, p: str, i, kind: str, h: torch.Tensor, step: Step, cache: HybridCache) -> torch.Tensor:
        """One pre-norm residual block (``i`` indexes the cache: a layer number, or ``"mtp0"``...)."""
        if kind != "linear_attention" and self._fused(step):
            # a drafter's attention layer (MTP) in decode: each row's keys up to its own position, as the target's
            # layers read them, instead of a masked SDPA over step.kv_len (the whole capacity in captured drafting),
            # with the fused path's norms and MLP
            return self.fast.layer(p, i, h, step, cache)
        eps = self.cfg.rms_norm_eps
        x = rms_norm(h, self.w.vector(f"{p}.input_layernorm.weight"), eps)
        if kind == "linear_attention":
            h = h + self.gated_deltanet(p, i, x, step, cache)
        elif self.flash_prefill and step.mode == PREFILL and step.rope_pos is None:
            h = h + self.fast.attention(p, i, x, step, cache, prefill=True)
        else:
            h = h + self.attention(p, i, x, step, cache)
        x = rms_norm(h, self.w.vector(f"{p}.post_attention_layernorm.weight"), eps)
        return h + self.mlp(p, x)

    def _fused(self, step: Step) -> bool:
        """Whether ``step`` runs the fused kernels: decode / verify, with them built; the fused kernels rotate at
        the cache position, so rows of media requests (rope_pos) run eagerly."""
        return self.fast is not None and step.mode != PREFILL and step.rope_pos is None

    # ---- whole model -----------------------------------------------------------------------------
    def forward(self, step: Step, cache: HybridCache) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states ``[B, T, H]`` and the outputs of ``step.taps`` layers."""
        if step.mode == VERIFY:
            cache.begin_verify(step.slots)
        if self._fused(step):
            return self.fast.forward(step, cache)
        if self.fused_prefill and step.mode == PREFILL and step.embeds is None and step.rope_pos is None:
            return self.fast.forward(step, cache, prefill=True)
        h = self.w.embed(step.ids)
        if step.embeds is not None:  # merged vision tokens take their placeholders' rows
            h = h.masked_scatter(step.embed_mask[..., None], step.embeds.to(h.dtype))
        taps, last, eps = [], self.cfg.num_hidden_layers - 1, self.cfg.rms_norm_eps
        hidden = None
        for i, kind in enumerate(self.cfg.layer_types):
            p = f"model.layers.{i}"
            if i == last and step.rows is not None and step.mode == PREFILL:  # the rows read alone (Step.rows)
                hidden, h = self.last_rows(p, i, rms_norm(h, self.w.vector(f"{p}.input_layernorm.weight"), eps), h,
                                           step, cache, self._add_norm, self.mlp)
            else:
                h = self.layer(p, i, kind, h, step, cache)
            if i in step.taps:
                taps.append(h)
        if step.rows is None or step.mode != PREFILL:
            hidden = rms_norm(h, self.w.vector("model.norm.weight"), eps)
            if step.rows is None:
                return hidden, taps
            step.head = gather_rows(hidden, step.rows)
        return (hidden if step.all_rows else step.head), taps

    def _add_norm(self, y: torch.Tensor, h: torch.Tensor, weight: torch.Tensor):
        """(rms_norm(h + y), h + y): :meth:`layer`'s residual add and the norm after it."""
        h = h + y
        return rms_norm(h, weight, self.cfg.rms_norm_eps), h

    def last_rows(self, p: str, i: int, x: torch.Tensor, h: torch.Tensor, step: Step, cache: HybridCache,
                  add_norm, mlp):
        """The last decoder layer ``i`` of a prompt chunk whose caller reads the final hidden state at ``step.rows``
        alone (Step.rows), from its normed input ``x`` and the residual ``h``: the token mixing over every row (the
        cache and the recurrent state take them all), then the rest of the layer (full attention's queries, o_proj,
        the norms, the MLP) for those rows only, into ``step.head`` (final-normed). Where every row is read too
        (``all_rows``, or the layer's output tapped) the whole layer also runs, and its (final-normed hidden,
        residual) returns; otherwise (None, None). The rows' own computation is the same either way, so a drafter
        that reads every row leaves the first token as it is without one (greedy speculative tokens stay plain
        decoding's). ``add_norm(y, h, weight)`` -> (normed h + y, h + y) and ``mlp(p, x)``: the caller's (eager, or
        the fused path's)."""
        w, rows = self.w, step.rows
        full = step.all_rows or i in step.taps
        if self.cfg.layer_types[i] == "linear_attention":
            y = self.gated_deltanet(p, i, x, step, cache)  # the recurrence needs every row; then pick
            y_rows = gather_rows(y, rows)
        else:
            q, gate, attend = self._attn_pieces(p, i, x, step, cache)  # every row's keys and values written
            y = attend(q, gate, step.pos, True) if full else None
            y_rows = (attend(gather_rows(q, rows), gather_rows(gate, rows), gather_rows(step.pos, rows), False)
                      if rows.shape[1] else None)
        post, final = w.vector(f"{p}.post_attention_layernorm.weight"), w.vector("model.norm.weight")

        def rest(y, h):
            x, h = add_norm(y, h, post)
            return add_norm(mlp(p, x), h, final)

        if rows.shape[1]:
            step.head = rest(y_rows, gather_rows(h, rows))[0]
        else:  # no row read: nothing after the mixing
            step.head = h.new_empty(rows.shape[0], 0, h.shape[-1])
        return rest(y, h) if full else (None, None)

    def _attn_pieces(self, p: str, key, x: torch.Tensor, step: Step, cache: HybridCache):
        """(q, gate, attend) of full-attention layer ``p`` for a prompt chunk, every row's keys and values written:
        the fused prologue and kernels where ``flash_prefill`` applies (as :meth:`layer` takes them), else the eager
        ones; ``attend(q, gate, pos, prefill)`` is the attention of those queries (a chunk's rows, or rows picked at
        positions ``pos``) with o_proj."""
        if self.flash_prefill and step.rope_pos is None:
            f = self.fast
            q, gate = f._prologue(p, key, x, step, cache)
            return q, gate, lambda q, g, pos, pre: f._attend(p, key, q, g, step, cache, pre, pos=pos)
        q, gate = self._attn_prologue(p, key, x, step, cache)
        return q, gate, lambda q, g, pos, pre: self._attn_out(p, key, q, g, pos, step, cache, pre)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over final-normed hidden states, in fp32 (tensor parallel: every rank's vocabulary rows,
        gathered)."""
        y = product_fp32(self.w.linear("lm_head.weight"), hidden)
        return y if self.tp is None else self.tp.gather_last(y)
