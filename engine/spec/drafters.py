"""Drafters as the Engine runs them: MTP (recursive head with its own K/V) and DFlash / DFlash2 (block drafter
with a per-slot context K/V cache, a ring for DFlash2's window).

Protocol (what :func:`engine.spec.loop.speculative_round` calls):

- ``taps``: target layers whose outputs the drafter needs from every target forward;
- ``begin(seq, start, hidden, taps)``: after each prefill chunk of a sequence (positions ``start ..``, hidden
  ``[n, H]``, taps ``[n, n_taps*H]``); the last chunk comes after the first token was picked;
- ``draft(seqs, k) -> (tokens [B, k], q [B, k, V] | None)``: propose k tokens per sequence (q when sampling);
- ``commit(seqs, old_len, block, hidden, taps, n_acc, bonus)``: after verification of ``block [B, k+1]``
  at positions ``old_len[b] ..`` with ``n_acc`` drafts accepted, absorb the committed positions.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import quant
from ...kernels.draft_attention import block_mask
from ...kernels.draft_attention import triton_available as draft_attention_available
from ..model.dflash import BlockDrafter, RingContext, draft_norm
from ..model.hybrid import DECODE, PREFILL, Step
from ..model.weights import RawWeight, product_fp32
from ..sampling import probs
from .draft_graphs import DraftGraphs, wanted


def draft_head_ids(e) -> torch.Tensor | None:
    """Token ids of the ``--lm-head-draft`` proposal head (the N most frequent), or None for the full head."""
    n = e.options.lm_head_draft
    if not n:
        return None
    if e.loaded.info.get("synthetic"):
        # random weights have no token frequencies: the head is the first n ids. What the drafts propose then means
        # nothing (nor does it with the full head); --replay-acceptance sets the acceptance, this sets the cost
        vocab = e.config.vocab_size
        if n > vocab:
            raise ValueError(f"--lm-head-draft {n}: the vocabulary has only {vocab} tokens")
        return torch.arange(n, device=e.device)
    art = e.loaded.artifact
    if art is None or not art.has("draft_head.token_ids"):
        raise ValueError("--lm-head-draft needs token frequencies in the artifact (draft_head.token_ids); "
                         "this model has none: convert it with --draft-vocab-corpus FILES (text like what it will "
                         "write)")
    ids = art.tensor("draft_head.token_ids", torch.float32).to(torch.long)
    if n > ids.numel():
        raise ValueError(f"--lm-head-draft {n}: the artifact ranks only {ids.numel()} tokens")
    return ids[:n].to(e.device)


def draft_head_linear(e, ids: torch.Tensor):
    """lm_head restricted to rows ``ids``, held like the full head (packed rows stay packed)."""
    name = "lm_head.weight" if "lm_head.weight" in e.loaded.raws else "model.embed_tokens.weight"
    raw = e.loaded.raws[name]
    rows = ids.cpu()
    if raw.fmt in quant.QUANT_FORMATS:
        sec = {k: v[rows] for k, v in quant.sections(raw.buf, raw.fmt, raw.shape).items()}
        sub = RawWeight(raw.fmt, (len(rows), raw.shape[1]), quant.pack_sections(sec, raw.fmt, raw.shape[1]))
    else:
        sub = RawWeight(raw.fmt, (len(rows), raw.shape[1]), quant.pack(raw.dense(torch.float32)[rows], raw.fmt))
    return e.weights.linear_of(sub)


def _gather_rows(x: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """``x.index_select(dim, idx)``, copied as 8-byte words where the last dimension allows it: torch's small-index
    kernel moves one element a thread, so 2-byte elements copy at a quarter of the speed (the same bits either
    way)."""
    if x.is_contiguous() and (x.shape[-1] * x.element_size()) % 8 == 0 and x.element_size() < 8:
        return x.view(torch.int64).index_select(dim, idx).view(x.dtype)
    return x.index_select(dim, idx)


class DraftHead:
    """The head drafters score: the full ``lm_head`` or, with ``--lm-head-draft N``, its rows for the N most
    frequent tokens (ids remapped back after selection). ``scale`` / ``softcap`` reshape a drafter's logits when
    it was trained that way (z-lab's ``output_multiplier`` / ``final_logit_softcapping``)."""

    def __init__(self, engine, ids: torch.Tensor | None, scale: float = 1.0, softcap: float = 0.0):
        self.e = engine
        self.ids = ids
        self.scale, self.softcap = float(scale), float(softcap)
        self.linear = engine.weights.linear("lm_head.weight") if ids is None else draft_head_linear(engine, ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = product_fp32(self.linear, h)
        if self.e.tp is not None:  # tensor parallel: this rank's vocabulary rows; every rank's, gathered
            x = self.e.tp.gather_last(x)
        if self.scale != 1.0:
            x = x * self.scale
        if self.softcap > 0:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x

    def to_vocab(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.ids is None else self.ids[idx]

    def dense(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the head's rows as one over the whole vocabulary."""
        if self.ids is None:
            return q
        out = torch.zeros(*q.shape[:-1], self.e.config.vocab_size, dtype=q.dtype, device=q.device)
        return out.index_copy_(-1, self.ids, q) if q.dim() == 1 else out.scatter_(-1, self.ids.expand_as(q), q)


def pick(seqs, logits: torch.Tensor, head: DraftHead) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per row from head logits ``[B, N]``: argmax for greedy rows, a draw for sampling rows
    (then also the row's draft distribution over the full vocabulary)."""
    idx = logits.argmax(-1)
    if all(s.params.greedy for s in seqs):
        return head.to_vocab(idx), None
    qs = []
    for r, s in enumerate(seqs):
        if s.params.greedy:
            q = torch.zeros_like(logits[r]).scatter_(0, idx[r:r + 1], 1.0)
        else:
            q = probs(logits[r], s.params)
            idx[r] = torch.multinomial(q, 1, generator=s.generator)[0]
        qs.append(head.dense(q))
    return head.to_vocab(idx), torch.stack(qs)


def missing_drafter(loaded, spec: str) -> str | None:
    """Why the weights ``loaded`` (:class:`..loader.LoadedModel`) cannot draft for ``spec`` (mtp / dflash /
    dflash2), or None when they can: checked by the drafters and by a decode grid before its first run."""
    if spec == "mtp":
        if loaded.config.mtp_num_hidden_layers < 1 or "mtp.fc.weight" not in loaded.raws:
            return "--spec mtp needs a model with an MTP head (mtp.* weights); this one has none"
    elif spec != "none" and spec not in loaded.drafters:
        have = ", ".join(sorted(loaded.drafters)) or "none"
        return f"--spec {spec} needs a {spec} drafter in the artifact (it has: {have})"
    return None


class MTPDrafter:
    """Qwen3.5's MTP head, applied recursively: entry i reads (h_i, token i+1) and predicts token i+2.

    ``h`` is the hidden state fed to the lm_head (after the final norm; vLLM and SGLang do the same); for
    recursive steps it is the MTP head's own normed output. The head's ``mtp.layers.*`` run as one stack.
    """

    taps: tuple[int, ...] = ()
    reads_hidden = True  # begin() reads every prompt row's final hidden state (Step.all_rows)

    def __init__(self, engine):
        if why := missing_drafter(engine.loaded, "mtp"):
            raise ValueError(why)
        self.e = engine
        self.head = DraftHead(engine, draft_head_ids(engine))
        pack_verify_rows(engine, ("model.", "lm_head.", "mtp."))  # the head's pass over a verified block: k + 1 rows
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.carry: dict[int, tuple[int, torch.Tensor]] = {}  # slot -> (next chunk's start, last hidden row [H])
        # greedy drafting and the head's pass over each verified block (commit) replayed from CUDA graphs
        # (``draft_graphs``, on by default: the eager drafts' tokens); made on first use, once the engine's target
        # graphs (runtime v3 on CUDA) exist
        self.graphs: DraftGraphs | None = None
        self._want_graphs = engine.options.draft_graphs

    def steps(self, h, logits, length, slots, k: int, kv_len: int, choose=None, rope=None):
        """k drafts per row from the pending ``h [B, H]`` / ``logits [B, N]``: ``choose(logits) -> (tokens [B], q)``
        (default: greedy, no q), the head run on each draft; ``rope(pos)`` shifts rotary positions (media rows).
        ``kv_len`` bounds the keys for every step (later positions are masked), so the greedy loop reads nothing
        back from the device and can be captured. Returns (tokens [B, k], list of the k q's)."""
        toks, qs = [], []
        for j in range(k):
            tok, q = choose(logits) if choose else (self.head.to_vocab(logits.argmax(-1)), None)
            toks.append(tok)
            qs.append(q)
            if j + 1 < k:
                pos = (length + j)[:, None]
                hh, ll = self.forward(h[:, None], tok[:, None], pos, slots, kv_len,
                                      rope_pos=rope(pos) if rope else None)
                h, logits = hh[:, 0], ll[:, 0]
        return torch.stack(toks, 1), qs

    def forward(self, hidden, next_ids, pos, slots, kv_len, mode=DECODE, rope_pos=None):
        e, w = self.e, self.e.weights
        eps = e.config.rms_norm_eps
        x = torch.cat([draft_norm(w.embed(next_ids), w.vector("mtp.pre_fc_norm_embedding.weight"), eps),
                       draft_norm(hidden, w.vector("mtp.pre_fc_norm_hidden.weight"), eps)], dim=-1)
        x = w.linear("mtp.fc.weight")(x)
        step = Step(next_ids, pos, slots, kv_len=kv_len, mode=mode, rope_pos=rope_pos)  # rope_pos: media requests
        for i in range(e.config.mtp_num_hidden_layers):
            x = e.model.layer(f"mtp.layers.{i}", f"mtp{i}", "full_attention", x, step, e.cache)
        h = draft_norm(x, w.vector("mtp.norm.weight"), eps)
        return h, self.head.logits(h)

    def begin(self, seq, start, hidden, taps) -> None:
        """MTP entries for prompt positions ``start ..`` (hidden ``[n, H]``); the entry of the last prompt
        position needs the first generated token, so it is made with the final chunk."""
        # the entry of a chunk's last position needs the next chunk's first token: it is made with that chunk, from
        # the hidden row carried over (else the head's K/V there would stay unwritten, stale from an earlier request)
        carry = self.carry.pop(seq.slot, None)
        if carry is not None and carry[0] == start:
            hidden, start = torch.cat([carry[1][None], hidden]), start - 1
        n = hidden.shape[0]
        final = start + n == len(seq.prompt)
        if not final:
            self.carry[seq.slot] = (start + n, hidden[-1].clone())  # a copy: the forward may reuse its buffers
        nxt = seq.prompt[start + 1:start + n] + ([seq.tokens[0]] if final else [])
        m = len(nxt)
        if m == 0:
            return
        pos = torch.arange(start, start + m, device=self.e.device)[None]
        rope = seq.media.rope_pos[:, None, start:start + m].to(pos.device) if seq.media is not None else None
        e = self.e
        h, logits = self.forward(hidden[None, :m], e.device_ids([nxt]), pos, e.device_ids([seq.slot]), start + m,
                                 PREFILL, rope)
        if not final:
            return
        self.pending[seq.slot] = (h[0, -1], logits[0, -1])

    def commit(self, seqs, old_len, block, hidden, taps, n_acc, bonus) -> None:
        t = block.shape[1]
        slots = self.e.device_ids([s.slot for s in seqs])
        plain_rope = self.e.rope_shift(seqs, old_len[:, None]) is None
        graphs = wanted(self, self._want_graphs and plain_rope)
        if graphs is not None:  # keys bound by the capacity (later ones are masked by position)
            h0, l0 = graphs.replay("commit", t, (hidden, block, bonus, n_acc, old_len, slots),
                                   lambda *ins: self.verified(*ins, self.e.capacity))
        else:
            # keys up to the verified block's end; on a GPU bound from the host's lengths (each sequence grew by at
            # least one token this round; later keys are masked) instead of reading old_len back (a stall)
            kv_len = min(max(s.length for s in seqs) + t, self.e.capacity) if old_len.is_cuda \
                else int(old_len.max()) + t
            h0, l0 = self.verified(hidden, block, bonus, n_acc, old_len, slots, kv_len,
                                   rope=lambda pos: self.e.rope_shift(seqs, pos))
        for r, s in enumerate(seqs):
            self.pending[s.slot] = (h0[r], l0[r])

    def verified(self, hidden, block, bonus, n_acc, old_len, slots, kv_len: int, rope=None):
        """The head over a verified block ``[B, T]`` (its target ``hidden [B, T, H]``): each position fed the token
        after it (the bonus past the last accepted one), K/V written at ``old_len + i``; returns the (h, logits) of
        position ``n_acc`` per row, the next round's first draft. Device tensors only, no host read: capturable."""
        b, t = block.shape
        i = torch.arange(t, device=block.device)[None]
        nxt = torch.cat([block[:, 1:], bonus[:, None]], dim=1)
        nxt = torch.where(i < n_acc[:, None], nxt, bonus[:, None])  # token after each verified position
        pos = old_len[:, None] + i
        h, logits = self.forward(hidden, nxt, pos, slots, kv_len, rope_pos=rope(pos) if rope else None)
        sel = n_acc.view(b, 1, 1)
        h0 = h.gather(1, sel.expand(b, 1, h.shape[-1]))[:, 0]
        l0 = logits.gather(1, sel.expand(b, 1, logits.shape[-1]))[:, 0]
        return h0, l0

    def draft(self, seqs, k: int):
        h = torch.stack([self.pending[s.slot][0] for s in seqs])
        logits = torch.stack([self.pending[s.slot][1] for s in seqs])
        slots = self.e.device_ids([s.slot for s in seqs])
        lengths = [s.length for s in seqs]
        length = self.e.device_ids(lengths)
        if all(s.params.greedy for s in seqs) and self.e.rope_shift(seqs, length) is None:
            graphs = wanted(self, self._want_graphs)
            if graphs is not None:
                return graphs.replay("draft", k, (h, logits, length, slots),
                                     lambda *ins: self.steps(*ins, k, self.e.capacity)[0]), None
        # eager: a pick per row (argmax, or a draw for sampling rows), rotary positions shifted for media rows; the
        # key range from the host's lengths (no device read between launches)
        toks, qs = self.steps(h, logits, length, slots, k, max(lengths) + k,
                              choose=lambda lg: pick(seqs, lg, self.head),
                              rope=lambda pos: self.e.rope_shift(seqs, pos))
        return toks, (torch.stack(qs, 1) if qs[0] is not None else None)

    def release(self, seq) -> None:
        self.pending.pop(seq.slot, None)
        self.carry.pop(seq.slot, None)

    def export_slot(self, slot: int) -> dict:
        return {}  # the MTP head's K/V lives in the engine cache (exported with it)

    def slot_shapes(self) -> dict:
        return {}

    def import_slot(self, slot: int, state: dict) -> None:
        self.pending.pop(slot, None)
        self.carry.pop(slot, None)


class Projection(nn.Module):
    """A drafter projection run by one of the engine's linears (a packed one: the projection kernels read the stored
    format in place, as the target's projections do)."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def packed_projections(net: BlockDrafter, raws: dict[str, RawWeight], store) -> int:
    """Swap each of ``net``'s projections whose stored weight is packed (q8 / q5 / q4) for the engine's packed
    linear of it, where the store keeps weights packed (v3 on CUDA): a drafting round then reads the stored bytes,
    not a dense bf16 copy of them (the 27B shape's five drafter layers: 0.94 GB against 3.3 GB). Returns how many
    were swapped; the dense copies of those go."""
    if not store.packed:
        return 0
    swapped = 0
    for name, raw in raws.items():
        if raw.fmt not in quant.QUANT_FORMATS or len(raw.shape) != 2:
            continue
        path = name.split(".", 1)[1].rsplit(".", 1)[0]  # "{kind}.layers.0.q_proj.weight" -> "layers.0.q_proj"
        parent_path, _, attr = path.rpartition(".")
        parent = net.get_submodule(parent_path) if parent_path else net
        if not isinstance(getattr(parent, attr, None), nn.Linear):
            continue
        setattr(parent, attr, Projection(store.linear_of(raw)))
        swapped += 1
    return swapped


DRAFT_FUSIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def fused_projections(net: BlockDrafter, raws: dict[str, RawWeight], store) -> int:
    """Give each drafter layer its sibling projections as one packed linear where the store keeps weights packed
    (v3 on CUDA): ``qkv`` (q | k | v rows) and ``gate_up`` (gate | up), which a block's pass runs in one launch each
    instead of three and two (DraftLayer.forward). The members stay for the context keys and values (k and v alone)
    and for training. Returns how many fused linears were made."""
    if not store.packed:
        return 0
    made = 0
    kind = next(iter(raws)).split(".", 1)[0]
    for i, layer in enumerate(net.layers):
        for attr, members in DRAFT_FUSIONS.items():
            parts = [raws.get(f"{kind}.layers.{i}.{m}.weight") for m in members]
            if any(p is None or p.fmt not in quant.QUANT_FORMATS for p in parts) or len({p.fmt for p in parts}) != 1:
                continue
            shapes = [tuple(p.shape) for p in parts]
            buf = quant.concat_rows([p.buf.reshape(-1) for p in parts], parts[0].fmt, shapes)
            fused = RawWeight(parts[0].fmt, (sum(sh[0] for sh in shapes), shapes[0][1]), buf)
            setattr(layer, attr, Projection(store.linear_of(fused)))
            made += 1
    return made


def pack_verify_rows(engine, prefixes: tuple[str, ...]) -> None:
    """On a CPU, the engine's projections named under ``prefixes`` packed for a round's k + 1 rows a sequence
    (WeightStore.pack_rows, which does nothing on other devices): a sequence's verify pass, and the drafter's passes
    over as many rows, through MKL's packed GEMM."""
    engine.weights.pack_rows(engine.options.draft_tokens + 1, prefixes)


class BlockDraftRunner:
    """A DFlash / DFlash2 drafter bound to an Engine: context K/V per slot and layer, block drafting."""

    reads_hidden = False  # begin() reads the tapped layers' outputs only, not the final hidden states

    def __init__(self, engine, kind: str):
        if why := missing_drafter(engine.loaded, kind):
            raise ValueError(why)
        self.e = engine
        cfg, raws = engine.loaded.drafters[kind]
        self.cfg = cfg
        k = engine.options.draft_tokens
        if k + 1 > cfg.block_size:
            raise ValueError(f"{kind} drafter was trained with block size {cfg.block_size} "
                             f"(draft-tokens <= {cfg.block_size - 1}); asked for {k}")
        head_n = engine.options.lm_head_draft
        if head_n and cfg.kind == "dflash2" and cfg.scorer_rank > 0 and head_n < cfg.candidates:
            raise ValueError(f"--lm-head-draft {head_n} is fewer tokens than the {kind} drafter's {cfg.candidates} "
                             f"candidates a position")
        self.taps = tuple(cfg.target_layer_ids)
        self.net = BlockDrafter.from_raws(cfg, raws, engine.config.hidden_size, engine.config.vocab_size)
        self.packed = packed_projections(self.net, raws, engine.weights)
        self.fused = fused_projections(self.net, raws, engine.weights)
        self.net.to(device=engine.device, dtype=engine.dtype).eval()
        if engine.device.type == "cuda":  # every position < context + block: no pos.max() read (a stall) per call
            self.net.reserve_rope(engine.capacity + cfg.block_size + 1, engine.device)
        self.head = DraftHead(engine, draft_head_ids(engine), cfg.extra.get("logit_scale", 1.0),
                              cfg.extra.get("logit_softcap", 0.0))
        pack_verify_rows(engine, ("model.", "lm_head."))  # the target's verify pass and the drafter's block head
        ring = cfg.kind == "dflash2" and cfg.window > 0
        self.window = cfg.window if ring else 0
        self.cap = cfg.window if ring else engine.capacity
        slots, dev, dt = engine.cache.slots, engine.device, engine.dtype
        # a slot's rows: ``cap`` context entries, room for a drafted block (its keys and values are written there, so
        # attention reads [context | block] in place), and last the entry that takes discarded writes. Keys and values
        # of every layer are one tensor: a block's drafting gathers its rows' in one copy
        rows = self.cap + cfg.block_size + 1
        self.discard = rows - 1
        self.kv = torch.zeros(2, cfg.num_layers, slots, rows, cfg.num_key_value_heads, cfg.head_dim, dtype=dt,
                              device=dev)
        self.k, self.v = list(self.kv[0]), list(self.kv[1])
        self.pos = torch.full((slots, rows), -1, dtype=torch.long, device=dev)
        # greedy block drafting replayed from CUDA graphs (``draft_graphs``, on by default), made on first use once
        # the engine's target graphs exist
        self.graphs: DraftGraphs | None = None
        self._want_graphs = engine.options.draft_graphs
        # a block's attention reads the cache rows in place (kernels/draft_attention.py): CUDA with Triton
        self.in_place = dev.type == "cuda" and engine.options.draft_attention and draft_attention_available()

    def _entries(self, pos, live) -> tuple[torch.Tensor, torch.Tensor]:
        """(the entry each of ``pos [B, T]`` is written to, whether it is kept): discarded ones go to the discard
        entry. A ring of ``cap`` entries written more than ``cap`` positions at once (a long prompt chunk, or a block
        longer than the window) keeps only each row's positions within ``cap`` of its newest kept one: older ones
        share entries with them, and a CUDA scatter with two writes to one entry keeps either (a K/V row and its
        position from different tokens). The window never reads them."""
        if self.window and pos.shape[1] > self.cap:
            newest = torch.where(live, pos, torch.full_like(pos, -1)).amax(1, keepdim=True)
            live = live & (pos > newest - self.cap)
        idx = torch.where(live, pos % self.cap if self.window else pos, torch.full_like(pos, self.discard))
        return idx, live

    def _write(self, slots, taps, pos, live) -> None:
        """Context K/V of ``taps [B, T, n*H]`` at ``pos [B, T]``; rows where ``live`` is False are discarded
        (:meth:`_entries`)."""
        ks, vs = self.net.context_kv(self.net.context(taps.to(self.e.dtype)), pos)
        idx, live = self._entries(pos, live)
        sl = slots[:, None].expand_as(pos)
        n, (b, t) = len(ks), pos.shape
        # every layer's keys and values in one stack, written with one scatter: [2, layers, B, T, Hkv, hd]
        self.kv[:, :, sl, idx] = torch.stack([*ks, *vs]).view(2, n, b, t, *ks[0].shape[2:])
        self.pos[sl, idx] = torch.where(live, pos, torch.full_like(pos, -1))

    def begin(self, seq, start, hidden, taps) -> None:
        """Context K/V for prompt positions ``start ..`` from their tap outputs ``[n, n_taps*H]`` (a window ring
        keeps the newest ``cap``: :meth:`_entries`)."""
        if start == 0:
            self.pos[seq.slot] = -1
        pos = torch.arange(start, start + taps.shape[0], device=self.e.device)[None]
        self._write(self.e.device_ids([seq.slot]), taps[None], pos, torch.ones_like(pos, dtype=torch.bool))

    def commit(self, seqs, old_len, block, hidden, taps, n_acc, bonus) -> None:
        t = block.shape[1]
        slots = self.e.device_ids([s.slot for s in seqs])
        graphs = wanted(self, self._want_graphs)
        if graphs is not None:  # replayed whatever the rows sample: the context K/V do not depend on it
            graphs.replay("commit", t, (taps, old_len, n_acc, slots), lambda *ins: self.verified(*ins, t))
        else:
            self.verified(taps, old_len, n_acc, slots, t)

    def verified(self, taps, old_len, n_acc, slots, t: int) -> None:
        """Context K/V of a verified block's positions ``old_len .. old_len + n_acc`` (the last committed token and
        the accepted drafts) from their tap outputs ``[B, t, n_taps * H]``; the rejected positions write the
        discard entry. Device tensors only, no host read: capturable."""
        i = torch.arange(t, device=taps.device)[None]
        self._write(slots, taps, old_len[:, None] + i, i <= n_acc[:, None])

    @torch.inference_mode()
    def draft(self, seqs, k: int):
        e = self.e
        slots = e.device_ids([s.slot for s in seqs])
        length = e.device_ids([s.length for s in seqs])
        last = e.device_ids([s.last for s in seqs])
        greedy = all(s.params.greedy for s in seqs)
        graphs = wanted(self, greedy and self._want_graphs)
        if graphs is not None:
            return graphs.replay("draft", k, (last, length, slots),
                                 lambda *ins: self.greedy(*self.block(*ins, k), ins[0])), None
        h, logits = self.block(last, length, slots, k)
        if greedy:
            return self.greedy(h, logits, last), None
        if self.net.selector is None:
            toks, qs = zip(*(pick(seqs, logits[:, j], self.head) for j in range(k)))
            return torch.stack(toks, 1), (torch.stack(qs, 1) if qs[0] is not None else None)
        return self._select(seqs, h, logits, last)

    def block(self, last, length, slots, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter over one block per row - ``last [B]`` (the newest token, at position ``length``) then ``k``
        mask tokens - against the row's context K/V: hidden ``[B, k, H]`` and head logits ``[B, k, N]`` of the k
        drafted positions. Device tensors only, no host read: capturable."""
        e, c = self.e, self.cfg
        b = last.shape[0]
        ids = torch.full((b, k + 1), c.mask_token_id, dtype=torch.long, device=e.device)
        ids[:, 0] = last
        pos = length[:, None] + torch.arange(k + 1, device=e.device)[None]
        if self.in_place:  # each layer's context read from self.kv where it lies, the mask from self.pos
            ring = RingContext(self.k, self.v, self.pos, slots, length, self.cap, self.window)
            h = self.net.blocks_in_place(e.weights.embed(ids), pos, ring)
            return h[:, 1:], self.head.logits(h[:, 1:])
        mask = block_mask(self.pos, slots, length, self.cap, self.window, k + 1)
        kv = _gather_rows(self.kv, 2, slots)  # [2, layers, B, rows, Hkv, hd]: every layer's rows in one copy
        h = self.net.blocks(e.weights.embed(ids), pos, list(kv[0]), list(kv[1]), mask, room=self.cap)
        if h.is_cuda:
            return h[:, 1:], self.head.logits(h[:, 1:])
        # CPU: the head over the whole block, anchor row too - k + 1 rows a sequence as a verify pass has, so both
        # go through the same products of the head (DenseLinear.pack_rows)
        return h[:, 1:], self.head.logits(h)[:, 1:]

    def greedy(self, h, logits, anchor) -> torch.Tensor:
        """Greedy drafts ``[B, k]`` (vocabulary ids) of a block: each position's argmax, or DFlash2's candidate walk
        from ``anchor [B]`` for all rows at once."""
        if self.net.selector is None:
            return self.head.to_vocab(logits.argmax(-1))
        return self.net.selector.walk(h, logits, anchor, 0.0, None, ids_map=self.head.ids)[0]

    def _select(self, seqs, h, logits, anchor):
        """DFlash2: the candidate walk (per row, since rows may sample at different temperatures)."""
        toks, qs = [], []
        sampling = not all(s.params.greedy for s in seqs)
        for r, s in enumerate(seqs):
            temp = 0.0 if s.params.greedy else s.params.temperature
            t, cand, q = self.net.selector.walk(h[r:r + 1], logits[r:r + 1], anchor[r:r + 1], temp, s.generator,
                                                ids_map=self.head.ids)
            toks.append(t[0])
            if sampling:
                full = torch.zeros(t.shape[1], self.e.config.vocab_size, device=h.device)
                if q is None:
                    full.scatter_(1, t[0][:, None], 1.0)
                else:
                    full.scatter_(1, cand[0], q[0].to(full.dtype))
                qs.append(full)
        return torch.stack(toks), (torch.stack(qs) if qs else None)

    def release(self, seq) -> None:
        self.pos[seq.slot] = -1

    def _kept(self, t: torch.Tensor) -> torch.Tensor:
        """A slot's rows a session keeps: the ``cap`` context entries and the discard entry (not the block's room)."""
        return torch.cat([t[: self.cap], t[self.discard:]])

    def export_slot(self, slot: int) -> dict:
        """A CPU copy of the slot's context K/V (sessions)."""
        return {"k": [self._kept(k[slot]).cpu() for k in self.k], "v": [self._kept(v[slot]).cpu() for v in self.v],
                "pos": self._kept(self.pos[slot]).cpu()}

    def slot_shapes(self) -> dict:
        """What :meth:`export_slot` gives, as (dtype, shape) pairs."""
        rows = self.cap + 1
        return {"k": [(k.dtype, (rows, *k.shape[2:])) for k in self.k],
                "v": [(v.dtype, (rows, *v.shape[2:])) for v in self.v],
                "pos": (self.pos.dtype, (rows,))}

    def import_slot(self, slot: int, state: dict) -> None:
        for dst, src in zip([*self.k, *self.v, self.pos], [*state["k"], *state["v"], state["pos"]]):
            src = src.to(dst.device, dst.dtype)
            dst[slot, : self.cap] = src[: self.cap]
            dst[slot, self.discard:] = src[self.cap:]
