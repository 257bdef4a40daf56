"""Attention kernel test cases shared by the decode and prefill attention tests: a random cache of several slots (int8
codes and scales, or bf16 / fp16) and queries at given positions, on the device the kernels run on."""

import torch

from ninfer_bench.kernels.kv_quant import quantize_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(kv, b, t, h, hkv, hd, lengths, slots, cap, q_dtype=torch.float32, seed=0):
    """Random q and a cache of `slots` slots; row i reads slot perm[i] (out of order) and ends at lengths[i]."""
    g = torch.Generator().manual_seed(seed)
    k = 2 * torch.randn(slots, hkv, cap, hd, generator=g)
    v = torch.randn(slots, hkv, cap, hd, generator=g)
    slot_ids = torch.randperm(slots, generator=g)[:b]
    length = torch.tensor(lengths)
    q_pos = length[:, None] - t + torch.arange(t)[None, :]  # [B, T]: the T new tokens end each row
    q = torch.randn(b, t, h, hd, generator=g).to(q_dtype)
    if kv == "int8":
        (kc, ks), (vc, vs) = quantize_kv(k), quantize_kv(v)
    else:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[kv]
        kc, vc, ks, vs = k.to(dt), v.to(dt), None, None
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return dict(q=to(q), k_cache=to(kc), v_cache=to(vc), k_scale=to(ks), v_scale=to(vs), slots=to(slot_ids),
                q_pos=to(q_pos), scale=hd ** -0.5)


def rel_rms(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()
