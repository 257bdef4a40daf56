"""The Qwen3.5 vision tower (``Qwen3_5ForConditionalGeneration``'s ``model.visual``), in plain torch.

Pixels arrive patchified (:mod:`.media`): ``[N, C * Tp * P * P]`` rows in spatial-merge-block order (each run of
``m * m`` rows is one merged token), with one ``(t, h, w)`` patch grid per image or video. The forward:

1. patch embedding: the Conv3d with kernel = stride = ``(Tp, P, P)`` is one matmul over the flattened patch;
2. learned absolute positions: the ``side x side`` table (``side = sqrt(num_position_embeddings)``) resampled
   bilinearly (align_corners) to each ``h x w`` grid, the same for every frame;
3. ``depth`` pre-LayerNorm ViT blocks; attention is bidirectional within one frame (``h * w`` patches) and
   rotates q, k with a 2-D rotary embedding over the whole head: the first half of the angles from the patch's
   row, the second half from its column (``head_dim / 4`` frequencies each, theta ``rope_theta``);
4. the merger: LayerNorm, then ``m * m`` neighbouring patches concatenated, ``fc2(gelu(fc1(.)))`` to the text
   hidden size.

Weights are the artifact's ``vision.*`` tensors (``model.visual.*`` in the checkpoint), held dense in the compute
dtype (vision weights are never quantized).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F

from .config import is_int
from .weights import RawWeight

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


@dataclass(slots=True)
class VisionConfig:
    """Shape of the vision tower, the special token ids that place its output in the text, and the text model's
    mRoPE split (``mrope_section``: rotary frequency pairs driven by the t, h and w positions, interleaved)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    mrope_section: tuple[int, ...] = (11, 11, 10)

    def __post_init__(self) -> None:
        positive = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "in_channels",
                    "patch_size", "temporal_patch_size", "spatial_merge_size", "num_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"vision config: {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision config: hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision config: head_dim {self.head_dim} must be a multiple of 4 (2-D rotary: half "
                             f"for rows, half for columns, in cos/sin pairs)")
        side = round(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision config: num_position_embeddings {self.num_position_embeddings} is not a square")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision config: hidden_act {self.hidden_act!r} is not supported "
                             f"(known: {', '.join(ACTIVATIONS)})")
        section = self.mrope_section
        if (not isinstance(section, (list, tuple)) or len(section) != 3
                or not all(is_int(s) and s >= 0 for s in section)):
            raise ValueError(f"vision config: mrope_section must be 3 non-negative integers, got {section!r}")
        self.mrope_section = tuple(section)
        ids = [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id]
        if len(set(ids)) != 4 or any(not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"vision config: the image/video/vision_start/vision_end token ids must be 4 distinct "
                             f"non-negative integers, got {ids}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return round(self.num_position_embeddings ** 0.5)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mrope_section"] = list(self.mrope_section)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"vision config: unknown field(s) {unknown}")
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict) -> "VisionConfig | None":
        """From a ``qwen3_5`` config.json (``vision_config`` + top-level token ids); None when it has no vision."""
        v = hf.get("vision_config")
        if v is None:
            return None
        if not isinstance(v, dict):  # (not read as "no vision": the tower's weights would be dropped silently)
            raise ValueError(f"config.json: vision_config must be an object, got {v!r}")
        rope = v.get("rope_parameters") or {}
        text_rope = (hf.get("text_config") or {}).get("rope_parameters") or {}
        tokens = {k: hf[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                     "vision_end_token_id") if hf.get(k) is not None}
        return cls(depth=v.get("depth", 27), hidden_size=v.get("hidden_size", 1152),
                   intermediate_size=v.get("intermediate_size", 4304), num_heads=v.get("num_heads", 16),
                   out_hidden_size=v.get("out_hidden_size", 3584), in_channels=v.get("in_channels", 3),
                   patch_size=v.get("patch_size", 16), temporal_patch_size=v.get("temporal_patch_size", 2),
                   spatial_merge_size=v.get("spatial_merge_size", 2),
                   num_position_embeddings=v.get("num_position_embeddings", 2304),
                   hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"), rope_theta=rope.get("rope_theta", 10000.0),
                   mrope_section=tuple(text_rope.get("mrope_section") or (11, 11, 10)), **tokens)


