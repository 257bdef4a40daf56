"""DFlash and DFlash2 block drafters: one torch module, used to train the drafters and to run them.

A drafter sees the target through its tap layers: the outputs of ``target_layer_ids`` at every committed
position are concatenated, projected by ``fc`` and RMS-normed into context features, whose keys and values
each drafter layer computes once. A block is ``[anchor, mask x K]`` (the anchor is the last committed token)
embedded with the target's embedding table; each layer's queries come from the block, its keys/values from
[context ; block] with no causal mask inside the block; the final hidden states of block positions 1..K go
through the target's ``lm_head``, drafting K tokens in one forward.

DFlash2 adds (a) a sliding window: a block sees only the last ``window`` context positions (at inference a
ring of that many K/V entries per slot), and (b) a candidate selector: the top-``candidates`` tokens of
each position's logits are re-scored left to right with a low-rank previous-token term
``<pred[prev] * proj(h_i), succ[cand]>``, so each draft depends on the one chosen before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import fused, select
from ...kernels.attention import rows_bias, sdpa, sdpa_rows
from ...kernels.draft_attention import draft_attention
from ...kernels.norm import rms_norm
from ...kernels.rope import apply_rope, rope_tables
from .config import DraftConfig

ROWS_MATMUL = 128  # query rows (block x group) up to which drafting attention runs as matmuls on a GPU


def fused_glue(x: torch.Tensor) -> bool:
    """Whether a drafter's glue (norms, q / k rotation) runs as kernels/fused.py's single launches: inference on a
    GPU with Triton. Training (autograd) and CPUs keep the eager ops."""
    return x.is_cuda and not torch.is_grad_enabled() and fused.triton_available()


def draft_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A drafter's zero-centred RMSNorm: one fused launch at inference on a GPU, the eager norm elsewhere (the same
    function, fp32 math; the two may differ in the last bit)."""
    if fused_glue(x) and x.shape[-1] <= fused.MAX_ROW:
        return fused.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


class Rotary:
    """The rotary positions ``pos [B, L]`` of one drafter pass, shared by its layers: ``rot(x, norm)`` is
    ``rope(norm(x))`` for q / k heads ``x [B, L, H, hd]``. At inference on a GPU one fused.norm_rope launch over the
    drafter's reserved tables; else cos / sin gathered once and the eager norm and rotation."""

    def __init__(self, drafter: BlockDrafter, pos: torch.Tensor):
        self.pos = pos
        self.fused = fused_glue(pos) and drafter._rope_covers > 0 and drafter._rope[0].device == pos.device
        if self.fused:
            self.cos, self.sin = drafter._rope
        else:
            self.cos, self.sin = drafter.rope(pos)

    def __call__(self, x: torch.Tensor, norm: ZeroCentredRMSNorm) -> torch.Tensor:
        if self.fused:
            return fused.norm_rope(x, norm.weight, self.cos, self.sin, self.pos, norm.eps)
        return apply_rope(norm(x), self.cos, self.sin)


class ZeroCentredRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)`` with ``w`` initialised to zero (as the target's norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return draft_norm(x, self.weight, self.eps)


@dataclass(frozen=True, slots=True)
class RingContext:
    """A block's context read in place by :func:`kernels.draft_attention.draft_attention` (inference on a GPU): layer
    i's cache rows ``keys[i]`` / ``values[i]`` ``[slots, rows, Hkv, hd]``, the first ``cap`` of them context at the
    positions ``pos [slots, rows]`` (-1: empty); the drafting rows' slots ``slots [B]`` and lengths ``length [B]`` (the
    block's first position); ``window`` (0: every earlier position is visible)."""

    keys: list
    values: list
    pos: torch.Tensor
    slots: torch.Tensor
    length: torch.Tensor
    cap: int
    window: int


class DraftLayer(nn.Module):
    """Pre-norm block: attention of block queries over [context ; block] keys, then a SwiGLU MLP."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        h, hd = c.hidden_size, c.head_dim
        self.input_layernorm = ZeroCentredRMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(h, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, h, bias=False)
        self.q_norm = ZeroCentredRMSNorm(hd, c.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        # q | k | v and gate | up as one packed projection each, set by the engine where it keeps weights packed
        # (engine/spec/drafters.fused_projections); inference only
        self.qkv = self.gate_up = None

    def kv(self, x, rot: Rotary):
        """Keys and values ``[B, L, Hkv, hd]`` of inputs ``x [B, L, H]`` (k-normed, rotated)."""
        b, n, _ = x.shape
        k = rot(self.k_proj(x).view(b, n, -1, self.c.head_dim), self.k_norm)
        v = self.v_proj(x).view(b, n, -1, self.c.head_dim)
        return k, v

    def rows(self, x: torch.Tensor) -> bool:
        """Whether the block ``x [B, S, H]`` attends as matmuls (:func:`sdpa_rows`): drafting on a GPU, a block of a
        few rows against the context, where two matmuls beat the fused kernels' one program a head. Training and
        CPU runs keep sdpa."""
        return (x.is_cuda and not self.training
                and x.shape[1] * self.c.num_attention_heads // self.c.num_key_value_heads <= ROWS_MATMUL)

    def forward(self, x, rot: Rotary, ctx_k, ctx_v, mask, room: int | None = None, ring: RingContext | None = None):
        """x ``[B, S, H]`` block states; ctx_k/v ``[B, Lc, Hkv, hd]``; mask ``[B, 1, S, Lc + S]`` (True = visible),
        or with :meth:`rows` its :func:`rows_bias`. With ``room`` = Lc, ctx_k/v have rows past Lc and the block's
        keys and values go there in place (the same tensors as concatenating them). With ``ring``, ctx_k/v are this
        layer's cache rows of every slot ``[slots, rows, Hkv, hd]`` and ``mask`` is unused: the context is read in
        place and the block's keys and values are not written anywhere."""
        b, s, _ = x.shape
        hd = self.c.head_dim
        y = self.input_layernorm(x)
        fuse = not self.training and not torch.is_grad_enabled()
        if fuse and self.qkv is not None:
            nq, nkv = self.c.num_attention_heads * hd, self.c.num_key_value_heads * hd
            q, k_blk, v_blk = torch.split(self.qkv(y), [nq, nkv, nkv], dim=-1)
            q = rot(q.view(b, s, -1, hd), self.q_norm)
            k_blk, v_blk = rot(k_blk.view(b, s, -1, hd), self.k_norm), v_blk.view(b, s, -1, hd)
        else:
            q = rot(self.q_proj(y).view(b, s, -1, hd), self.q_norm)
            k_blk, v_blk = self.kv(y, rot)
        if ring is not None:
            o = draft_attention(q, k_blk, v_blk, ctx_k, ctx_v, ring.slots, ring.pos, ring.length, ring.cap,
                                ring.window, hd ** -0.5)
            return self._mlp(x + self.o_proj(o.reshape(b, s, -1)), fuse)
        if room is None:
            k = torch.cat([ctx_k, k_blk], dim=1).transpose(1, 2)  # [B, Hkv, Lc + S, hd]
            v = torch.cat([ctx_v, v_blk], dim=1).transpose(1, 2)
        else:
            ctx_k[:, room:room + s] = k_blk
            ctx_v[:, room:room + s] = v_blk
            k, v = ctx_k[:, :room + s].transpose(1, 2), ctx_v[:, :room + s].transpose(1, 2)
        attend = sdpa_rows if self.rows(x) else sdpa
        o = attend(q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), mask, hd ** -0.5)
        return self._mlp(x + self.o_proj(o.transpose(1, 2).reshape(b, s, -1)), fuse)

    def _mlp(self, x, fuse: bool):
        """``x`` plus the SwiGLU MLP of its post-attention norm."""
        y = self.post_attention_layernorm(x)
        if fuse and self.gate_up is not None and fused_glue(y):
            return x + self.down_proj(fused.silu_mul(self.gate_up(y), self.c.intermediate_size))
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


