"""Prefill attention at the 27B shape (H=24, Hkv=4, hd=256) on one CUDA GPU: one prompt chunk of T tokens after
``start`` earlier tokens, against every key up to its position, int8 K/V in the cache.

Per start position, in one process:
  sdpa-copy     what runtime v3 ran before kernels/attention_prefill.py: the slot's K/V gathered and dequantized to
                bf16 (cache.read_kv), then torch SDPA with an explicit [T x L] mask, K/V heads repeated to H
  flash-int8    prefill_attention reading the int8 cache in place (the default plan, then --sweep's shapes)
  dequant       kv_quant.dequantize_kv of the whole cache to bf16 (torch)
  flash-bf16    prefill_attention over a bf16 copy of the cache (--sweep bf16: more launch shapes; --sweep tma: K / V
                through tensor descriptors or not; each line says whether it gave the default's bits)
  copy          dequantize_slots of the slot's K and V (the Triton copy prefill_attention_cached makes)
  flash-copy    prefill_attention_cached on the int8 cache: that copy, then the kernel over it (what the engine runs by
                default)
  cudnn-split   (starts >= CUDNN_PAST_MIN) the same with cudnn: the copy in BSHD memory, the past keys through cuDNN,
                the diagonal through the kernel, folded (the engine's --cudnn-prefill on)
  torch-flash   (start 0 only) torch SDPA's flash kernel, is_causal, native GQA, on bf16 K/V: the transformers
                peer's attention kernel, as a yardstick
  past-*        (--past, starts > 0) the chunk against keys 0 .. start - 1 alone, no mask: ours (past-ours), torch
                SDPA's cuDNN and flash backends with native GQA (-gqa) and with K / V repeated to H heads (-rep); TFLOP/s
                of 4 hd H T start, relative RMS against past-ours
Each line: median ms (triton.testing.do_bench), TFLOP/s (4 hd H x the causal query-key pairs) and the relative RMS
against the fp32 reference (:func:`reference`: the cache's exact values, codes times scales in fp32, and fp32 math;
``rel_vs_fp32``; the past-* rows against the same over keys 0 .. start - 1). JSON lines to --json.

    python3 scripts/bench_prefill_attention.py [--chunk 2048] [--starts 0,8192,32768,63488] [--sweep int8,bf16,tma]
        [--past] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402

_bootstrap.ensure_package()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ninfer_bench.kernels import attention_prefill as ap  # noqa: E402
from ninfer_bench.kernels.attention import attention as sdpa_attention  # noqa: E402
from ninfer_bench.kernels.kv_quant import dequantize_kv, quantize_kv  # noqa: E402

DEVICE = "cuda"
H, HKV, HD = 24, 4, 256
SWEEP = [dict(block_m=128, block_n=64, num_warps=8, num_stages=2), dict(block_m=128, block_n=32, num_warps=8,
         num_stages=2), dict(block_m=128, block_n=64, num_warps=8, num_stages=1),
         dict(block_m=128, block_n=32, num_warps=4, num_stages=2), dict(block_m=64, block_n=64, num_warps=4,
         num_stages=2), dict(block_m=64, block_n=64, num_warps=8, num_stages=2),
         dict(block_m=64, block_n=32, num_warps=4, num_stages=3), dict(block_m=128, block_n=128, num_warps=8,
         num_stages=1), dict(block_m=64, block_n=128, num_warps=8, num_stages=1)]

# --sweep tma: K / V tiles through tensor descriptors (PrefillConfig.tma) over the bf16 copy, and the default shape
# without them. Session 57 also swept Triton's warp-specialized key loop (1.2% slower at 128 x 64, 8 warps; no
# build at 4 warps) and p.v accumulated inside the dot (the same bits and time: the same code); both were removed
# (docs/perf/2026-12-05f-prefill-attention-tma.md)
SWEEP_TMA = [dict(block_m=128, block_n=64, num_warps=8, num_stages=2, tma=True),
             dict(block_m=128, block_n=64, num_warps=8, num_stages=2, tma=False),
             dict(block_m=128, block_n=32, num_warps=8, num_stages=3, tma=True),
             dict(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=True)]

SWEEP_BF16 = [dict(block_m=128, block_n=64, num_warps=8, num_stages=3), dict(block_m=128, block_n=128, num_warps=8,
              num_stages=1), dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
              dict(block_m=128, block_n=32, num_warps=8, num_stages=3), dict(block_m=64, block_n=64, num_warps=4,
              num_stages=3), dict(block_m=128, block_n=64, num_warps=4, num_stages=2)]


def best_plan(lines: list[dict], margin: float = 0.97) -> str:
    """The fastest flash-bf16 launch shape at the last start as ``field=value,...`` (NINFER_BENCH_PREFILL_PLAN), or
    "" when the default plan's row is missing or no shape beats it by ``1 - margin``."""
    rows = [r for r in lines if r["method"] == "flash-bf16"]
    if not rows:
        return ""
    last = max(r["start"] for r in rows)
    rows = [r for r in rows if r["start"] == last]
    base = [r["ms"] for r in rows if r["config"] is None]
    tried = [r for r in rows if r["config"] is not None]
    if not base or not tried:
        return ""
    best = min(tried, key=lambda r: r["ms"])
    if best["ms"] >= margin * base[0]:
        return ""
    return ",".join(f"{k}={int(v)}" for k, v in best["config"].items())


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference(q, kc, ks, vc, vs, q_pos, scale: float, keys: int) -> torch.Tensor:
    """fp32 attention of ``q [1, T, H, hd]`` over keys ``0 .. keys - 1`` of the int8 cache ``kc`` / ``vc [1, Hkv, cap,
    hd]`` at their exact values (kv_quant.dequantize_kv in fp32: each code times its scale), query t seeing the keys
    up to ``q_pos[0, t]``; ``[1, T, H, hd]`` fp32, one query head at a time (TF32 off)."""
    h, hkv = q.shape[2], kc.shape[1]
    k = dequantize_kv(kc[:, :, :keys], ks[:, :, :keys], torch.float32)[0]  # [Hkv, keys, hd]
    v = dequantize_kv(vc[:, :, :keys], vs[:, :, :keys], torch.float32)[0]
    live = torch.arange(keys, device=q.device)[None, :] <= q_pos[0][:, None]  # [T, keys]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for j in range(h):
            kv = j // (h // hkv)
            s = (q[0, :, j].float() @ k[kv].T) * scale
            out[0, :, j] = torch.softmax(s.masked_fill(~live, float("-inf")), -1) @ v[kv]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def timed(fn) -> float:
    from triton.testing import do_bench

    fn()
    return do_bench(fn, warmup=5, rep=50, return_mode="median")


