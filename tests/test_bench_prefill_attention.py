"""scripts/bench_prefill_attention.py's fp32 reference, which every row's ``rel_vs_fp32`` is measured against."""

import torch

import bench_prefill_attention as bench  # scripts/ (conftest puts it on sys.path)

from ninfer_bench.kernels.kv_quant import dequantize_kv, quantize_kv


def test_reference_is_fp32_attention_over_the_caches_exact_values():
    """GQA (3 query heads a kv head), keys 0 .. keys - 1 of a longer cache, each query up to its position: the
    float64 softmax over the codes times their scales, to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    h, hkv, hd, cap, t, keys = 6, 2, 32, 40, 8, 30
    k, v = (torch.randn(1, hkv, cap, hd, generator=g) for _ in range(2))
    (kc, ks), (vc, vs) = quantize_kv(k), quantize_kv(v)
    q = torch.randn(1, t, h, hd, generator=g).to(torch.bfloat16)
    q_pos = (keys - t - 2 + torch.arange(t))[None]  # the last two keys below `keys` are seen by no query
    out = bench.reference(q, kc, ks, vc, vs, q_pos, hd ** -0.5, keys)
    assert out.dtype == torch.float32 and out.shape == q.shape
    kk, vv = (dequantize_kv(c, s, torch.float64)[0, :, :keys].repeat_interleave(h // hkv, 0)
              for c, s in ((kc, ks), (vc, vs)))
    s = torch.einsum("thd,hkd->htk", q[0].double(), kk) * hd ** -0.5
    live = torch.arange(keys)[None, :] <= q_pos[0][:, None]
    want = torch.einsum("htk,hkd->thd", torch.softmax(s.masked_fill(~live[None], float("-inf")), -1), vv)
    assert (out[0].double() - want).abs().max() < 1e-5
    # the keys no query reaches do not count: values scaled far up there change nothing (weights exactly 0)
    poisoned = vs.clone()
    poisoned[:, :, keys - 2:] = 1e4
    assert torch.equal(bench.reference(q, kc, ks, vc, poisoned, q_pos, hd ** -0.5, keys), out)