def ordered_topk(x: torch.Tensor, k: int):
    """``torch.topk(x.float(), k)`` along the last dim with ties in one order (equal values by ascending column):
    (values, columns). kernels/select.py's two launches at inference on a GPU, its torch reference elsewhere (the
    same bits)."""
    if fused_glue(x) and k <= 64:
        return select.ordered_topk(x, k)
    return select.ordered_topk_ref(x, k)


class CandidateSelector(nn.Module):
    """DFlash2's top-k walk with a low-rank previous-token scorer."""

    def __init__(self, vocab: int, hidden: int, rank: int, candidates: int):
        super().__init__()
        self.candidates = candidates
        self.pred = nn.Embedding(vocab, rank)
        self.succ = nn.Embedding(vocab, rank)
        self.proj = nn.Linear(hidden, rank, bias=False)
        nn.init.normal_(self.pred.weight, std=0.02)
        nn.init.normal_(self.succ.weight, std=0.02)

    def pair_scores(self, hidden, prev, cand):
        """Score of candidates ``cand [..., C]`` after ``prev [...]`` given ``hidden [..., H]``: ``[..., C]``."""
        a = self.pred(prev) * self.proj(hidden)  # [..., r]
        return torch.einsum("...r,...cr->...c", a, self.succ(cand))

    def walk(self, hidden, logits, anchor, temperature: float = 0.0, generator=None, ids_map=None):
        """Left-to-right selection over ``hidden [B, K, H]``, ``logits [B, K, N]`` from ``anchor [B]``.

        ``ids_map [N]`` maps logit columns to vocabulary ids when the logits cover only part of the
        vocabulary. Returns (tokens [B, K], candidates [B, K, C], q [B, K, C] or None), tokens and candidates
        as vocabulary ids; q is the sampling distribution over each position's candidates (None if greedy)."""
        unary, cand = ordered_topk(logits, self.candidates)
        if ids_map is not None:
            cand = ids_map[cand]
        if temperature <= 0:
            return self.greedy_walk(hidden, unary, cand, anchor), cand, None
        prev, toks, qs = anchor, [], []
        for i in range(hidden.shape[1]):  # sampling: each draw conditions the next position's scores
            scores = unary[:, i] + self.pair_scores(hidden[:, i], prev, cand[:, i]).float()
            q = torch.softmax(scores / temperature, dim=-1)
            idx = torch.multinomial(q, 1, generator=generator).squeeze(-1)
            qs.append(q)
            prev = cand[:, i].gather(1, idx[:, None]).squeeze(1)
            toks.append(prev)
        return torch.stack(toks, 1), cand, torch.stack(qs, 1)

    def greedy_walk(self, hidden, unary, cand, anchor) -> torch.Tensor:
        """The greedy walk's tokens ``[B, K]``: every pair score at once - position i's candidates after each of
        position i - 1's (after the anchor at i = 0), ``[B, K, C, C]`` - then K argmaxes, each over the row the
        previous choice picks. Position i's choice is the sampling loop's at temperature 0 (the same unary + pair
        score, argmax); launches: a handful, then the walk (one on a GPU), against ten a position one at a time."""
        b, k, c = cand.shape
        prev = torch.cat([anchor[:, None, None].expand(b, 1, c), cand[:, :-1]], dim=1)  # [B, K, C]
        a = self.pred(prev) * self.proj(hidden)[:, :, None]  # [B, K, C, r]
        scores = unary[:, :, None] + torch.matmul(a, self.succ(cand).transpose(-1, -2)).float()  # [B, K, Cp, C]
        if fused_glue(scores):  # the K argmaxes in one launch (the same picks)
            return select.greedy_walk(scores.contiguous(), cand.contiguous())
        return select.greedy_walk_ref(scores, cand)


