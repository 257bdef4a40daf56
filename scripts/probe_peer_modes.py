"""Why our transformers peer (suites/hf_peer.py) decodes faster than the reference-GPU anchors'
transformers probe on the same GPU: one 27B-shape ``Qwen3_5ForCausalLM`` (random bf16 weights, built as the anchor
builds it), greedy ``generate`` timed the anchor's way (a 64-token call minus a 1-token call) under each
combination of the two things the peers do differently - the autograd mode around ``generate`` (the anchor: none,
i.e. generate's own no_grad; ours: inference_mode) and torch's default dtype left at bf16 after the build (the
anchor) or restored to fp32 (ours). Prints one JSON line per mode. Needs a CUDA GPU (about 60 GB)."""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch


def timed_generate(model, ids, new: int, grad_mode) -> dict:
    def run(n):
        with grad_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()

    run(4)  # warm
    t = time.perf_counter()
    run(1)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    run(new)
    total = time.perf_counter() - t
    dec = (total - ttft) / (new - 1)
    return {"decode_tok_s": round(1 / dec, 2), "ms_per_token": round(dec * 1e3, 2), "ttft_ms": round(ttft * 1e3, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--layers", type=int, default=64)
    args = ap.parse_args()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    try:
        import fla  # noqa: F401
        has_fla = True
    except ImportError:
        has_fla = False
    cfg = Qwen3_5TextConfig(hidden_size=5120, num_hidden_layers=args.layers, num_attention_heads=24,
                            num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                            linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=17408,
                            vocab_size=248320, max_position_embeddings=262144)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg)
    model.eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 200000, (1, args.ctx), device="cuda", generator=g)
    modes = {"no_grad": contextlib.nullcontext, "inference_mode": torch.inference_mode}
    for default in (torch.bfloat16, torch.float32):
        torch.set_default_dtype(default)
        for name, mode in modes.items():
            row = {"grad_mode": name, "default_dtype": str(default).replace("torch.", ""), "fla": has_fla,
                   "ctx": args.ctx, **timed_generate(model, ids, args.new, mode)}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
