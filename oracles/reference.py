"""Independent reference forward of the Qwen3.5 / Qwen3-Next hybrid text decoder (the oracle).

Written for clarity, not speed: float64 by default (float32 on request), a token-by-token Gated
DeltaNet recurrence (no chunked form), plain softmax attention, and its own tiny decode state. It
shares nothing with the engine but ``ModelConfig`` (for shapes) and nothing with ``kernels``: it is
the independent check of both. Semantics follow docs/DESIGN.md, "The model family"; Hugging Face
transformers' ``Qwen3_5ForCausalLM`` is the semantic reference it is tested against.

Weights are a dict of Hugging Face ``Qwen3_5ForCausalLM`` names (plus ``mtp.*``); a ``qwen3_next``
state dict with fused ``in_proj_qkvz`` / ``in_proj_ba`` is split on load (``split_qwen3_next_weights``).
Shapes in comments: T tokens, H hidden, Hk/Hv GDN key/value heads of dk/dv, Hq/Hkv attention heads of D.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..engine.model.config import ModelConfig

L2_EPS = 1e-6  # q/k L2 normalisation in GDN: x * rsqrt(sum(x^2) + eps), as in FLA / transformers


# ---- ops ----------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: ``x * rsqrt(mean(x^2) + eps) * (1 + w)``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm per head: ``w * rmsnorm(o) * silu(z)`` (plain ``w``, not ``1 + w``)."""
    return weight * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX rotate-half RoPE on the first ``rotary_dim`` dims of ``x`` [T, heads, D]; the rest pass.

    The angle table is always built in float64 so the float32 oracle's RoPE is as exact as it can be.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=x.device) / rotary_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, rd/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)[:, None, :]  # [T, 1, rd]
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated_half * sin, rest], -1)


