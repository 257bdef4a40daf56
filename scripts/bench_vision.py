"""Vision encode time at the real Qwen3.5 vision shape (depth 27, hidden 1152, 16 heads, patch 16, merge 2, out 5120),
ours (engine/model/vision.py) next to transformers' ``Qwen3_5VisionModel`` on the same seeded synthetic weights.

Inputs: one 1024 x 1024 image (64 x 64 patches -> 1024 merged tokens) and one 16-frame 640 x 360 video (sampled at
2 fps from 8 s -> 16 frames -> 8 x 22 x 40 patches -> 1760 tokens), both random pixels through our preprocessing
(its host time is reported separately). Per input: correctness first (relative RMS of ours vs transformers' merged
tokens, printed loudly when over the bf16 tolerance), then the median / p10 / p90 milliseconds of the tower call
over ``--repeats`` CUDA-event-timed calls after ``--warmup``, for both. One JSON line per measurement to
``$OUT/vision.jsonl`` (or ``--out``) and a Markdown table on stdout, for docs/perf/.

    python scripts/bench_vision.py                       # the H200 run (CUDA, bf16)
    python scripts/bench_vision.py --device cpu --depth 2 --repeats 2   # a smoke test on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ninfer_bench.kernels import quant  # noqa: E402
from ninfer_bench.engine.media.decode import PreprocessConfig, image_patches, sample_frames, video_patches  # noqa: E402
from ninfer_bench.engine.model.vision import VisionConfig, VisionTower  # noqa: E402
from ninfer_bench.engine.model.weights import RawWeight  # noqa: E402

SHAPE = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120, patch_size=16,
             temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304)
RTOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}  # bf16: both towers round activations differently per block
SEED = 0


def towers(depth: int, device, dtype):
    """(ours, transformers') on the same seeded weights: transformers' init, 1-D parameters perturbed."""
    import transformers as tf

    torch.manual_seed(SEED)
    shape = {**SHAPE, "depth": depth}
    hf = tf.Qwen3_5VisionModel._from_config(tf.Qwen3_5VisionConfig(**shape), attn_implementation="sdpa")
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    hf = hf.to(device=device, dtype=dtype).eval()
    fmt = "bf16" if dtype == torch.bfloat16 else "fp32"
    raws = {f"vision.{n}": RawWeight(fmt, tuple(t.shape), quant.pack(t.detach().cpu(), fmt))
            for n, t in hf.state_dict().items()}
    ours = VisionTower(VisionConfig(**shape), raws, device=device, dtype=dtype)
    return ours, hf


def inputs(cfg: PreprocessConfig) -> dict:
    """name -> (pixels, grid, host preprocessing ms)."""
    rng = np.random.default_rng(SEED)
    out = {}
    t = time.perf_counter()
    px, grid = image_patches(rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8), cfg)
    out["image 1024x1024"] = (px, grid, (time.perf_counter() - t) * 1e3)
    frames = rng.integers(0, 256, (16, 360, 640, 3), dtype=np.uint8)
    t = time.perf_counter()
    idx = sample_frames(16, 2.0, cfg)  # an 8 s clip at 2 fps: all 16 frames kept
    px, grid = video_patches(frames[idx], cfg)
    out["video 16x640x360"] = (px, grid, (time.perf_counter() - t) * 1e3)
    return out


def timed_ms(fn, device, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--depth", type=int, default=SHAPE["depth"], help="ViT blocks (27 is the real shape)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON lines file [default: $OUT/vision.jsonl, else ./vision.jsonl]")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "vision.jsonl")
    ours, hf = towers(args.depth, device, dtype)
    cfg = PreprocessConfig(patch_size=16, merge_size=2, temporal_patch_size=2)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    with open(out_path, "a") as f, torch.inference_mode():
        for name, (px, grid, host_ms) in inputs(cfg).items():
            grid_t = torch.tensor([list(grid)], device=device)
            px_dev = px.to(device=device, dtype=dtype)
            mine = ours.encode(px_dev, [grid])
            theirs = hf(px_dev, grid_thw=grid_t).pooler_output
            err = float((mine.double() - theirs.double()).norm() / theirs.double().norm())
            ok = err <= RTOL[dtype]
            if not ok:
                print(f"!!! {name}: ours vs transformers relative RMS {err:.3e} > {RTOL[dtype]}", file=sys.stderr)
            for impl, fn in (("ours", lambda: ours.encode(px_dev, [grid])),
                             ("transformers", lambda: hf(px_dev, grid_thw=grid_t))):
                ms = timed_ms(fn, device, args.warmup, args.repeats)
                rec = {"bench": "vision", "input": name, "impl": impl, "device": gpu, "dtype": args.dtype,
                       "depth": args.depth, "grid_thw": list(grid), "patches": px.shape[0],
                       "merged_tokens": int(mine.shape[0]), "ms_median": statistics.median(ms),
                       "ms_p10": float(np.percentile(ms, 10)), "ms_p90": float(np.percentile(ms, 90)),
                       "samples_ms": ms, "host_preprocess_ms": host_ms, "rel_rms_vs_transformers": err, "ok": ok}
                f.write(json.dumps(rec) + "\n")
                rows.append(rec)
    print("| input | impl | grid t x h x w | merged tokens | median ms [p10-p90] | host preprocess ms | "
          "rel RMS vs transformers |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['input']} | {r['impl']} | {' x '.join(map(str, r['grid_thw']))} | {r['merged_tokens']} | "
              f"{r['ms_median']:.2f} [{r['ms_p10']:.2f}-{r['ms_p90']:.2f}] | {r['host_preprocess_ms']:.0f} | "
              f"{r['rel_rms_vs_transformers']:.1e}{'' if r['ok'] else ' FAIL'} |")
    print(f"\n{gpu}, {args.dtype}, depth {args.depth}; JSON lines: {out_path}")
    if not all(r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
