"""A prompt chunk whose caller reads the final hidden state of one row only (``Step.rows``: the prompt's last token,
for the first token's logits) runs its last decoder layer past the token mixing for that row alone
(engine/model/hybrid.HybridModel.last_rows). Held here, through the
fused prefill (Triton's interpreter without CUDA, the kernels on a GPU) and the eager forward:

- the cache (K/V, conv and recurrent states) is what the whole layer leaves, bit for bit: the mixing takes every row;
- the row's hidden state is the whole forward's, to rounding;
- with ``all_rows`` (a drafter reading every row) the forward returns the whole forward's rows bit for bit, and the
  row read is computed as without it, bit for bit, so the first token does not depend on the drafter;
- no row read (a long prompt's earlier chunk): no hidden state, the same cache;
- greedy speculative tokens (MTP, DFlash2) equal plain decoding's, bit for bit, through both paths; and in fp32 the
  trimmed paths decode the tokens of the eager path with every row computed (``--last-rows off``); with the last layer
  a full attention one (the preset) or a Gated DeltaNet one.
"""

from __future__ import annotations

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)
from ninfer_bench.engine.model.config import PRESETS
from ninfer_bench.engine.model.fused_forward import available
from ninfer_bench.engine.model.hybrid import PREFILL, Step
from ninfer_bench.engine.runtime.engine import Engine

pytestmark = pytest.mark.skipif(not available(), reason="triton does not import")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LIN, FULL = "linear_attention", "full_attention"
LAYOUTS = {"attention-last": (LIN, LIN, LIN, FULL), "gdn-last": (LIN, FULL, LIN, LIN)}
PROMPT = list(range(5, 41))  # 36 tokens: three chunks of 16 in the engine tests


def load(monkeypatch, layout: str, dtype: str | None = None, **kw) -> Engine:
    """The tiny model with ``layout``'s layer types; bf16 on a GPU unless ``dtype`` says otherwise."""
    monkeypatch.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "layer_types": LAYOUTS[layout]})
    eng = Engine.load("tiny", device=DEVICE, kv_dtype="int8", dtype=dtype or ("fp32" if DEVICE == "cpu" else "bf16"),
                      max_context=256, **kw)
    assert eng.config.layer_types == LAYOUTS[layout]
    return eng