# ---- Qwen3-Next fused projections -----------------------------------------------------------------
def split_qwen3_next_weights(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Split Qwen3-Next's fused GDN projections into the Qwen3.5 names; other tensors pass through.

    ``in_proj_qkvz`` rows are grouped per key head g: [q_g (dk), k_g (dk), v_g (r*dv), z_g (r*dv)]
    with r = Hv/Hk, so v head g*r + j belongs to key head g; ``in_proj_ba`` rows per key head are
    [b_g (r), a_g (r)]. The result has ``in_proj_qkv`` = [all q; all k; all v], ``in_proj_z``,
    ``in_proj_b`` and ``in_proj_a`` (the layout of transformers' ``fix_query_key_value_ordering``).
    """
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, r = config.linear_key_head_dim, config.linear_value_head_dim, hv // hk
    out = {}
    for name, w in state_dict.items():
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            base = name[: -len("in_proj_qkvz.weight")]
            expected = (2 * config.key_dim + 2 * config.value_dim, config.hidden_size)
            if tuple(w.shape) != expected:
                raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {expected}")
            q, k, v, z = w.reshape(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
            out[base + "in_proj_qkv.weight"] = torch.cat(
                [q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hv * dv, -1)])
            out[base + "in_proj_z.weight"] = z.reshape(hv * dv, -1)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            base = name[: -len("in_proj_ba.weight")]
            if tuple(w.shape) != (2 * hv, config.hidden_size):
                raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {(2 * hv, config.hidden_size)}")
            b, a = w.reshape(hk, 2 * r, -1).split([r, r], dim=1)
            out[base + "in_proj_b.weight"] = b.reshape(hv, -1)
            out[base + "in_proj_a.weight"] = a.reshape(hv, -1)
        else:
            out[name] = w
    return out


# ---- decode state ---------------------------------------------------------------------------------
@dataclass
class DecodeState:
    """What the oracle carries between incremental calls, keyed by layer prefix.

    conv: last W-1 inputs of the depthwise conv [W-1, conv_dim]; ssm: GDN state S [Hv, dk, dv];
    keys/values: per attention layer, a list of chunks [t, Hkv, D] (RoPE already applied to keys).
    """

    position: int = 0
    conv: dict[str, torch.Tensor] = field(default_factory=dict)
    ssm: dict[str, torch.Tensor] = field(default_factory=dict)
    keys: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    values: dict[str, list[torch.Tensor]] = field(default_factory=dict)


# ---- the model --------------------------------------------------------------------------------------
class ReferenceModel:
    """The oracle: full-sequence logits, incremental greedy decode, and the MTP head."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64,
                 device="cpu"):
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"reference model: dtype must be torch.float64 or torch.float32, got {dtype}")
        self.config = config
        self.dtype = dtype
        # the same plain torch ops on any device (a GPU runs the long-context cases in a fraction of the time)
        self.device = torch.device(device)
        if any(name.endswith("in_proj_qkvz.weight") for name in weights):
            weights = split_qwen3_next_weights(weights, config)
        self.w = {name: t.detach().to(device=self.device, dtype=dtype) for name, t in weights.items()}
        if config.tie_word_embeddings and "model.embed_tokens.weight" in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self._validate_weights()

    # ---- weights ----
    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        h = c.hidden_size
        shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
                  "lm_head.weight": (c.vocab_size, h)}
        for i, kind in enumerate(c.layer_types):
            shapes.update(self._layer_shapes(f"model.layers.{i}.", kind))
        if "mtp.fc.weight" in self.w:
            shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
            shapes.update(self._layer_shapes("mtp.layers.0.", "full_attention"))
        return shapes

    def _layer_shapes(self, p: str, kind: str) -> dict[str, tuple[int, ...]]:
        c = self.config
        h, d = c.hidden_size, c.head_dim
        inter = c.intermediate_size
        shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                  p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                  p + "mlp.down_proj.weight": (h, inter)}
        if kind == "linear_attention":
            a = p + "linear_attn."
            hv = c.linear_num_value_heads
            shapes.update({a + "in_proj_qkv.weight": (c.conv_dim, h), a + "in_proj_z.weight": (c.value_dim, h),
                           a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
                           a + "conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel_dim),
                           a + "A_log": (hv,), a + "dt_bias": (hv,), a + "norm.weight": (c.linear_value_head_dim,),
                           a + "out_proj.weight": (h, c.value_dim)})
        else:
            a = p + "self_attn."
            hq, hkv = c.num_attention_heads, c.num_key_value_heads
            shapes.update({a + "q_proj.weight": (2 * hq * d, h), a + "k_proj.weight": (hkv * d, h),
                           a + "v_proj.weight": (hkv * d, h), a + "o_proj.weight": (h, hq * d),
                           a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
        return shapes

    def _validate_weights(self) -> None:
        for name, shape in self._expected_shapes().items():
            if name not in self.w:
                raise ValueError(f"reference model: weight {name!r} is missing (expected shape {shape})")
            got = tuple(self.w[name].shape)
            if name.endswith("conv1d.weight") and got == shape[::2]:  # [conv_dim, W] without the group dim
                self.w[name] = self.w[name][:, None, :]
            elif got != shape:
                raise ValueError(f"reference model: weight {name!r} has shape {got}, expected {shape}")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    # ---- mixers ----
    def _gated_deltanet(self, p: str, x: torch.Tensor, st: DecodeState) -> torch.Tensor:
        """Gated DeltaNet over x [T, H], continuing from (and updating) the layer's conv and S state."""
        c = self.config
        t_len, width = x.shape[0], c.linear_conv_kernel_dim
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim

        # Depthwise causal conv: each output sees its own input and the W-1 before it.
        qkv = self._linear(x, p + "in_proj_qkv")  # [T, conv_dim]
        past = st.conv.get(p, torch.zeros(width - 1, c.conv_dim, dtype=self.dtype, device=self.device))
        window = torch.cat([past, qkv])  # [W-1+T, conv_dim]
        st.conv[p] = window[window.shape[0] - (width - 1):]
        taps = window.unfold(0, width, 1)  # [T, conv_dim, W], taps[t, :, j] = window[t + j]
        qkv = F.silu((taps * self.w[p + "conv1d.weight"][:, 0, :]).sum(-1))

        q, k, v = qkv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = l2_normalize(q.reshape(t_len, hk, dk)) * dk ** -0.5
        k = l2_normalize(k.reshape(t_len, hk, dk))
        v = v.reshape(t_len, hv, dv)
        q = q.repeat_interleave(hv // hk, dim=1)  # [T, Hv, dk]: v head i reads k head i // (Hv/Hk)
        k = k.repeat_interleave(hv // hk, dim=1)
        beta = torch.sigmoid(self._linear(x, p + "in_proj_b"))  # [T, Hv]
        g = -torch.exp(self.w[p + "A_log"]) * F.softplus(self._linear(x, p + "in_proj_a") + self.w[p + "dt_bias"])

        s = st.ssm.get(p, torch.zeros(hv, dk, dv, dtype=self.dtype, device=self.device))  # [Hv, dk, dv]
        out = torch.empty(t_len, hv, dv, dtype=self.dtype, device=self.device)
        for t in range(t_len):
            s = s * torch.exp(g[t])[:, None, None]
            recalled = torch.einsum("hkv,hk->hv", s, k[t])  # S^T k
            delta = beta[t][:, None] * (v[t] - recalled)
            s = s + k[t][:, :, None] * delta[:, None, :]  # S += k delta^T
            out[t] = torch.einsum("hkv,hk->hv", s, q[t])  # o = S^T q
        st.ssm[p] = s

        z = self._linear(x, p + "in_proj_z").reshape(t_len, hv, dv)
        out = gated_rms_norm(out, z, self.w[p + "norm.weight"], c.rms_norm_eps)
        return self._linear(out.reshape(t_len, hv * dv), p + "out_proj")

    def _attention(self, p: str, x: torch.Tensor, st: DecodeState) -> torch.Tensor:
        """Gated causal GQA attention over x [T, H] at positions st.position.., appending to the layer's K/V."""
        c = self.config
        t_len, hq, hkv, d = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps = c.rms_norm_eps
        positions = torch.arange(st.position, st.position + t_len, device=self.device)

        q_and_gate = self._linear(x, p + "q_proj").reshape(t_len, hq, 2 * d)  # per head: [query | gate]
        q, gate = q_and_gate[..., :d], q_and_gate[..., d:]
        q = rms_norm(q, self.w[p + "q_norm.weight"], eps)
        k = rms_norm(self._linear(x, p + "k_proj").reshape(t_len, hkv, d), self.w[p + "k_norm.weight"], eps)
        v = self._linear(x, p + "v_proj").reshape(t_len, hkv, d)
        q = rope(q, positions, c.rotary_dim, c.rope_theta)
        k = rope(k, positions, c.rotary_dim, c.rope_theta)

        st.keys.setdefault(p, []).append(k)
        st.values.setdefault(p, []).append(v)
        # [S, Hq, D]: query head h reads kv head h // (Hq/Hkv)
        keys = torch.cat(st.keys[p]).repeat_interleave(hq // hkv, dim=1)
        values = torch.cat(st.values[p]).repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) * d ** -0.5  # [Hq, T, S]
        visible = torch.arange(keys.shape[0], device=self.device)[None, :] <= positions[:, None]  # [T, S] causal
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.einsum("hts,shd->thd", probs, values).reshape(t_len, hq * d)
        return self._linear(out * torch.sigmoid(gate.reshape(t_len, hq * d)), p + "o_proj")

    def _decoder_layer(self, p: str, kind: str, x: torch.Tensor, st: DecodeState) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        h = rms_norm(x, self.w[p + "input_layernorm.weight"], eps)
        if kind == "linear_attention":
            x = x + self._gated_deltanet(p + "linear_attn.", h, st)
        else:
            x = x + self._attention(p + "self_attn.", h, st)
        h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], eps)
        return x + self._linear(F.silu(self._linear(h, p + "mlp.gate_proj")) * self._linear(h, p + "mlp.up_proj"),
                                p + "mlp.down_proj")

    # ---- public entry points ----
    def _as_ids(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"reference model: token ids must be in [0, {self.config.vocab_size}), "
                             f"got range [{int(ids.min())}, {int(ids.max())}]")
        return ids

    def _run(self, ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
        """Decoder stack over new tokens, continuing ``st``; returns hidden before the final norm [T, H]."""
        x = self.w["model.embed_tokens.weight"][ids]
        for i, kind in enumerate(self.config.layer_types):
            x = self._decoder_layer(f"model.layers.{i}.", kind, x, st)
        st.position += ids.numel()
        return x

    def _logits(self, hidden: torch.Tensor, norm: str = "model.norm.weight") -> torch.Tensor:
        return rms_norm(hidden, self.w[norm], self.config.rms_norm_eps) @ self.w["lm_head.weight"].T

    @torch.no_grad()
    def forward(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Full sequence from scratch: (logits [T, V], hidden before the final norm [T, H]) in self.dtype."""
        hidden = self._run(self._as_ids(ids), DecodeState())
        return self._logits(hidden), hidden

    @torch.no_grad()
    def greedy(self, ids, max_new_tokens: int, top_k: int = 8, stop_ids=(), prefill_chunk: int | None = None) -> dict:
        """Greedy decode with the oracle's own incremental state (conv window, S per head, K/V lists).

        The prompt is prefilled in pieces of ``prefill_chunk`` tokens (all at once when None), then one
        token per step. Each step records the argmax token and the top-k of the log-softmax over the
        full vocabulary. Stops after ``max_new_tokens`` or after emitting a token in ``stop_ids``.
        Returns {"tokens": [int], "topk_ids": [[int]] per step, "topk_logprobs": [[float]] per step}.
        """
        ids = self._as_ids(ids)
        if ids.numel() == 0:
            raise ValueError("reference model: greedy needs a non-empty prompt")
        if max_new_tokens < 0 or top_k < 1:
            raise ValueError(f"reference model: need max_new_tokens >= 0 and top_k >= 1, "
                             f"got {max_new_tokens} and {top_k}")
        chunk = prefill_chunk or ids.numel()
        st = DecodeState()
        for start in range(0, ids.numel(), chunk):
            hidden = self._run(ids[start:start + chunk], st)
        stop = {int(s) for s in stop_ids}
        result = {"tokens": [], "topk_ids": [], "topk_logprobs": []}
        for step in range(max_new_tokens):
            logprobs = torch.log_softmax(self._logits(hidden[-1]), dim=-1)
            top = torch.topk(logprobs, min(top_k, logprobs.numel()))
            token = int(torch.argmax(logprobs))
            result["tokens"].append(token)
            result["topk_ids"].append([int(i) for i in top.indices])
            result["topk_logprobs"].append([float(v) for v in top.values])
            if token in stop or step == max_new_tokens - 1:
                break
            hidden = self._run(torch.tensor([token], device=self.device), st)
        return result

    @torch.no_grad()
    def mtp_logits(self, hidden: torch.Tensor, next_ids, *, mtp_uses_prenorm_hidden: bool = False) -> torch.Tensor:
        """One MTP step over a whole sequence: row t predicts token t+2 from h_t and token t+1.

        ``hidden`` [T, H] is ``forward()``'s hidden (before ``model.norm``); ``next_ids`` [T] are the ids
        shifted by one. ``x = fc(cat[norm_e(embed(next_ids)), norm_h(h)])`` -> one full-attention layer
        (``mtp.layers.0``, its own causal K/V, RoPE positions 0..T-1, i.e. row t at the position of
        token t as in the main sequence) -> ``mtp.norm`` -> ``lm_head``. Returns [T, V].

        Which h feeds ``norm_h``: by default the main model's output AFTER ``model.norm`` - that is the
        hidden state vLLM (``Qwen3NextModel.forward`` returns the normed state to its MTP proposer) and
        SGLang (``spec_info.hidden_states``, captured at the logits processor) hand to the Qwen3-Next MTP
        module. ``mtp_uses_prenorm_hidden=True`` feeds the last decoder layer's output before the norm.
        """
        if "mtp.fc.weight" not in self.w:
            raise ValueError("reference model: the weights have no MTP head (mtp.fc.weight is missing)")
        next_ids = self._as_ids(next_ids)
        hidden = hidden.to(self.dtype)
        if hidden.ndim != 2 or hidden.shape != (next_ids.numel(), self.config.hidden_size):
            raise ValueError(f"reference model: mtp_logits needs hidden [T, {self.config.hidden_size}] and "
                             f"next_ids [T], got {tuple(hidden.shape)} and {tuple(next_ids.shape)}")
        eps = self.config.rms_norm_eps
        if not mtp_uses_prenorm_hidden:
            hidden = rms_norm(hidden, self.w["model.norm.weight"], eps)
        e = rms_norm(self.w["model.embed_tokens.weight"][next_ids], self.w["mtp.pre_fc_norm_embedding.weight"], eps)
        h = rms_norm(hidden, self.w["mtp.pre_fc_norm_hidden.weight"], eps)
        x = self._linear(torch.cat([e, h], dim=-1), "mtp.fc")
        x = self._decoder_layer("mtp.layers.0.", "full_attention", x, DecodeState())
        return self._logits(x, norm="mtp.norm.weight")
