"""Media in a prompt: the placeholder text of an image or video, the merged vision tokens it widens to, and their
3-D (t, h, w) rotary positions (the tables those positions select: :mod:`..model.rotary`).

Positions (transformers' ``Qwen3_5Model.get_rope_index``): text tokens advance one position on all three axes.
A run of vision tokens starting at position ``s`` with merged grid ``(t, h, w)`` gets ``(s + t_i, s + h_i,
s + w_i)``; a video is one run per temporal patch (the processor separates them with timestamps), so ``t_i``
is always 0; the text after a run starts at ``s + max(h, w)``. Generated tokens continue on all three axes at
``index + delta`` with ``delta = max(position) + 1 - prompt length`` (HF's ``rope_deltas``, usually negative).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.vision import VisionConfig
from .decode import MediaInput

PLACEHOLDERS = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>", "image": "<|image_pad|>",
                "video": "<|video_pad|>"}


def placeholder(kind: str) -> str:
    """The prompt text of one image or video (the chat template's form); :func:`expand` widens it."""
    return PLACEHOLDERS["vision_start"] + PLACEHOLDERS[kind] + PLACEHOLDERS["vision_end"]


def check_tokens(tokenizer, cfg: VisionConfig) -> None:
    """The tokenizer must map the placeholder strings to the vision config's ids."""
    want = {"vision_start": cfg.vision_start_token_id, "vision_end": cfg.vision_end_token_id,
            "image": cfg.image_token_id, "video": cfg.video_token_id}
    for key, tid in want.items():
        got = tokenizer.token_to_id(PLACEHOLDERS[key])
        if got != tid:
            raise ValueError(f"the tokenizer maps {PLACEHOLDERS[key]} to {got}, the vision component expects {tid}: "
                             f"this model cannot place media in text prompts")


@dataclass
class MediaPrompt:
    """A prompt's media: where the merged vision tokens go, their 3-D positions, and (once the engine thread
    encoded them) the tokens themselves."""

    items: list[MediaInput]
    mask: torch.Tensor  # [P] bool: prompt positions that take vision tokens
    rope_pos: torch.Tensor  # [3, P] long
    delta: int  # generated position i rotates at i + delta
    embeds: torch.Tensor | None = None  # [mask.sum(), hidden], in prompt order
    stats: dict = field(default_factory=dict)  # encode_ms, tokens, cached items

    @property
    def rows_before(self) -> torch.Tensor:
        """``[P + 1]``: vision tokens before each position (row offsets into ``embeds`` for a chunk)."""
        return torch.cat([torch.zeros(1, dtype=torch.long), self.mask.long().cumsum(0)])

    def chunk(self, start: int, end: int):
        """(embeds rows, mask ``[1, n]``, rope positions ``[3, 1, n]``) of prompt positions ``start:end``."""
        rows = self.rows_before
        return (self.embeds[int(rows[start]):int(rows[end])], self.mask[None, start:end],
                self.rope_pos[:, None, start:end])


def expand(ids: list[int], items: list[MediaInput], cfg: VisionConfig, encode) -> list[int]:
    """``ids`` with each image / video pad token widened to its merged token count (videos: per temporal patch
    ``<t seconds><|vision_start|>pads<|vision_end|>``, as the processor writes them). ``encode``: text -> ids."""
    m2 = cfg.spatial_merge_size ** 2
    pads = {cfg.image_token_id: "image", cfg.video_token_id: "video"}
    found = [pads[t] for t in ids if t in pads]
    kinds = [it.kind for it in items]
    if found != kinds:
        raise ValueError(f"the prompt has {len(found)} media placeholder(s) {found} for {len(items)} media "
                         f"input(s) {kinds}: each image or video needs one, in order")
    out, it = [], iter(items)
    for t in ids:
        if t not in pads:
            out.append(t)
            continue
        item = next(it)
        gt, gh, gw = item.grid
        if item.kind == "image":
            out += [t] * (gt * gh * gw // m2)
            continue
        for i in range(gt):  # the chat template's own start/end tokens stay around the whole video
            out += encode(f"<{item.timestamps[i]:.1f} seconds>")
            out += [cfg.vision_start_token_id] + [t] * (gh * gw // m2) + [cfg.vision_end_token_id]
    return out


def rope_index(ids: list[int], items: list[MediaInput], cfg: VisionConfig) -> tuple[torch.Tensor, int]:
    """3-D positions ``[3, T]`` of an expanded prompt and its delta (see the module docstring)."""
    m = cfg.spatial_merge_size
    pads = (cfg.image_token_id, cfg.video_token_id)
    grids = []  # one per run of pad tokens: images whole, videos one per temporal patch
    for item in items:
        gt, gh, gw = item.grid
        grids += [(gh // m, gw // m)] * (gt if item.kind == "video" else 1)
    pos = torch.empty(3, len(ids), dtype=torch.long)
    cur, i, g = 0, 0, iter(grids)
    while i < len(ids):
        if ids[i] not in pads:
            pos[:, i] = cur
            cur, i = cur + 1, i + 1
            continue
        h, w = next(g)
        n = h * w
        if ids[i:i + n] != [ids[i]] * n:
            raise ValueError(f"media placeholder run at {i} is shorter than its {n} vision tokens")
        pos[0, i:i + n] = cur
        pos[1, i:i + n] = cur + torch.arange(h).repeat_interleave(w)
        pos[2, i:i + n] = cur + torch.arange(w).repeat(h)
        cur, i = cur + max(h, w), i + n
    return pos, int(pos.max()) + 1 - len(ids) if len(ids) else 0


def media_prompt(ids: list[int], items: list[MediaInput], cfg: VisionConfig, encode) -> tuple[list[int], MediaPrompt]:
    """Expand ``ids``' placeholders for ``items`` and compute where the vision tokens go and their positions."""
    full = expand(ids, items, cfg, encode)
    pos, delta = rope_index(full, items, cfg)
    t = torch.tensor(full, dtype=torch.long)
    mask = (t == cfg.image_token_id) | (t == cfg.video_token_id)
    return full, MediaPrompt(items, mask, pos, delta)