def cache_of(eng: Engine, slot: int) -> list[torch.Tensor]:
    c = eng.cache
    out = [c.conv[i][slot].clone() for i in sorted(c.conv)] + [c.ssm[i][slot].clone() for i in sorted(c.ssm)]
    for key in sorted(c.kv):
        layer = c.kv[key]
        out += [t[slot].clone() for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
    return out


def chunks(eng: Engine, rows_of, all_rows: bool = False):
    """The prompt in two chunks (16 + 20 tokens) into a fresh slot 0, each forward's Step given ``rows_of(n)``;
    returns (each chunk's (hidden, head), the slot's cache after)."""
    eng.cache.reset(0)
    out = []
    for start, end in ((0, 16), (16, len(PROMPT))):
        n = end - start
        step = Step(torch.tensor([PROMPT[start:end]], device=eng.device),
                    torch.arange(start, end, device=eng.device)[None], torch.tensor([0], device=eng.device),
                    kv_len=end, mode=PREFILL, start=start, rows=rows_of(n), all_rows=all_rows)
        hidden, _ = eng.model.forward(step, eng.cache)
        out.append((hidden.clone(), None if step.head is None else step.head.clone()))
    return out, cache_of(eng, 0)


@pytest.mark.parametrize("path", ["fused", "eager", "eager-flash"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_last_row_alone_keeps_the_cache_and_the_row(monkeypatch, layout, path):
    """Through the fused prefill (FastPath), the eager forward, and the eager forward with the flash prefill
    attention (``--fused-prefill off``), all by HybridModel.last_rows."""
    kw = {"fused": dict(kernels="triton"), "eager": dict(kernels="torch"),
          "eager-flash": dict(kernels="triton", fused_prefill=False)}[path]
    eng = load(monkeypatch, layout, **kw)
    assert eng.model.fused_prefill == (path == "fused") and eng.model.flash_prefill == (path != "eager")
    last = lambda n: torch.tensor([[n - 1]], device=eng.device)  # noqa: E731
    none = lambda n: torch.empty(1, 0, dtype=torch.long, device=eng.device)  # noqa: E731
    (full1, full2), cache_full = chunks(eng, lambda n: None)
    (one1, one2), cache_one = chunks(eng, last)
    (both1, both2), cache_both = chunks(eng, last, all_rows=True)
    (skip1, skip2), cache_skip = chunks(eng, none)
    for cache in (cache_one, cache_both, cache_skip):
        assert all(torch.equal(a, b) for a, b in zip(cache, cache_full, strict=True))
    h = full2[0].shape[-1]
    assert full1[1] is None and full2[0].shape == (1, 20, h)
    # the row alone: returned as the hidden state, the whole forward's last row to rounding
    assert one2[0].shape == one2[1].shape == (1, 1, h) and torch.equal(one2[0], one2[1])
    tol = dict(atol=2e-3, rtol=2e-3) if DEVICE == "cpu" else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(one2[1], full2[0][:, -1:], **tol)
    torch.testing.assert_close(one1[1], full1[0][:, -1:], **tol)
    # every row too: the whole forward's rows, and the row read as without them (bit for bit)
    assert torch.equal(both2[0], full2[0]) and torch.equal(both1[0], full1[0])
    assert torch.equal(both2[1], one2[1]) and torch.equal(both1[1], one1[1])
    # no row read: no hidden state at all
    assert skip1[0].shape == skip1[1].shape == (1, 0, h)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_speculative_tokens_equal_plain_ones(monkeypatch, layout, kernels):
    """Token invariance with the last layer trimmed: greedy MTP (which reads every prompt row, so the whole layer runs
    beside the row) and DFlash2 (tapped layers only) decode plain decoding's tokens, bit for bit, on any device
    (16-token chunks, the eager and the fused path)."""
    def tokens(n, **kw):
        eng = load(monkeypatch, layout, kernels=kernels, prefill_chunk=16, **kw)
        return eng.generate(PROMPT, max_new_tokens=n, ignore_eos=True).tokens

    plain = tokens(12)
    for spec in ("mtp", "dflash2"):
        assert tokens(6, spec=spec, draft_tokens=3) == plain[:6], spec


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_engine_tokens_equal_the_whole_layers(monkeypatch, layout):
    """The fused and the eager path with the last layer trimmed decode the eager path's tokens with every row computed
    (``--last-rows off``), in fp32 (the two compute the prompt's last row with other roundings: in bf16 a random tiny
    model's flat logits could flip on them)."""
    def tokens(**kw):
        eng = load(monkeypatch, layout, dtype="fp32", prefill_chunk=16, **kw)
        return eng.generate(PROMPT, max_new_tokens=12, ignore_eos=True).tokens

    want = tokens(kernels="torch", last_rows=False)
    for kernels in ("torch", "triton"):
        assert tokens(kernels=kernels) == want, kernels


def test_last_rows_off_reads_every_row(monkeypatch):
    """``--last-rows off``: the prompt's chunks run whole (no Step.rows), with the same greedy tokens."""
    seen = []
    eng = load(monkeypatch, "attention-last", dtype="fp32", kernels="triton", prefill_chunk=16, last_rows=False)
    real = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda step, cache: seen.append(step.rows) or real(step, cache))
    tokens = eng.generate(PROMPT, max_new_tokens=8, ignore_eos=True).tokens
    want = load(monkeypatch, "attention-last", dtype="fp32", kernels="torch", prefill_chunk=16).generate(
        PROMPT, max_new_tokens=8, ignore_eos=True).tokens
    assert tokens == want and len(seen) >= 3 and seen[:3] == [None] * 3


def test_last_rows_changes_a_cpu_run_too():
    """Unlike the CUDA-only switches, ``--last-rows off`` is taken on a CPU (the eager forward trims too)."""
    from ninfer_bench.engine.runtime.options import SWITCHES, refuse_cuda_switches

    assert SWITCHES["last_rows"].cpu and not SWITCHES["cudnn_prefill"].cpu
    refuse_cuda_switches("cpu", {"last_rows": (True, False)})
    with pytest.raises(ValueError, match="--cudnn-prefill off: this switch changes only a run on CUDA"):
        refuse_cuda_switches("cpu", {"cudnn_prefill": (False,), "last_rows": (False,)})
