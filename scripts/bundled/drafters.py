"""DFlash and DFlash2 drafters (``engine/model/dflash.py`` ``BlockDrafter``) trained on the frozen target, and
the MTP head's multi-depth fine-tuning, all from one target forward per step.

Each step: the frozen target (bf16, no grad) reads a batch of corpus sequences; its tap-layer outputs are
the drafters' context, its greedy predictions are the labels (self-distillation: a draft is accepted when it
equals the target's greedy token). Drafters run ``forward_train`` over many random blocks per sequence: a
block anchored at ``a`` is ``[t_a, mask x (s-1)]`` at positions ``a..a+s-1`` seeing context ``< a`` (the
engine's ``draft``: anchor = the last sampled token, context = the committed ones); block position ``i``
predicts the target's greedy token at ``a + i``, weighted ``exp(-(i-1)/gamma)``.

The engine drafts ``K`` tokens with a block of ``K + 1`` (``BlockDraftRunner.draft``) and the block has no
causal mask, so a block's length changes what each position sees; steps cycle through the block lengths of
the K the card reports (4, 8, 12, 16), so every evaluated K runs the drafter as it was trained
(``DrafterOptions.block_sizes`` may repeat a length to weight the main job's K).

Labels (``DrafterOptions.labels``): ``greedy`` takes the target's greedy token at every corpus position. A draft
``i`` of a round is accepted only after drafts ``1 .. i - 1`` were, so the token it must equal is the target's
greedy token after the target's own greedy tokens; a corpus label past the block's first position is that only
where the corpus tokens before it in the block are the target's greedy tokens. ``path`` counts a block position
only there (each position's loss is its mean over those blocks, and so is its training agreement); ``corpus``
takes the corpus tokens themselves.

DFlash2's selector is trained on the walk it runs (``CandidateSelector.walk``): at each block position the
candidates are the top-``candidates`` tokens of the drafter's logits, scored ``logit + pair_scores(h_i, prev,
cand)`` with ``prev`` the previous position's label (the anchor for the first), and a cross-entropy over the
candidates pulls the label up wherever it is among them.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ninfer_bench.engine.model.config import DraftConfig, ModelConfig
from ninfer_bench.engine.model.dflash import BlockDrafter, forward_train

from .mtp import mtp_loss
from .schedule import Schedule
from .target import rotary, run

BLOCK_SIZES = (4, 8, 12, 16)
SHAPES = {
    "small": dict(num_layers=2, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  window=512, scorer_rank=32, taps=4),
    "tiny": dict(num_layers=2, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 window=32, scorer_rank=8, taps=2),
}


def draft_config(kind: str, shape: str, cfg: ModelConfig, mask_id: int) -> DraftConfig:
    """Block 16 (K up to 15), taps evenly spaced ending at the last layer ([1, 3, 5, 7] of 8). RoPE theta 1e4:
    the mask slots of a block differ only by position, so the drafter wants fast-turning frequencies."""
    s = dict(SHAPES[shape])
    n, taps = cfg.num_hidden_layers, s.pop("taps")
    window, rank = s.pop("window"), s.pop("scorer_rank")
    return DraftConfig(kind=kind, block_size=16, target_layer_ids=tuple(round((i + 1) * n / taps) - 1
                                                                        for i in range(taps)),
                       mask_token_id=mask_id, hidden_size=cfg.hidden_size, rms_norm_eps=cfg.rms_norm_eps,
                       rope_theta=1e4, window=window if kind == "dflash2" else 0, candidates=16,
                       scorer_rank=rank if kind == "dflash2" else 0, **s)


@dataclass(slots=True)
class DrafterOptions:
    seq_len: int
    batch: int
    lr: float
    mtp_lr: float
    warmup: int
    budget_s: float
    max_steps: int | None = None
    block_tokens: int = 512  # block positions per sequence per step (blocks = block_tokens // s)
    mtp_depths: int = 4  # MTP drafts 1..4
    gamma: float = 5.0
    selector_weight: float = 0.5
    labels: str = "greedy"
    log_every: int = 10
    block_sizes: tuple[int, ...] = BLOCK_SIZES  # the steps' block lengths, in turn

    def __post_init__(self) -> None:
        if self.labels not in ("greedy", "path", "corpus"):
            raise ValueError(f"drafter labels must be greedy, path or corpus, got {self.labels!r}")
        check_block_sizes(self.block_sizes)


def check_block_sizes(sizes) -> None:
    """Training block lengths are K + 1 for K 1 .. 15: 2 .. 16 (the drafters' block), at least one."""
    if not sizes or any(not 2 <= s <= 16 for s in sizes):
        raise ValueError(f"drafter block lengths must be 2 .. 16 (K + 1 for K up to 15), got {list(sizes)}")


@contextlib.contextmanager
def block_size(drafter: BlockDrafter, s: int):
    """Run ``forward_train`` with blocks of ``s`` (the block length the engine uses for K = s - 1)."""
    saved = drafter.c.block_size
    drafter.c.block_size = s
    try:
        yield
    finally:
        drafter.c.block_size = saved


def anchors(b: int, length: int, s: int, nb: int, gen: torch.Generator, device, lo: int = 1) -> torch.Tensor:
    """``[B, nb]`` distinct anchors per row in ``lo .. length - s + 1`` (context non-empty, labels in range; ``lo``:
    the first position a round can anchor at, the prompt's end for self-generated rows)."""
    return torch.rand(b, length - s + 2 - lo, generator=gen, device=device).argsort(dim=1)[:, :nb] + lo


def on_path(ids: torch.Tensor, a: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
    """``[B, nb, s - 1]`` 1.0 where every corpus token between a block's anchor and that position is the target's
    greedy token (``lab``: the greedy labels of block positions 1 .. s - 1, anchored at ``a``); position 1 always."""
    b, nb, n = lab.shape
    nxt = ids.gather(1, (a[..., None] + 1 + torch.arange(n - 1, device=ids.device)).view(b, -1)).view(b, nb, n - 1)
    same = (lab[..., :-1] == nxt).float()
    return torch.cat([torch.ones_like(same[..., :1]), same.cumprod(-1)], dim=-1)


def block_loss(drafter: BlockDrafter, taps, ids, labels, embed, lm_head, s: int, nb: int, opts, gen, lo: int = 1):
    """(loss, top-1 agreement per block position) of one drafter on one batch with blocks of ``s``: each position's
    mean cross-entropy over the blocks that count for it (all, or those on the greedy path), weighted
    ``exp(-(i-1)/gamma)``."""
    b, length = ids.shape
    a = anchors(b, length, s, nb, gen, ids.device, lo)
    blk = torch.full((b, nb, s), drafter.c.mask_token_id, dtype=torch.long, device=ids.device)
    blk[..., 0] = ids.gather(1, a)
    with block_size(drafter, s):
        out = forward_train(drafter, taps, embed(blk).reshape(b, nb * s, -1), a)
    h = out.view(b, nb, s, -1)[:, :, 1:]  # [B, nb, s-1, H]: block positions 1..s-1
    logits = lm_head(h).float()
    lab = labels.gather(1, (a[..., None] + torch.arange(s - 1, device=ids.device)).view(b, -1)).view(b, nb, s - 1)
    valid = on_path(ids, a, lab) if opts.labels == "path" else torch.ones_like(lab, dtype=torch.float32)
    count = valid.sum((0, 1)).clamp_min(1.0)  # [s-1]
    w = torch.exp(-torch.arange(s - 1, device=ids.device, dtype=torch.float32) / opts.gamma)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="none").view_as(lab)
    loss = (w * (ce * valid).sum((0, 1)) / count).sum() / w.sum()
    if drafter.selector is not None:
        loss = loss + opts.selector_weight * selector_loss(drafter.selector, h, logits, blk[..., 0], lab, w * valid)
    agree = (((logits.argmax(-1) == lab).float() * valid).sum((0, 1)) / count).detach()
    return loss, agree


def selector_loss(selector, h, logits, anchor_tok, lab, w) -> torch.Tensor:
    """Cross-entropy over each position's top-k candidates, scored as ``CandidateSelector.walk`` scores them."""
    unary, cand = torch.topk(logits, selector.candidates, dim=-1)  # [B, nb, s-1, C]
    prev = torch.cat([anchor_tok[..., None], lab[..., :-1]], dim=-1)  # teacher forcing: the previous label
    scores = unary + selector.pair_scores(h, prev, cand).float()
    hit = cand == lab[..., None]
    present = hit.any(-1).float() * w
    ce = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), hit.int().argmax(-1).reshape(-1),
                         reduction="none").view_as(present)
    return (ce * present).sum() / present.sum().clamp_min(1.0)


