"""Qwen3.5's MTP head, trained the way the engine runs it (``engine/spec/drafters.py`` ``MTPDrafter``).

Entry ``p`` of depth 0 reads the target's final-normed hidden state ``h_p`` (the lm_head input) and the
embedding of token ``p + 1``: ``x = fc(cat[pre_fc_norm_embedding(embed(t[p+1])), pre_fc_norm_hidden(h_p)])``,
runs one full-attention decoder layer (RoPE at position ``p``, causal over the entries), ``norm``, and the
shared ``lm_head`` predicts token ``p + 2``.

The engine applies the head recursively: draft ``j`` of a round (``j >= 1``) is an entry at position
``L + j - 1`` (``L`` committed tokens) whose hidden input is the head's own normed output one position back.
Depth ``d`` here trains exactly that entry for every ``p`` at once: its input is depth ``d - 1``'s output at
``p - 1``, and its attention sees the depth-0 entries at positions ``<= p - d`` (what the engine cached for
committed tokens) plus the depth-``e`` entry at ``p - d + e`` for ``e = 1..d`` (the earlier drafts of the same
round). Positions ``p < d`` have no such entry and carry no loss.

Parameters are built from transformers' own ``Qwen3_5DecoderLayer`` (a full-attention layer) and
``Qwen3_5RMSNorm``, so ``state_dict`` names under ``mtp.`` are the Qwen3.5 checkpoint names.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def _hf():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    return mq


class MTPHead(nn.Module):
    """``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.layers.{i}.*``, ``mtp.norm``."""

    def __init__(self, text_config, num_layers: int = 1):
        super().__init__()
        mq = _hf()
        cfg = copy.deepcopy(text_config)
        cfg.layer_types = ["full_attention"] * num_layers
        cfg.num_hidden_layers = num_layers
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = mq.Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = mq.Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList(mq.Qwen3_5DecoderLayer(cfg, i) for i in range(num_layers))
        self.norm = mq.Qwen3_5RMSNorm(h, eps=eps)
        for m in self.modules():  # the target's initialisation (transformers' _init_weights)
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=text_config.initializer_range)

    def entries(self, emb_next: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Layer inputs ``[B, T, H]`` from next-token embeddings and hidden states ``[B, T, H]``."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def forward(self, hidden: torch.Tensor, emb_next: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                depths: int = 1) -> list[torch.Tensor]:
        """Normed outputs ``[B, T, H]`` of depths ``0..depths-1`` (see the module docstring).

        hidden: the target's final-normed hidden states at positions 0..T-1; emb_next: embeddings of the tokens
        at positions 1..T; cos/sin: the target's rotary tables at positions 0..T-1 (``rotary_emb`` output)."""
        outs, kv = [], [[] for _ in self.layers]
        h_in = hidden
        for d in range(depths):
            if d:  # depth d reads depth d-1's output one position back
                h_in = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
            x = self.entries(emb_next, h_in)
            for layer, cache in zip(self.layers, kv):
                x = decoder_layer(layer, x, cos, sin, cache, d)
            outs.append(self.norm(x))
        return outs


def depth_mask(t: int, d: int, device) -> torch.Tensor:
    """Visibility ``[T, (d+1)*T]`` of depth-``d`` queries over the keys of depths 0..d (True = visible)."""
    p = torch.arange(t, device=device)
    blocks = [p[None, :] <= (p[:, None] - d)]  # depth 0: committed entries up to p - d
    blocks += [p[None, :] == (p[:, None] - d + e) for e in range(1, d + 1)]
    return torch.cat(blocks, dim=1)


def decoder_layer(layer, x: torch.Tensor, cos, sin, cache: list, d: int) -> torch.Tensor:
    """``Qwen3_5DecoderLayer.forward`` of a full-attention layer, with keys/values of earlier depths in
    ``cache`` (appended to); depth 0 is plain causal attention."""
    mq = _hf()
    attn = layer.self_attn
    b, t, _ = x.shape
    hd = attn.head_dim
    y = layer.input_layernorm(x)
    q, gate = torch.chunk(attn.q_proj(y).view(b, t, -1, hd * 2), 2, dim=-1)
    gate = gate.reshape(b, t, -1)
    q = attn.q_norm(q).transpose(1, 2)  # [B, Hq, T, hd]
    k = attn.k_norm(attn.k_proj(y).view(b, t, -1, hd)).transpose(1, 2)
    v = attn.v_proj(y).view(b, t, -1, hd).transpose(1, 2)
    q, k = mq.apply_rotary_pos_emb(q, k, cos, sin)
    cache.append((k, v))
    if d == 0:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
    else:  # kv heads expanded: with an explicit mask, SDPA's GQA path would fall back to the math kernel
        groups = q.shape[1] // k.shape[1]
        kk = torch.cat([c[0] for c in cache], dim=2).repeat_interleave(groups, dim=1)
        vv = torch.cat([c[1] for c in cache], dim=2).repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, kk.to(q.dtype), vv.to(q.dtype), attn_mask=depth_mask(t, d, x.device),
                                           scale=attn.scaling)
    o = o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate)
    x = x + attn.o_proj(o)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def mtp_loss(head: MTPHead, lm_head, hidden, emb_next, labels, cos, sin, depths: int,
             weights=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted mean over depths of the cross-entropy of depth ``d`` at positions ``p >= d`` against
    ``labels[:, p]`` (the token at ``p + 2``; -100 = none). Returns (loss, detached per-depth losses)."""
    weights = weights or [1.0] * depths
    outs = head(hidden, emb_next, cos, sin, depths)
    total, parts = 0.0, []
    for d, (out, w) in enumerate(zip(outs, weights)):
        logits = lm_head(out[:, d:])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, d:].reshape(-1),
                               ignore_index=-100)
        total = total + w * loss
        parts.append(loss.detach())
    return total / sum(weights), parts