def past_rows(q, kb, vb, slots, start: int, scale: float, ref) -> list[dict]:
    """--past: the chunk's queries against keys 0 .. start - 1 alone (the unmasked bulk of a long prompt's chunk),
    ours beside torch SDPA's backends; each row's relative RMS against ``ref`` (the fp32 reference over those keys)
    and against ours, and its TFLOP/s (4 hd H T start)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t = q.shape[1]
    q_pos = torch.full((1, t), start - 1, device=DEVICE)
    flops = 4 * HD * H * t * start
    qh = q.transpose(1, 2)  # [1, H, T, hd] over [1, T, H, hd] memory: the layout cuDNN takes
    kp = kb[:, :, :start].transpose(1, 2).contiguous().transpose(1, 2)  # [1, Hkv, start, hd] over BSHD memory
    vp = vb[:, :, :start].transpose(1, 2).contiguous().transpose(1, 2)
    kr = kp.repeat_interleave(H // HKV, dim=1).transpose(1, 2).contiguous().transpose(1, 2)  # [1, H, start, hd]
    vr = vp.repeat_interleave(H // HKV, dim=1).transpose(1, 2).contiguous().transpose(1, 2)

    def sdpa(backend, k, v, gqa):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qh, k, v, scale=scale, enable_gqa=gqa).transpose(1, 2)
        return run

    rows = [("past-ours", lambda: ap.prefill_attention(q, kb, vb, None, None, slots, q_pos, scale))]
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        rows += [(f"past-{name}-gqa", sdpa(backend, kp, vp, True)), (f"past-{name}-rep", sdpa(backend, kr, vr, False))]
    out, base = [], None
    for name, fn in rows:
        try:
            o = fn()
            torch.cuda.synchronize()
            base = o if base is None else base
            err, err32 = rel(o, base), rel(o, ref)
            ms = timed(fn)
        except Exception as exc:  # a backend refusing the shapes
            print(f"start {start:6d} {name:16s}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        tf = flops / (ms * 1e-3) / 1e12
        out.append({"start": start, "chunk": t, "method": name, "config": None, "ms": round(ms, 4),
                    "tflops": round(tf, 1), "rel_vs_fp32": round(err32, 6), "rel_vs_past_ours": round(err, 5)})
        print(f"start {start:6d} {name:16s}{'':23s} {ms:9.3f} ms {tf:7.1f} TFLOP/s  rel {err32:.2e} "
              f"({err:.2e} vs past-ours)", flush=True)
    return out


def main() -> int:
    ap_ = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap_.add_argument("--chunk", type=int, default=2048)
    ap_.add_argument("--starts", default="0,8192,32768,63488")
    ap_.add_argument("--sweep", default="", help="int8, bf16, tma (comma-separated): also the launch shapes of "
                     "SWEEP (int8 in place), SWEEP_BF16 (over the copy) or SWEEP_TMA (over the copy, K / V through "
                     "tensor descriptors)")
    ap_.add_argument("--past", action="store_true",
                     help="at each start > 0, also the past keys alone (every query row against keys 0 .. start - 1, "
                          "no mask): ours (q_pos = start - 1) beside torch SDPA's cuDNN and flash backends on the bf16 "
                          "copy, native GQA and K / V repeated to the query heads: can a library kernel take the bulk "
                          "of a long prompt's chunk?")
    ap_.add_argument("--json", default=None)
    ap_.add_argument("--best-plan", default=None, metavar="FILE",
                     help="write the fastest flash-bf16 launch shape at the last start as an NINFER_BENCH_PREFILL_PLAN "
                          "value (empty when none beats the default plan by 3%%)")
    args = ap_.parse_args()
    if not torch.cuda.is_available():
        print("bench_prefill_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  H={H} Hkv={HKV} hd={HD} T={args.chunk}")
    lines = []
    t = args.chunk
    scale = HD ** -0.5
    for start in (int(s) for s in args.starts.split(",")):
        cap = start + t
        g = torch.Generator(device=DEVICE).manual_seed(start)
        k = torch.randn(1, HKV, cap, HD, generator=g, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn(1, HKV, cap, HD, generator=g, device=DEVICE, dtype=torch.bfloat16)
        (kc, ks), (vc, vs) = quantize_kv(k), quantize_kv(v)
        del k, v
        q = torch.randn(1, t, H, HD, generator=g, device=DEVICE, dtype=torch.bfloat16)
        q_pos = (start + torch.arange(t, device=DEVICE))[None]
        slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
        flops = 4 * HD * H * (t * start + t * (t + 1) // 2)

        def copy_path():
            kk = dequantize_kv(kc[slots, :, :cap], ks[slots, :, :cap], torch.bfloat16)
            vv = dequantize_kv(vc[slots, :, :cap], vs[slots, :, :cap], torch.bfloat16)
            return sdpa_attention(q, kk, vv, q_pos, scale)

        base = reference(q, kc, ks, vc, vs, q_pos, scale, cap)
        rows = [("sdpa-copy", None, copy_path)]
        kb, vb = dequantize_kv(kc, ks, torch.bfloat16), dequantize_kv(vc, vs, torch.bfloat16)
        rows.append(("dequant", None, lambda: (dequantize_kv(kc, ks, torch.bfloat16),
                                               dequantize_kv(vc, vs, torch.bfloat16))))
        sweep = args.sweep.split(",")
        cfgs = [None] + ([ap.PrefillConfig(**c) for c in SWEEP] if "int8" in sweep else [])
        for cfg in cfgs:
            rows.append(("flash-int8", cfg, lambda cfg=cfg: ap.prefill_attention(q, kc, vc, ks, vs, slots, q_pos,
                                                                                 scale, config=cfg)))
        bf16_cfgs = [None] + ([ap.PrefillConfig(**c) for c in SWEEP_BF16] if "bf16" in sweep else []) \
            + ([ap.PrefillConfig(**c) for c in SWEEP_TMA] if "tma" in sweep else [])
        for cfg in bf16_cfgs:
            rows.append(("flash-bf16", cfg, lambda cfg=cfg: ap.prefill_attention(q, kb, vb, None, None, slots, q_pos,
                                                                                 scale, config=cfg)))
        rows.append(("copy", None, lambda: (ap.dequantize_slots(kc, ks, slots, cap, torch.bfloat16),
                                            ap.dequantize_slots(vc, vs, slots, cap, torch.bfloat16))))
        rows.append(("flash-copy", None, lambda: ap.prefill_attention_cached(q, kc, vc, ks, vs, slots, q_pos, scale,
                                                                             kv_len=cap)))
        if start >= ap.CUDNN_PAST_MIN:
            rows.append(("cudnn-split", None, lambda: ap.prefill_attention_cached(
                q, kc, vc, ks, vs, slots, q_pos, scale, kv_len=cap, cudnn=True, past_start=start)))
        if start == 0:
            def torch_flash():
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q.transpose(1, 2), kb, vb, is_causal=True, scale=scale,
                                                          enable_gqa=True).transpose(1, 2)
            rows.append(("torch-flash", None, torch_flash))
        first = {}  # method -> its first (default-plan) output: do the other launch shapes give its bits?
        for name, cfg, fn in rows:
            try:
                out = fn()
                torch.cuda.synchronize()
                err = rel(out, base) if isinstance(out, torch.Tensor) else None
                same = None
                if isinstance(out, torch.Tensor):
                    same = torch.equal(out, first[name]) if name in first else None
                    first.setdefault(name, out)
                ms = timed(fn)
            except Exception as exc:  # a launch shape past the shared memory, a backend refusing the call
                print(f"start {start:6d} {name:12s} {cfg}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            tf = flops / (ms * 1e-3) / 1e12 if err is not None else None
            rec = {"start": start, "chunk": t, "method": name,
                   "config": None if cfg is None else dataclasses.asdict(cfg),
                   "ms": round(ms, 4), "tflops": tf and round(tf, 1), "rel_vs_fp32": err and round(err, 6),
                   "same_bits_as_default": same}
            lines.append(rec)
            cfg_s = "" if cfg is None else f" m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" \
                + (" tma" if cfg.tma else "")
            tf_s = "" if tf is None else f" {tf:7.1f} TFLOP/s"
            err_s = "" if err is None else f"  rel {err:.2e}"
            same_s = "" if same is None else ("  same bits" if same else "  BITS DIFFER")
            print(f"start {start:6d} {name:12s}{cfg_s:27s} {ms:9.3f} ms{tf_s}{err_s}{same_s}", flush=True)
        if args.past and start > 0:
            past_ref = reference(q, kc, ks, vc, vs, torch.full((1, t), start - 1, device=DEVICE), scale, start)
            lines += past_rows(q, kb, vb, slots, start, scale, past_ref)
        base = None
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in lines))
    if args.best_plan:
        Path(args.best_plan).write_text(best_plan(lines) + "\n")
    print(f"done at {time.strftime('%H:%M:%S')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