def step_losses(model, mtp, drafters: dict, x: torch.Tensor, s: int, opts: DrafterOptions, gen, lo: int = 1):
    """One step's (total loss, per-part detached losses, MTP per-depth losses, drafters' per-position agreement):
    the frozen target reads ``x[:, :-1]`` once; the MTP head (unless ``mtp`` is None) and each drafter learn from
    its outputs; block anchors start at ``lo``."""
    embed, lm_head = model.model.embed_tokens, model.lm_head
    ids, length = x[:, :-1], x.shape[1] - 1
    taps = sorted({i for d in drafters.values() for i in d.c.target_layer_ids})
    with torch.no_grad():
        hidden, outs = run(model, ids, taps)
        greedy = lm_head(hidden).argmax(-1)  # [B, T]: the target's prediction of token p+1
        labels = x[:, 1:] if opts.labels == "corpus" else greedy
        tap = dict(zip(taps, outs))
        emb_next = embed(x[:, 1:])
        cos, sin = rotary(model, hidden)
    if mtp is not None:
        mtp_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # token p+2
        loss, depth_losses = mtp_loss(mtp, lm_head, hidden, emb_next, mtp_labels, cos, sin, opts.mtp_depths)
        each = {"mtp": loss.detach()}
    else:  # drafters only (scripts/retrain_drafters.py): the MTP head stays as it is
        loss, depth_losses, each = 0.0, [], {}
    agree = {}
    for kind, d in drafters.items():
        ctx = torch.cat([tap[i] for i in d.c.target_layer_ids], dim=-1)
        room = length - s + 2 - lo
        if room < 1:
            raise ValueError(f"rows of {length} tokens anchored from {lo} leave no room for blocks of {s}")
        nb = max(1, min(opts.block_tokens // s, room))
        dl, agree[kind] = block_loss(d, ctx, ids, labels, embed, lm_head, s, nb, opts, gen, lo)
        each[kind] = dl.detach()
        loss = loss + dl
    return loss, each, depth_losses, agree


def train(model, mtp, drafters: dict, batches, opts: DrafterOptions, device, seed: int, log) -> dict:
    """Train the drafters (and fine-tune the MTP head, unless ``mtp`` is None) on the frozen target; returns the
    phase's facts."""
    model.to(device).eval().requires_grad_(False)
    groups = [{"params": list(d.to(device).train().parameters()), "lr": opts.lr} for d in drafters.values()]
    if mtp is not None:
        groups.append({"params": list(mtp.to(device).train().parameters()), "lr": opts.mtp_lr})
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda")
    peak = [g["lr"] for g in groups]
    sched = Schedule(1.0, opts.warmup, opts.budget_s, opts.max_steps)  # a multiplier of each group's peak
    gen = torch.Generator(device=device).manual_seed(seed)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    step, stats, tokens = 0, {}, 0
    while True:
        got = batches.next()  # corpus rows, or (self-generated rows, their first anchor)
        x, lo = got if isinstance(got, tuple) else (got, 1)
        x = torch.from_numpy(x).to(device)
        s = opts.block_sizes[step % len(opts.block_sizes)]
        with amp:
            loss, each, depth_losses, agree = step_losses(model, mtp, drafters, x, s, opts, gen, lo)
        for g, lr in zip(opt.param_groups, peak):
            g["lr"] = lr * sched.lr(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        opt.step()
        step, tokens = step + 1, tokens + x.shape[0] * (x.shape[1] - 1)
        stop = sched.done(step)
        for kind, a in agree.items():  # running top-1 agreement per block position, per block length
            key = f"{kind}_s{s}"
            stats[key] = a if key not in stats else 0.9 * stats[key] + 0.1 * a
        if step % opts.log_every == 0 or stop:
            log({"phase": "drafters", "step": step, "loss": float(loss.detach()), "block": s,
                 **{f"{k}_loss": round(float(v), 4) for k, v in each.items()},
                 "mtp_depth_loss": [round(float(v), 4) for v in depth_losses], "lr": opts.lr * sched.lr(step - 1),
                 "elapsed": round(sched.elapsed, 2), "tokens": tokens})
        if stop:
            break
    return {"steps": step, "seconds": round(sched.elapsed, 1), "context_tokens": tokens,
            "batch": opts.batch, "seq_len": opts.seq_len, "labels": opts.labels, "block_sizes": list(opts.block_sizes),
            "mtp_depths": opts.mtp_depths if mtp is not None else 0,
            "final_mtp_depth_loss": [round(float(v), 4) for v in depth_losses],
            "train_agreement": {k: [round(float(v), 3) for v in a] for k, a in stats.items()}}


def new_drafters(cfg: ModelConfig, shape: str, mask_id: int, seed: int) -> dict[str, BlockDrafter]:
    out = {}
    for i, kind in enumerate(("dflash", "dflash2")):
        torch.manual_seed(seed + 101 + i)
        out[kind] = BlockDrafter(draft_config(kind, shape, cfg, mask_id), cfg.hidden_size, cfg.vocab_size)
    return out


def param_count(drafter: BlockDrafter) -> int:
    return sum(p.numel() for p in drafter.parameters())


def save(folder, drafters: dict[str, BlockDrafter], mtp) -> None:
    """``{kind}.safetensors`` + ``{kind}.json`` (DraftConfig) per drafter, and the fine-tuned ``mtp.safetensors``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for kind, d in drafters.items():
        save_file({k: v.detach().float().contiguous().cpu() for k, v in d.state_dict().items()},
                  str(folder / f"{kind}.safetensors"))
        (folder / f"{kind}.json").write_text(json.dumps(d.c.to_dict(), indent=2) + "\n")
    save_file({f"mtp.{k}": v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in mtp.state_dict().items()},
              str(folder / "mtp.safetensors"))  # bf16, as the rest of the HF folder


def load(folder, cfg: ModelConfig) -> dict[str, BlockDrafter]:
    """The drafters :func:`save` wrote."""
    out = {}
    for kind in ("dflash", "dflash2"):
        dcfg = DraftConfig.from_dict(json.loads((Path(folder) / f"{kind}.json").read_text()))
        net = BlockDrafter(dcfg, cfg.hidden_size, cfg.vocab_size)
        net.load_state_dict(load_file(str(Path(folder) / f"{kind}.safetensors")), strict=True)
        out[kind] = net
    return out
