"""Per-slot caches of the hybrid model: K/V for full-attention layers, conv and recurrent state for Gated DeltaNet.

Layout (``slots`` sequence slots, ``capacity`` tokens per slot):

- full-attention layer: ``k``/``v`` ``[slots, Hkv, capacity, head_dim]`` in bf16 / fp16, or for ``int8`` codes of
  that shape plus one fp16 scale per 64 contiguous values per token per head, ``[slots, Hkv, capacity, ceil(hd/64)]``
  (symmetric: ``scale = amax / 127``).
- Gated DeltaNet layer: ``conv`` ``[slots, conv_dim, W-1]`` (the last W-1 conv inputs) in the compute dtype and
  ``ssm`` ``[slots, Hv, dk, dv]`` in fp32.
- the MTP head's own full-attention layer(s) get K/V like any full layer (keys ``"mtp0"``, ...).

Speculative rollback lives here too: a verify pass over T positions records, per GDN layer, what it needs to
restore the state to any accepted prefix; :meth:`HybridCache.commit` then rolls every slot back to its accepted
length. Two strategies, same result: ``snapshot`` keeps the state after every position (memory: T states per
layer), ``recompute`` keeps the pre-verify state and the recurrence inputs and re-runs the recurrence with the
rejected positions masked out (beta = 0 and g = 0 leave the state unchanged). Both are pure tensor ops with no
host synchronisation, so they can sit inside a captured CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...kernels.gdn import gated_delta_rule_step
from ...kernels.gdn_triton import GDNWorkspace, gdn_commit
from ...kernels.kv_quant import KV_GROUP, dequantize_kv, quantize_kv
from .config import ModelConfig

KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


@dataclass(slots=True)
class KVLayer:
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass(slots=True)
class PendingGDN:
    """What a verify pass left for :meth:`HybridCache.commit` on one GDN layer (B = the verified slots)."""

    conv_in: torch.Tensor  # [B, T, C] conv inputs of the verified positions
    conv_old: torch.Tensor  # [B, C, W-1] conv state before the pass
    ssm_old: torch.Tensor | None = None  # [B, Hv, dk, dv] (recompute)
    inputs: tuple | None = None  # (q, k, v, g, beta) of the pass (recompute)
    states: torch.Tensor | None = None  # [B, T, Hv, dk, dv] state after each position (snapshot)


@dataclass(slots=True)
class Pending:
    slots: torch.Tensor  # [B] slot indices of the verify pass
    layers: dict[int, PendingGDN] = field(default_factory=dict)
    stack: GDNWorkspace | None = None  # the fused path's workspace stacks over every GDN layer (gdn_triton.new_stack)
    stacked: set = field(default_factory=set)  # the layers that wrote into ``stack``


class HybridCache:
    """All per-sequence state of one Engine, indexed by slot."""

    def __init__(self, cfg: ModelConfig, *, slots: int, capacity: int, kv_dtype: str = "bf16",
                 dtype=torch.float32, device="cpu", mtp_layers: int = 0, rollback: str = "recompute"):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        if rollback not in ("recompute", "snapshot"):
            raise ValueError(f"rollback must be 'recompute' or 'snapshot', got {rollback!r}")
        if slots <= 0 or capacity <= 0:
            raise ValueError(f"cache needs slots > 0 and capacity > 0, got {slots} and {capacity}")
        self.cfg, self.slots, self.capacity = cfg, slots, capacity
        self.kv_dtype, self.dtype, self.device, self.rollback = kv_dtype, dtype, torch.device(device), rollback
        hkv, hd = cfg.num_key_value_heads, cfg.head_dim
        self.kv: dict = {}
        for key in list(cfg.full_layers) + [f"mtp{i}" for i in range(mtp_layers)]:
            self.kv[key] = self._kv_layer(slots, hkv, capacity, hd)
        w = cfg.linear_conv_kernel_dim
        lin = list(cfg.linear_layers)
        # one stack per kind over the GDN layers (``conv[i]`` / ``ssm[i]`` are views of it): a rollback of every
        # layer is then one launch (kernels/gdn_triton.gdn_commit)
        self.gdn_index = {i: j for j, i in enumerate(lin)}
        self.conv_all = torch.zeros(len(lin), slots, cfg.conv_dim, w - 1, dtype=dtype, device=device)
        self.ssm_all = torch.zeros(len(lin), slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                   cfg.linear_value_head_dim, dtype=torch.float32, device=device)
        self.conv = {i: self.conv_all[j] for j, i in enumerate(lin)}
        self.ssm = {i: self.ssm_all[j] for j, i in enumerate(lin)}
        self.pending: Pending | None = None

    def _kv_layer(self, slots, hkv, cap, hd) -> KVLayer:
        shape = (slots, hkv, cap, hd)
        if self.kv_dtype == "int8":
            groups = (hd + KV_GROUP - 1) // KV_GROUP
            sshape = (slots, hkv, cap, groups)
            return KVLayer(torch.zeros(shape, dtype=torch.int8, device=self.device),
                           torch.zeros(shape, dtype=torch.int8, device=self.device),
                           torch.ones(sshape, dtype=torch.float16, device=self.device),
                           torch.ones(sshape, dtype=torch.float16, device=self.device))
        dt = KV_DTYPES[self.kv_dtype]
        return KVLayer(torch.zeros(shape, dtype=dt, device=self.device),
                       torch.zeros(shape, dtype=dt, device=self.device))

    @property
    def nbytes(self) -> int:
        total = 0
        for layer in self.kv.values():
            for t in (layer.k, layer.v, layer.k_scale, layer.v_scale):
                total += t.numel() * t.element_size() if t is not None else 0
        for d in (self.conv, self.ssm):
            total += sum(t.numel() * t.element_size() for t in d.values())
        return total

    # ---- K/V -------------------------------------------------------------------------------------
    def write_kv(self, key, slots: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[B, T, Hkv, hd]`` at positions ``pos [B, T]`` of ``slots [B]``."""
        layer = self.kv[key]
        b, t = pos.shape
        sl = slots[:, None].expand(b, t)
        if self.kv_dtype == "int8":
            kq, ks = quantize_kv(k)
            vq, vs = quantize_kv(v)
            layer.k[sl, :, pos] = kq
            layer.v[sl, :, pos] = vq
            layer.k_scale[sl, :, pos] = ks
            layer.v_scale[sl, :, pos] = vs
        else:
            layer.k[sl, :, pos] = k.to(layer.k.dtype)
            layer.v[sl, :, pos] = v.to(layer.v.dtype)

    def read_kv(self, key, slots: torch.Tensor, length: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, Hkv, length, hd]`` of ``slots`` in ``dtype`` (dequantized for int8)."""
        layer = self.kv[key]
        # index_select on the sliced view, not t[slots, :, :length]: the same copy, 13x faster for int8 codes on a CPU
        k, v = layer.k[:, :, :length].index_select(0, slots), layer.v[:, :, :length].index_select(0, slots)
        if self.kv_dtype == "int8":
            return (dequantize_kv(k, layer.k_scale[:, :, :length].index_select(0, slots), dtype),
                    dequantize_kv(v, layer.v_scale[:, :, :length].index_select(0, slots), dtype))
        return k.to(dtype), v.to(dtype)

    # ---- slots -----------------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """Zero the recurrent state of ``slot`` (K/V need no clearing: lengths say what is valid)."""
        for i in self.conv:
            self.conv[i][slot].zero_()
            self.ssm[i][slot].zero_()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Duplicate the state of ``src`` (first ``length`` tokens of K/V) into ``dst``."""
        for layer in self.kv.values():
            for t in (layer.k, layer.v, layer.k_scale, layer.v_scale):
                if t is not None:
                    t[dst, :, :length] = t[src, :, :length]
        for i in self.conv:
            self.conv[i][dst] = self.conv[i][src]
            self.ssm[i][dst] = self.ssm[i][src]

    def export_slot(self, slot: int, length: int) -> dict:
        """A CPU copy of everything ``slot`` holds (for persistent sessions)."""
        out = {"length": length, "kv": {}, "conv": {}, "ssm": {}}
        for key, layer in self.kv.items():
            out["kv"][str(key)] = [t[slot, :, :length].cpu().clone() if t is not None else None
                                   for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)]
        for i in self.conv:
            out["conv"][str(i)] = self.conv[i][slot].cpu().clone()
            out["ssm"][str(i)] = self.ssm[i][slot].cpu().clone()
        return out

    def slot_shapes(self, length: int) -> dict:
        """What :meth:`export_slot` gives for ``length`` tokens, as (dtype, shape) pairs (None where it holds None):
        the template a saved state must match."""
        out = {"kv": {}, "conv": {}, "ssm": {}}
        for key, layer in self.kv.items():
            out["kv"][str(key)] = [None if t is None else (t.dtype, (t.shape[1], length, t.shape[3]))
                                   for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)]
        for i in self.conv:
            out["conv"][str(i)] = (self.conv[i].dtype, tuple(self.conv[i].shape[1:]))
            out["ssm"][str(i)] = (self.ssm[i].dtype, tuple(self.ssm[i].shape[1:]))
        return out

    def import_slot(self, slot: int, state: dict) -> int:
        """Load a state made by :meth:`export_slot` into ``slot``; returns its length."""
        length = state["length"]
        if length > self.capacity:
            raise ValueError(f"saved state holds {length} tokens, more than the slot capacity {self.capacity}")
        for key, layer in self.kv.items():
            saved = state["kv"][str(key)]
            for t, s in zip((layer.k, layer.v, layer.k_scale, layer.v_scale), saved):
                if t is not None:
                    t[slot, :, :length] = s.to(t.device, t.dtype)
        for i in self.conv:
            self.conv[i][slot] = state["conv"][str(i)].to(self.device, self.conv[i].dtype)
            self.ssm[i][slot] = state["ssm"][str(i)].to(self.device)
        return length

    # ---- speculative rollback --------------------------------------------------------------------
    def begin_verify(self, slots: torch.Tensor) -> None:
        self.pending = Pending(slots=slots)

    def record(self, layer: int, rec: PendingGDN) -> None:
        if self.pending is not None:
            self.pending.layers[layer] = rec

    def commit(self, keep: torch.Tensor) -> None:
        """Roll every verified slot back to its first ``keep[b]`` (1..T) positions of the verify pass.

        K/V need nothing: the caller's lengths decide what is valid, and stale entries are overwritten.
        """
        pend, self.pending = self.pending, None
        if pend is None:
            raise RuntimeError("commit() without a verify pass")
        slots = pend.slots
        if pend.stack is not None:
            if pend.stacked != set(self.gdn_index):
                raise RuntimeError(f"commit(): the verify pass stacked GDN layers {sorted(pend.stacked)}, not all "
                                   f"{len(self.gdn_index)}")
            # every layer's recurrence rerun from the pre-verify state over the pass's workspaces: one launch
            gdn_commit(pend.stack, self.conv_all, self.ssm_all, slots, keep)
        # on a CPU the host reads ``keep`` for free: a layer whose every row keeps the whole pass is left as the pass
        # wrote it, and the recompute re-runs only the positions some row keeps (the masked ones change nothing)
        kept = keep.tolist() if keep.device.type == "cpu" else None
        for i, rec in pend.layers.items():
            b, t, c = rec.conv_in.shape
            if kept is not None and min(kept) >= t:
                continue  # the pass's own conv window and state (the same ops on the same inputs as a recompute)
            n = t if kept is None else max(kept)
            same = kept is not None and min(kept) == n  # every row keeps n: slices instead of gathers and masks
            w1 = rec.conv_old.shape[-1]
            # conv window after keep[b] tokens: the W-1 inputs ending at keep[b] in cat(old, new)
            seq = torch.cat([rec.conv_old, rec.conv_in.transpose(1, 2).to(rec.conv_old.dtype)], dim=-1)
            if same:
                self.conv[i][slots] = seq[..., n:n + w1]
            else:
                idx = keep.view(b, 1, 1) + torch.arange(w1, device=seq.device).view(1, 1, w1)
                self.conv[i][slots] = torch.gather(seq, 2, idx.expand(b, c, w1))
            if rec.states is not None:
                if same:
                    self.ssm[i][slots] = rec.states[:, n - 1]
                else:
                    sel = (keep - 1).view(b, 1, 1, 1, 1).expand(b, 1, *rec.states.shape[2:])
                    self.ssm[i][slots] = torch.gather(rec.states, 1, sel).squeeze(1)
            else:
                q, k, v, g, beta = (x[:, :n] for x in rec.inputs)
                if not same:  # rows keeping fewer positions: theirs past keep masked (beta = 0, g = 0: no change)
                    live = (torch.arange(n, device=g.device).view(1, n) < keep.view(b, 1)).to(g.dtype)[..., None]
                    g, beta = g * live, beta * live
                _, state = gated_delta_rule_step(q, k, v, g, beta, rec.ssm_old)
                self.ssm[i][slots] = state

    def discard_verify(self) -> None:
        self.pending = None