def vision_weight_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every ``vision.*`` tensor of ``cfg`` and its shape (the checkpoint's ``model.visual.*``)."""
    h, i, m2 = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.spatial_merge_size ** 2
    shapes = {
        "vision.patch_embed.proj.weight": (h, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                           cfg.patch_size),
        "vision.patch_embed.proj.bias": (h,),
        "vision.pos_embed.weight": (cfg.num_position_embeddings, h),
        "vision.merger.norm.weight": (h,), "vision.merger.norm.bias": (h,),
        "vision.merger.linear_fc1.weight": (m2, m2), "vision.merger.linear_fc1.bias": (m2,),
        "vision.merger.linear_fc2.weight": (cfg.out_hidden_size, m2),
        "vision.merger.linear_fc2.bias": (cfg.out_hidden_size,),
    }
    for b in range(cfg.depth):
        p = f"vision.blocks.{b}"
        shapes.update({
            f"{p}.norm1.weight": (h,), f"{p}.norm1.bias": (h,), f"{p}.norm2.weight": (h,), f"{p}.norm2.bias": (h,),
            f"{p}.attn.qkv.weight": (3 * h, h), f"{p}.attn.qkv.bias": (3 * h,),
            f"{p}.attn.proj.weight": (h, h), f"{p}.attn.proj.bias": (h,),
            f"{p}.mlp.linear_fc1.weight": (i, h), f"{p}.mlp.linear_fc1.bias": (i,),
            f"{p}.mlp.linear_fc2.weight": (h, i), f"{p}.mlp.linear_fc2.bias": (h,),
        })
    return shapes


def check_shapes(cfg: VisionConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Raise ValueError naming the first missing tensor or shape mismatch against ``cfg``."""
    for name, want in vision_weight_shapes(cfg).items():
        if name not in shapes:
            raise ValueError(f"{where}: vision tensor {name} is missing")
        if tuple(shapes[name]) != want:
            raise ValueError(f"{where}: vision tensor {name} has shape {list(shapes[name])}, the vision config "
                             f"implies {list(want)}")


def check_preprocess(cfg: VisionConfig, pre) -> None:
    """Raise ValueError when the processor (:class:`media.PreprocessConfig`) cuts patches of another geometry than
    the tower embeds: its rows would not fit the patch projection, and the first image would fail."""
    for ours, tower in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                        ("merge_size", "spatial_merge_size")):
        if getattr(pre, ours) != getattr(cfg, tower):
            raise ValueError(f"the preprocessor's {ours} {getattr(pre, ours)} differs from the vision tower's "
                             f"{tower} {getattr(cfg, tower)}")


# ---- position tables ------------------------------------------------------------------------------------------

def block_order(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of an ``h x w`` grid in spatial-merge-block order (blocks of ``m x m``)."""
    rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


def _bilinear_axis(n: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_corners sampling of ``n`` points from a ``side``-long axis: (low index, high index, high weight)."""
    src = torch.arange(n, dtype=torch.float32, device=device) * (side - 1) / max(n - 1, 1)
    lo = src.floor().long().clamp(0, side - 1)
    return lo, (lo + 1).clamp(max=side - 1), src - lo


class VisionTower:
    """The vision encoder on one device: ``encode(pixels, grids) -> [tokens, out_hidden_size]``."""

    def __init__(self, cfg: VisionConfig, raws: dict[str, RawWeight], *, device="cpu", dtype=torch.float32):
        check_shapes(cfg, {n: r.shape for n, r in raws.items()}, "vision component")
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.w = {n: raws[n].dense(dtype, self.device) for n in vision_weight_shapes(cfg)}
        self.patch_w = self.w["vision.patch_embed.proj.weight"].reshape(cfg.hidden_size, -1)  # [hidden, C*Tp*P*P]
        d = cfg.head_dim // 2  # angles per axis pair-set: rows use d/2 frequencies, columns the same d/2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.device) / d))
        self.act = ACTIVATIONS[cfg.hidden_act]

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[f"{name}.weight"], self.w[f"{name}.bias"],
                            self.cfg.layer_norm_eps)

    def positions(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per patch, in the order of ``grids``: the resampled absolute embedding ``[N, hidden]`` and rotary
        cos, sin ``[N, head_dim]`` (fp32)."""
        side, m = self.cfg.grid_side, self.cfg.spatial_merge_size
        table = self.w["vision.pos_embed.weight"].view(side, side, -1)
        embeds, angles = [], []
        for t, h, w in grids:
            r0, r1, fr = _bilinear_axis(h, side, self.device)
            c0, c1, fc = _bilinear_axis(w, side, self.device)
            fr, fc = fr[:, None, None], fc[None, :, None]
            grid = ((1 - fr) * (1 - fc) * table[r0][:, c0] + (1 - fr) * fc * table[r0][:, c1]
                    + fr * (1 - fc) * table[r1][:, c0] + fr * fc * table[r1][:, c1])  # [h, w, hidden] fp32 weights
            rows, cols = (x.to(self.device) for x in block_order(h, w, m))
            embeds.append(grid[rows, cols].repeat(t, 1))
            rc = torch.stack([rows, cols], dim=-1).float()  # [h*w, 2]
            ang = (rc[:, :, None] * self.inv_freq).reshape(h * w, -1)  # [h*w, head_dim/2]: row angles, col angles
            angles.append(ang.repeat(t, 1))
        emb = torch.cat(angles)
        emb = torch.cat([emb, emb], dim=-1)  # rotate-half pairs dim i with i + head_dim/2
        return torch.cat(embeds).to(self.dtype), emb.cos(), emb.sin()

    def attention(self, x: torch.Tensor, p: str, cos, sin, frames: list[tuple[int, int]]) -> torch.Tensor:
        """Bidirectional attention of ``x [N, hidden]`` within each frame; ``frames``: (count, patches) per item."""
        n, heads, hd = x.shape[0], self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self._lin(x, f"{p}.attn.qkv").view(n, 3, heads, hd).unbind(1)  # [N, heads, hd] each

        def rope(t):  # fp32 rotation over the whole head, as the reference does
            tf = t.float()
            rot = torch.cat([-tf[..., hd // 2:], tf[..., :hd // 2]], dim=-1)
            return (tf * cos[:, None] + rot * sin[:, None]).to(t.dtype)

        q, k = rope(q), rope(k)
        out, at = [], 0
        for count, size in frames:  # frames of one item share a length: one batched call per item
            sl = slice(at, at + count * size)
            qq, kk, vv = (y[sl].view(count, size, heads, hd).transpose(1, 2) for y in (q, k, v))
            o = F.scaled_dot_product_attention(qq, kk, vv)  # [count, heads, size, hd]
            out.append(o.transpose(1, 2).reshape(count * size, heads * hd))
            at += count * size
        return self._lin(torch.cat(out), f"{p}.attn.proj")

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Merged vision tokens ``[sum(t*h*w) / m^2, out_hidden_size]`` of patch rows ``pixels [N, patch_dim]``."""
        cfg = self.cfg
        grids = [tuple(int(v) for v in g) for g in grids]
        m = cfg.spatial_merge_size
        need = sum(t * h * w for t, h, w in grids)
        if pixels.shape != (need, cfg.patch_dim):
            raise ValueError(f"vision: pixels must be [{need}, {cfg.patch_dim}] for grids {grids}, "
                             f"got {list(pixels.shape)}")
        if any(h % m or w % m for _, h, w in grids):
            raise ValueError(f"vision: grid sides must be multiples of spatial_merge_size {m}, got {grids}")
        x = F.linear(pixels.to(self.device, self.dtype), self.patch_w, self.w["vision.patch_embed.proj.bias"])
        pos, cos, sin = self.positions(grids)
        x = x + pos
        frames = [(t, h * w) for t, h, w in grids]
        for b in range(cfg.depth):
            p = f"vision.blocks.{b}"
            x = x + self.attention(self._norm(x, f"{p}.norm1"), p, cos, sin, frames)
            x = x + self._lin(self.act(self._lin(self._norm(x, f"{p}.norm2"), f"{p}.mlp.linear_fc1")),
                              f"{p}.mlp.linear_fc2")
        x = self._norm(x, "vision.merger.norm").view(-1, cfg.hidden_size * m * m)  # [N/m^2, m^2 * hidden]
        x = F.gelu(self._lin(x, "vision.merger.linear_fc1"))
        return self._lin(x, "vision.merger.linear_fc2")


def encode_items(tower: VisionTower, cache, items, device) -> tuple[torch.Tensor, dict]:
    """Merged vision tokens of ``items`` (MediaInput) concatenated in order, each item looked up in ``cache`` (a
    MediaCache) by its SHA-256 first; the rest encoded in one tower call. Returns (embeds, stats)."""
    outs = [cache.get(it.sha256) for it in items]
    todo = [i for i, o in enumerate(outs) if o is None]
    t0 = time.perf_counter()
    if todo:
        pixels = torch.cat([items[i].pixels for i in todo])
        merged = tower.encode(pixels, [items[i].grid for i in todo])
        sizes = [items[i].tokens(tower.cfg.spatial_merge_size) for i in todo]
        for i, part in zip(todo, torch.split(merged, sizes)):
            outs[i] = part = part.clone() if len(todo) > 1 else part  # a cached item holds only its own rows
            cache.put(items[i].sha256, part)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    embeds = torch.cat(outs)
    stats = {"encode_ms": (time.perf_counter() - t0) * 1e3, "tokens": int(embeds.shape[0]), "items": len(items),
             "cached": len(items) - len(todo)}
    return embeds, stats