class BlockDrafter(nn.Module):
    """A DFlash / DFlash2 drafter. Weight names (under the artifact's ``dflash.`` / ``dflash2.`` prefix):
    ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``, and for DFlash2 ``selector.{pred,succ,proj}``."""

    def __init__(self, c: DraftConfig, target_hidden: int, vocab: int):
        super().__init__()
        if c.hidden_size != target_hidden:
            raise ValueError(f"drafter hidden_size {c.hidden_size} must equal the target's {target_hidden} "
                             f"(it shares the target's embeddings and lm_head)")
        self.c = c
        self.fc = nn.Linear(len(c.target_layer_ids) * target_hidden, c.hidden_size, bias=False)
        self.hidden_norm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.selector = (CandidateSelector(vocab, c.hidden_size, c.scorer_rank, c.candidates)
                         if c.kind == "dflash2" and c.scorer_rank > 0 else None)
        self._rope = None
        self._rope_covers = 0  # reserve_rope(n): every position below n is in the table, no size check needed

    @classmethod
    def from_raws(cls, c: DraftConfig, raws: dict, target_hidden: int, vocab: int) -> BlockDrafter:
        """The drafter (fp32, on the CPU) holding an artifact component's weights, ``raws``: ``{kind}.<name>`` ->
        RawWeight, dequantized."""
        net = cls(c, target_hidden, vocab)
        net.load_state_dict({n.split(".", 1)[1]: r.dense(torch.float32) for n, r in raws.items()}, strict=True)
        return net

    def reserve_rope(self, positions: int, device) -> None:
        """Tables for every position below ``positions`` (the engine's context bound): :meth:`rope` then needs no
        ``pos.max()``, a device-to-host read that would stall every drafting round on a GPU."""
        self._rope = rope_tables(self.c.head_dim, self.c.rope_theta, max(positions, 4096), torch.device(device))
        self._rope_covers = self._rope[0].shape[0]

    def rope(self, pos: torch.Tensor):
        """cos, sin ``[.., rd]`` at positions ``pos`` (full-width rotary over head_dim)."""
        if self._rope_covers and self._rope[0].device == pos.device:
            return self._rope[0][pos], self._rope[1][pos]
        need = int(pos.max()) + 1 if pos.numel() else 1
        if self._rope is None or self._rope[0].shape[0] < need or self._rope[0].device != pos.device:
            size = max(need, 4096)
            self._rope = rope_tables(self.c.head_dim, self.c.rope_theta, size, pos.device)
        return self._rope[0][pos], self._rope[1][pos]

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Context features ``[B, L, H]`` from concatenated tap outputs ``[B, L, n_taps * H_target]``."""
        return self.hidden_norm(self.fc(taps))

    def blocks(self, x, pos, ctx_k: list, ctx_v: list, mask, room: int | None = None) -> torch.Tensor:
        """Final-normed hidden states of the block tokens ``x [B, S, H]`` at positions ``pos [B, S]``. ``room``: the
        context is ``ctx_k[:, :room]`` and each layer writes the block's keys and values right after it, in place
        (ctx_k / ctx_v then have at least room + S rows and are the caller's to overwrite)."""
        rot = Rotary(self, pos)
        if self.layers and self.layers[0].rows(x):  # the same for every layer: one additive mask for all of them
            c = self.c
            mask = rows_bias(mask, c.num_attention_heads // c.num_key_value_heads)
        for layer, k, v in zip(self.layers, ctx_k, ctx_v):
            x = layer(x, rot, k, v, mask, room)
        return self.norm(x)

    def blocks_in_place(self, x, pos, ring: RingContext) -> torch.Tensor:
        """:meth:`blocks` with each layer's context read from the drafter's cache in place (:class:`RingContext`):
        no gathered copy, no mask tensor, nothing written. Inference on a GPU with Triton."""
        rot = Rotary(self, pos)
        for layer, k, v in zip(self.layers, ring.keys, ring.values):
            x = layer(x, rot, k, v, None, ring=ring)
        return self.norm(x)

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor):
        """Per-layer context keys and values for features ``ctx [B, L, H]`` at ``pos [B, L]``."""
        rot = Rotary(self, pos)
        ks, vs = [], []
        for layer in self.layers:
            k, v = layer.kv(ctx, rot)  # context features are already normed (hidden_norm)
            ks.append(k)
            vs.append(v)
        return ks, vs


def check_drafter(c: DraftConfig, target, names_shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse a drafter that cannot run on ``target`` (a ModelConfig): taps, mask token or DFlash2 candidates outside
    it, or tensors (names without the ``dflash.`` / ``dflash2.`` prefix -> shape) other than its config implies - the
    missing, unexpected and misshapen ones all named, at load rather than mid-run. What does not depend on the target
    (block size, heads, repeated taps, ...) ``DraftConfig`` itself refuses."""
    vocab, layers = target.vocab_size, target.num_hidden_layers
    unfit = []
    if not 0 <= c.mask_token_id < vocab:
        unfit.append(f"mask_token_id {c.mask_token_id} is outside its vocabulary (0..{vocab - 1})")
    outside = [i for i in c.target_layer_ids if not 0 <= i < layers]
    if outside:
        unfit.append(f"target_layer_ids {list(c.target_layer_ids)} name layer(s) {outside} outside its layers "
                     f"(0..{layers - 1})")
    if c.kind == "dflash2" and c.scorer_rank > 0 and c.candidates > vocab:
        unfit.append(f"candidates (z-lab selector_top_k) {c.candidates} exceed its vocabulary of {vocab} tokens")
    if unfit:
        raise ValueError(f"{where}: the {c.kind} drafter does not fit this target: {'; '.join(unfit)}")
    try:
        with torch.device("meta"):  # shapes only: no memory, no init cost
            want = {n: tuple(t.shape) for n, t in BlockDrafter(c, target.hidden_size, target.vocab_size)
                    .state_dict().items()}
    except ValueError as e:  # a hidden size other than the target's
        raise ValueError(f"{where}: {e}") from None
    missing = sorted(set(want) - set(names_shapes))
    extra = sorted(set(names_shapes) - set(want))
    wrong = [f"{n} {list(names_shapes[n])} (expected {list(want[n])})" for n in sorted(set(want) & set(names_shapes))
             if tuple(names_shapes[n]) != want[n]]
    problems = ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else []) \
        + ([f"misshapen: {', '.join(wrong)}"] if wrong else [])
    if problems:
        raise ValueError(f"{where}: the {c.kind} drafter's tensors do not match its config: {'; '.join(problems)}")


def forward_train(drafter: BlockDrafter, taps: torch.Tensor, block_emb: torch.Tensor,
                  anchors: torch.Tensor) -> torch.Tensor:
    """Hidden states of many blocks of one batch of sequences in one pass (the training forward).

    taps ``[B, L, n_taps * H]`` tap outputs of the frozen target over the whole sequence; block_emb
    ``[B, nb * S, H]`` target embeddings of each block ([anchor token, mask x K]); anchors ``[B, nb]``.
    """
    b, L, _ = taps.shape
    s = drafter.c.block_size
    nb = anchors.shape[1]
    ctx_pos = torch.arange(L, device=taps.device).expand(b, L)
    ks, vs = drafter.context_kv(drafter.context(taps), ctx_pos)
    blk_pos = (anchors[..., None] + torch.arange(s, device=taps.device)).reshape(b, nb * s)
    mask = training_mask(anchors, L, s, drafter.c.window if drafter.c.kind == "dflash2" else 0)
    return drafter.blocks(block_emb, blk_pos, ks, vs, mask)


def training_mask(anchors: torch.Tensor, ctx_len: int, block: int, window: int = 0) -> torch.Tensor:
    """Attention mask ``[B, 1, nb*S, L + nb*S]`` for training many blocks of one sequence in one pass.

    Block j (anchored at position a_j, its tokens at a_j .. a_j + S - 1) sees context positions < a_j
    (only the last ``window`` of them when window > 0) and every position of its own block.
    """
    b, nb = anchors.shape
    dev = anchors.device
    qa = anchors.repeat_interleave(block, dim=1)  # [B, nb*S] anchor of each query
    kpos = torch.arange(ctx_len, device=dev)
    vis_ctx = kpos.view(1, 1, -1) < qa[..., None]
    if window > 0:
        vis_ctx &= kpos.view(1, 1, -1) >= (qa[..., None] - window)
    qb = torch.arange(nb, device=dev).repeat_interleave(block)
    vis_blk = (qb[:, None] == qb[None, :]).expand(b, -1, -1)
    return torch.cat([vis_ctx, vis_blk], dim=-1)[:, None]
