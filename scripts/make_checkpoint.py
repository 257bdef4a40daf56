"""Write a random-weight Qwen3.5 text checkpoint with transformers, to test conversion at a real model's scale.

    python scripts/make_checkpoint.py OUT --shape 27b --dtype fp8 --device cuda   # Qwen's FP8 release layout
    python scripts/make_checkpoint.py OUT --shape 1b                               # bf16, a 1.0B model

transformers builds ``Qwen3_5ForCausalLM`` of the shape (its own initialisation, on ``--device``) and writes it with
``save_pretrained`` in shards. ``--dtype fp8`` stores every projection as Qwen's ``-FP8`` releases do
(``quant_method: fp8``, e4m3 weights with one ``weight_scale_inv`` per 128 x 128 block, ``w = fp8 * scale``);
embeddings, lm_head, norms, the convolutions and the tiny GDN ``in_proj_a`` / ``in_proj_b`` stay bf16, listed in
``modules_to_not_convert``. The bundled model's tokenizer goes beside the weights (its ids fit any vocabulary of the
family), so the converted artifact decodes the same prompts as ``--synthetic``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bootstrap import ensure_package  # noqa: E402

ensure_package()
from ninfer_bench.engine.artifact.reader import Artifact  # noqa: E402
from ninfer_bench.engine.artifact.tokenizer import load_tokenizer_json  # noqa: E402
from ninfer_bench.engine.model.config import PRESETS, ModelConfig  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "ninfer-code-small.ninfer"
SHAPES = {
    "27b": PRESETS["qwen3.8-27b"],
    "tiny": PRESETS["tiny"],
    # 1.0B: the 27B's vocabulary and head layout, a narrower and shallower trunk
    "1b": dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
               num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
               linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, rope_theta=1e7,
               partial_rotary_factor=0.25, tie_word_embeddings=False),
}
BLOCK = 128
KEEP = ("embed_tokens", "lm_head", "in_proj_a", "in_proj_b")  # stay bf16 in the FP8 layout


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale per 128 x 128 block) with ``w ~ fp8 * scale``."""
    n, k = w.shape
    pn, pk = -(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK
    padded = torch.nn.functional.pad(w.float(), (0, pk - k, 0, pn - n))
    blocks = padded.reshape(pn // BLOCK, BLOCK, pk // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(pn, pk)[:n, :k]
    return q.contiguous(), scale.contiguous()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shard", default="5GB", help="save_pretrained's max_shard_size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = ModelConfig(**{**SHAPES[args.shape], "mtp_num_hidden_layers": 0})
    hf_cfg = Qwen3_5TextConfig(**cfg.to_hf())
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = Qwen3_5ForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    print(f"built {args.shape} ({params / 1e9:.2f}B parameters) on {args.device} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    state = None
    if args.dtype == "fp8":
        state = {}
        for name, t in model.state_dict().items():
            if t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in KEEP):
                q, s = fp8_block(t)
                state[name], state[name[: -len("weight")] + "weight_scale_inv"] = q.cpu(), s.cpu()
            else:
                state[name] = t.cpu()
        model.config.quantization_config = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": ["lm_head", "model.embed_tokens", "linear_attn.in_proj_a",
                                       "linear_attn.in_proj_b"]}
    t0 = time.perf_counter()
    model.save_pretrained(args.out, state_dict=state, max_shard_size=args.shard)
    with Artifact.open(BUNDLED) as art:
        tokenizer = art.blob("tokenizer.json")
    try:
        load_tokenizer_json(tokenizer, cfg.vocab_size)
        (args.out / "tokenizer.json").write_bytes(tokenizer)
    except ValueError as e:  # a vocabulary smaller than the tokenizer's (the tiny shape): the byte tokenizer then
        print(f"no tokenizer.json: {e}")
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    shards = len(list(args.out.glob("*.safetensors")))
    print(f"wrote {args.out} ({args.dtype}, {shards} shards, {size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
    print(json.dumps({"shape": args.shape, "dtype": args.dtype, "parameters": params, "bytes": size,
                      "shards": shards}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
