"""The CUDA paths at model shapes the other tests do not use: every kernel choice that depends on a dimension
(head dims 8-256, GQA ratios 1-8, GDN key / value head ratios 1-6, K not a multiple of the quantization group, N not
a multiple of 16, odd vocabularies, partial rotary, a 3-wide conv) against the CPU engine (which test_hf_parity
holds to transformers) and against the eager runtime. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from ninfer_bench.engine.artifact.convert import convert
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.sampling import SamplingParams
from ninfer_bench.engine.runtime.scheduler import Scheduler
from tinyhf import make_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {
    "gqa4-hd64": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                      linear_value_head_dim=32, intermediate_size=256),
    "hd256-gdn128": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                         linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=128,
                         linear_value_head_dim=128, intermediate_size=128),
    "odd-dims": dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=3, head_dim=32,
                     partial_rotary_factor=0.5, linear_num_key_heads=3, linear_num_value_heads=3,
                     linear_key_head_dim=16, linear_value_head_dim=40, intermediate_size=200, vocab_size=301,
                     linear_conv_kernel_dim=3),
    "mha8-hd8-wide-v": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=8, head_dim=8,
                            linear_num_key_heads=1, linear_num_value_heads=6, linear_key_head_dim=16,
                            linear_value_head_dim=64, intermediate_size=160),
    "gqa8": dict(hidden_size=160, num_attention_heads=8, num_key_value_heads=1, head_dim=32,
                 linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=24, linear_value_head_dim=24,
                 intermediate_size=320, num_hidden_layers=4),
}
PROMPT = torch.randint(3, 290, (181,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def shape(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_hf("qwen3_5", folder / "hf", seed=7, max_position_embeddings=1024, **SHAPES[request.param])
    return folder


def load(art, runtime: str, **kw) -> Engine:
    return Engine.load(str(art), device="cuda", dtype="fp32", runtime=runtime, max_context=512, **kw)


def test_fp32_v3_matches_the_cpu_engine_and_v2(shape):
    """fp32 weights: v3's prefill logits within TF32 reach of the CPU engine's (which test_hf_parity holds to
    transformers; transformers itself would run fla's Triton kernels here, CUDA only) and its captured greedy decode
    the CPU engine's argmax on the sequence so far (fp32 K/V: graphs, torch attention); with bf16 K/V (graphs, the
    fused kernels, side branches) v3 decodes v2's eager tokens."""
    art = shape / "fp32.ninfer"
    if not art.exists():
        convert(shape / "hf", art, policy="fp32")
    cpu = Engine.load(str(art), device="cpu", kv_dtype="fp32", max_context=512)
    ref = cpu.logits(PROMPT)
    v3 = load(art, "v3", kv_dtype="fp32")
    got = v3.logits(PROMPT).float()
    assert float((got - ref).norm() / ref.norm()) < 2e-3
    out = v3.generate(PROMPT, max_new_tokens=24, ignore_eos=True).tokens
    assert v3.graphs is not None and v3.graphs.graphs, "v3 on CUDA should replay captured graphs"
    assert out == cpu.logits(PROMPT + out[:-1])[len(PROMPT) - 1:].argmax(-1).tolist()
    fused = load(art, "v3", kv_dtype="bf16")
    assert fused.model.fast is not None
    assert fused.generate(PROMPT, max_new_tokens=24, ignore_eos=True).tokens == \
        load(art, "v2", kv_dtype="bf16").generate(PROMPT, max_new_tokens=24, ignore_eos=True).tokens


@pytest.mark.parametrize("policy,kv", [("q4", "int8"), ("mixed", "bf16")])
def test_packed_v3_decodes_v2_tokens(shape, policy, kv):
    """Packed weights (qmv / Triton qlinear at these N, K; K past the last whole group zero-padded): v3 decodes the
    tokens v2 decodes from the same packed weights, each prompt alone and the three batched by the scheduler
    (batch buckets 1-3 of the captured graphs)."""
    art = shape / f"{policy}.ninfer"
    if not art.exists():
        convert(shape / "hf", art, policy=policy)
    prompts = [PROMPT, PROMPT[:97], PROMPT[40:]]
    v2 = load(art, "v2", kv_dtype=kv)
    want = [v2.generate(p, max_new_tokens=24, ignore_eos=True).tokens for p in prompts]
    v3 = load(art, "v3", kv_dtype=kv, max_concurrency=3)
    assert [v3.generate(p, max_new_tokens=24, ignore_eos=True).tokens for p in prompts] == want
    sched = Scheduler(v3)
    reqs = [sched.submit(p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for p in prompts]
    sched.run_until_idle()
    assert [r.tokens for r in reqs] == want
