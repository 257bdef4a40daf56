"""The v3 decode/verify path through the fused Triton kernels equals the eager torch path.

On CUDA the kernels run natively; without CUDA they run in Triton's interpreter on CPU tensors, so the engine
integration (engine/model/fused_forward.py, rollback through the kernels) is checked on every machine.
"""

from __future__ import annotations

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, fixes the interpreter)
from ninfer_bench.engine.model.fused_forward import available
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not available(), reason="triton does not import")

# 36 tokens: every fused prefill kernel's grid grows with the prompt (interpreted: seconds a run), and 36 still makes
# three 16-token chunks (the later ones reading the earlier ones' cache) in the chunked-prefill tests
PROMPT = list(range(3, 39))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run natively there, interpreted here


# speculative rounds are the slow part in the interpreter: those runs decode fewer tokens (several rounds still)
SPEC_TOKENS = 6


def run(n=12, **kw):
    eng = Engine.load("tiny", device=DEVICE, kv_dtype="int8", dtype="fp32", max_context=256, **kw)
    return eng, eng.generate(PROMPT, max_new_tokens=n, ignore_eos=True).tokens


@pytest.fixture(scope="module")
def eager():
    return run(kernels="torch")[1]


def test_fused_decode_equals_eager(eager):
    eng, tokens = run(kernels="triton")
    assert eng.model.fast is not None
    assert tokens == eager


@pytest.mark.parametrize("spec,rollback", [("mtp", "recompute"), ("dflash2", "snapshot"), ("dflash", "recompute")])
def test_fused_verify_and_rollback_equal_eager(eager, spec, rollback):
    _, tokens = run(SPEC_TOKENS, kernels="triton", spec=spec, draft_tokens=3, rollback=rollback)
    assert tokens == eager[:SPEC_TOKENS]


@pytest.mark.parametrize("spec", ["none", "dflash2"])
def test_interleaved_gate_up_decodes_like_eager(eager, spec):
    """silu_epilogue: the MLP's gate / up weight interleaved in runs of 8 rows (qmv's fused epilogue on CUDA, the
    de-interleaved product here) decodes the eager path's tokens, plainly and through DFlash2 verification."""
    n = 12 if spec == "none" else SPEC_TOKENS
    eng, tokens = run(n, kernels="triton", silu_epilogue=True, spec=spec, draft_tokens=3 if spec != "none" else None)
    assert any(name.endswith("mlp.gate_up_proj.weight") for name in eng.weights.interleaved)
    assert tokens == eager[:n]


def test_flash_prefill_chunks_equal_eager(eager, monkeypatch):
    """Prompt chunks' full attention through kernels/attention_prefill (three chunks: the later ones read the earlier
    ones' int8 K/V, dequantized from the cache) decodes the eager path's tokens; --flash-prefill off launches none."""
    from ninfer_bench.engine.model import fused_forward

    calls = []
    real = fused_forward.prefill_attention_cached
    monkeypatch.setattr(fused_forward, "prefill_attention_cached",
                        lambda *a, **k: calls.append((*a[6][0, [0, -1]].tolist(), k["kv_len"])) or real(*a, **k))
    eng, tokens = run(kernels="triton", prefill_chunk=16, prefill_graphs=False)  # eager: the wrapper reads q_pos
    assert tokens == eager
    # generating reads the final hidden state of the prompt's last token alone (Step.rows), and the tiny model's one
    # full-attention layer is its last: that layer's queries run for that row only (decode_attention), so no chunk
    # takes the prefill kernel there
    assert calls == []
    eng.logits(PROMPT)  # every position's logits: every chunk's queries through the kernel
    # each chunk's first and last position, and the keys it reads (through its last position)
    assert {(0, 15, 16), (16, 31, 32), (32, 35, 36)} <= set(calls), calls
    calls.clear()
    _, tokens = run(kernels="triton", prefill_chunk=16, prefill_graphs=False, flash_prefill=False)
    assert tokens == eager and not calls


def test_fused_prefill_equals_eager(eager):
    """--fused-prefill: prompt chunks' GDN glue (kernels/gdn_prefill) and the norms between layers through the Triton
    kernels (on by default), over several chunks (each later chunk's conv reads the state the one before left),
    decode the eager path's tokens, as with it off; a runtime without the fused kernels does not take it."""
    eng, tokens = run(kernels="triton", prefill_chunk=16, prefill_graphs=False, fused_prefill=True)
    assert eng.model.fused_prefill and tokens == eager
    eng, tokens = run(kernels="triton", prefill_chunk=16, prefill_graphs=False, fused_prefill=False)
    assert not eng.model.fused_prefill and tokens == eager
    assert not Engine.load("tiny", device="cpu", runtime="v2").model.fused_prefill  # on by default, inert off v3


def test_layer_prefill_equals_chunk_prefill(eager, monkeypatch):
    """--layer-prefill: a prompt's three chunks all through one layer before the next (taken where packed weights are
    dequantized for prefill; forced here, where the weights are dense) decode the eager path's tokens and prime a
    DFlash2 drafter from each chunk's taps as the chunk-by-chunk prefill does (its rounds then decode the same
    tokens), reporting the layers' progress; off, with dense copies kept, or for one chunk, the chunks run one by
    one."""
    from ninfer_bench.engine.model.fused_forward import FastPath
    from ninfer_bench.engine.model.weights import WeightStore

    n, extra = SPEC_TOKENS, dict(spec="dflash2", draft_tokens=3)
    calls = []
    real = FastPath.forward_layers
    monkeypatch.setattr(FastPath, "forward_layers", lambda self, steps, *a, **k: calls.append(
        [int(st.pos[0, 0]) for st in steps]) or real(self, steps, *a, **k))
    eng = Engine.load("tiny", device=DEVICE, kv_dtype="int8", dtype="fp32", max_context=256, kernels="triton",
                      prefill_chunk=16, prefill_graphs=False, **extra)
    seen = []
    assert not eng.weights.dequantizes_prefill  # dense weights here: not taken ...
    chunked = eng.generate(PROMPT, max_new_tokens=n, ignore_eos=True)
    assert chunked.tokens == eager[:n] and not calls
    monkeypatch.setattr(WeightStore, "dequantizes_prefill", property(lambda self: True))  # ... unless forced
    got = eng.generate(PROMPT, max_new_tokens=n, ignore_eos=True, on_prefill=lambda d, t: seen.append((d, t)))
    assert got.tokens == eager[:n]
    counts = lambda r: {k: v for k, v in r.spec.items() if not k.endswith("_ms")}  # noqa: E731
    assert counts(got) == counts(chunked) and counts(got)["rounds"]  # the drafter primed alike: the same drafts
    assert calls == [[0, 16, 32]]  # one layer-major pass over the three chunks
    assert seen[-1] == (36, 36) and len(seen) == eng.config.num_hidden_layers  # a report a layer, then the end
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[0][0] < 36
    calls.clear()
    off = Engine.load("tiny", device=DEVICE, kv_dtype="int8", dtype="fp32", max_context=256, kernels="triton",
                      prefill_chunk=16, prefill_graphs=False, layer_prefill=False, **extra)
    assert off.generate(PROMPT, max_new_tokens=n, ignore_eos=True).tokens == eager[:n] and not calls
    short = eng.generate(PROMPT[:16], max_new_tokens=2, ignore_eos=True)  # one chunk: nothing to gain
    assert not calls and len(short.tokens) == 2


def test_dense_scope_keeps_a_layers_copies_for_its_calls():
    """WeightStore.dense_scope: inside, the named layer's projections that dequantize every call keep their copy
    (made once for all the chunks); on exit they drop it and dequantize every call again; others are untouched."""
    from types import SimpleNamespace

    from ninfer_bench.engine.model.weights import WeightStore

    store = WeightStore.__new__(WeightStore)
    lins = {name: SimpleNamespace(dense_fallback=False, _dense={}) for name in
            ("model.layers.1.mlp.down_proj.weight", "model.layers.10.mlp.down_proj.weight")}
    lins["model.layers.1.kept.weight"] = SimpleNamespace(dense_fallback=True, _dense={"bf16": "copy"})
    lins["model.layers.1.dense.weight"] = object()  # a dense projection: no flag
    store.linears = lins
    assert store.dequantizes_prefill
    with store.dense_scope("model.layers.1."):
        assert lins["model.layers.1.mlp.down_proj.weight"].dense_fallback
        assert not lins["model.layers.10.mlp.down_proj.weight"].dense_fallback  # layer 10 is not layer 1
        lins["model.layers.1.mlp.down_proj.weight"]._dense["bf16"] = "made inside"
    assert not lins["model.layers.1.mlp.down_proj.weight"].dense_fallback
    assert lins["model.layers.1.mlp.down_proj.weight"]._dense == {}  # dropped
    assert lins["model.layers.1.kept.weight"]._dense == {"bf16": "copy"}  # a kept copy stays
    for lin in lins.values():
        if hasattr(lin, "dense_fallback"):
            lin.dense_fallback = True
    assert not store.dequantizes_prefill


def test_drafter_fused_glue_equals_eager(eager, monkeypatch):
    """A block drafter's norms and q / k norm + rotation through kernels/fused.py (dflash.fused_glue: inference on a
    GPU; forced here, the kernels interpreted): the block's hidden states and head logits match the eager glue's,
    and DFlash2 with it decodes the eager path's tokens."""
    from ninfer_bench.engine.model import dflash

    eng = Engine.load("tiny", device=DEVICE, kv_dtype="int8", dtype="fp32", max_context=256, kernels="triton",
                      spec="dflash2", draft_tokens=3)
    d = eng.drafter
    d.net.reserve_rope(eng.capacity + d.cfg.block_size + 1, DEVICE)  # the fused rotation reads the reserved tables
    seq = eng.acquire(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.start(seq)
    ins = [eng.device_ids([v]) for v in (seq.last, seq.length, seq.slot)]
    with torch.inference_mode():
        h0, l0 = d.block(*ins, 3)
        calls = []
        monkeypatch.setattr(dflash, "fused_glue", lambda x: calls.append(1) or True)
        h1, l1 = d.block(*ins, 3)
    eng.release(seq)
    assert calls, "the fused glue did not run"
    for a, b in ((h1, h0), (l1, l0)):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    tokens = eng.generate(PROMPT, max_new_tokens=SPEC_TOKENS, ignore_eos=True).tokens
    assert tokens == eager[:SPEC_TOKENS]


@pytest.mark.parametrize("spec", ["dflash2", "dflash"])
def test_drafter_attention_in_place_equals_gathered(spec):
    """BlockDraftRunner.in_place (kernels/draft_attention.py: each layer's context read from the drafter's cache where
    it lies, the mask from the rows' positions; on by default on CUDA, forced here with the kernels interpreted): the
    block's hidden states and head logits match the gathered torch path's after a prompt longer than the tiny
    DFlash2 window (its ring wrapped), and greedy decoding with it keeps plain decoding's tokens."""
    prompt = list(range(3, 103))  # 100 tokens: past the tiny DFlash2 drafter's 64-position window
    # the target through torch (its fused kernels are other tests' subject, and slow to interpret)
    eng = Engine.load("tiny", device=DEVICE, kv_dtype="int8", dtype="fp32", max_context=256, kernels="torch",
                      spec=spec, draft_tokens=3)
    d = eng.drafter
    assert d.in_place == (DEVICE == "cuda")
    assert (d.window > 0) == (spec == "dflash2") and d.window < len(prompt)
    seq = eng.acquire(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.start(seq)
    ins = [eng.device_ids([v]) for v in (seq.last, seq.length, seq.slot)]
    with torch.inference_mode():
        d.in_place = False
        h0, l0 = d.block(*ins, 3)
        d.in_place = True
        h1, l1 = d.block(*ins, 3)
    eng.release(seq)
    for a, b in ((h1, h0), (l1, l0)):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    tokens = eng.generate(prompt, max_new_tokens=SPEC_TOKENS, ignore_eos=True).tokens
    plain = Engine.load("tiny", device=DEVICE, kv_dtype="int8", dtype="fp32", max_context=256, kernels="torch")
    assert tokens == plain.generate(prompt, max_new_tokens=SPEC_TOKENS, ignore_eos=True).tokens


def test_drafter_fused_projections_equal_the_members(monkeypatch):
    """drafters.fused_projections (q | k | v and gate | up as one packed linear each, where the engine keeps weights
    packed: a stand-in store here) and the fused silu * up give a DFlash2 block the values of the member
    projections, with the fused glue on (forced, the kernels interpreted)."""
    import types

    from ninfer_bench.engine.model import dflash
    from ninfer_bench.engine.model.weights import DenseLinear
    from ninfer_bench.engine.spec.drafters import fused_projections

    eng = Engine.load("tiny", device="cpu", spec="dflash2", draft_tokens=3)  # the drafter's weights and config
    cfg, raws = eng.loaded.drafters["dflash2"]
    net = dflash.BlockDrafter.from_raws(cfg, raws, eng.config.hidden_size, eng.config.vocab_size).to(DEVICE).eval()
    net.reserve_rope(512, DEVICE)
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(1, 20, len(cfg.target_layer_ids) * eng.config.hidden_size, generator=g).to(DEVICE)
    x = torch.randn(1, 4, eng.config.hidden_size, generator=g).to(DEVICE)
    monkeypatch.setattr(dflash, "fused_glue", lambda t: True)
    with torch.inference_mode():
        ks, vs = net.context_kv(net.context(taps), torch.arange(20, device=DEVICE)[None])
        pos = torch.arange(20, 24, device=DEVICE)[None]
        mask = torch.ones(1, 1, 4, 24, dtype=torch.bool, device=DEVICE)
        want = net.blocks(x, pos, ks, vs, mask)
        store = types.SimpleNamespace(packed=True,
                                      linear_of=lambda raw: DenseLinear(raw.dense(torch.float32, DEVICE)))
        assert fused_projections(net, raws, store) == 2 * len(net.layers)
        got = net.blocks(x, pos, ks, vs, mask)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("spec", ["none", pytest.param("dflash2", marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="interpreted, minutes; the eager path's packed drafting: tests/test_concurrency.py"))])
def test_packed_prefill_equals_each_alone(spec, monkeypatch):
    """Three admissions prefilled in one forward through the fused prefill path (EngineOptions.pack_prefill: rows
    padded to the longest, the padding inert in the GDN state and the int8 cache's later positions), the third
    prompt split by the iteration's budget: each request decodes its tokens alone (and the padded forward ran)."""
    from ninfer_bench.engine.model.hybrid import PREFILL
    from ninfer_bench.engine.runtime.scheduler import Scheduler

    eng = Engine.load("tiny", device=DEVICE, kv_dtype="int8", dtype="fp32", max_context=256, kernels="triton",
                      spec=spec, draft_tokens=3 if spec != "none" else None, max_concurrency=3, prefill_chunk=32,
                      pack_prefill=True)
    prompts = [PROMPT[:20], PROMPT[5:14], list(range(7, 37))]
    params = SamplingParams(max_new_tokens=SPEC_TOKENS, ignore_eos=True)
    alone = [eng.generate(p, max_new_tokens=SPEC_TOKENS, ignore_eos=True).tokens for p in prompts]
    shapes, real = [], eng.model.forward
    monkeypatch.setattr(eng.model, "forward",
                        lambda step, cache: (shapes.append(tuple(step.ids.shape)) if step.mode == PREFILL else None)
                        or real(step, cache))
    sched = Scheduler(eng)
    reqs = [sched.submit(p, params) for p in prompts]
    sched.run_until_idle()
    assert shapes[0] == (3, 20)  # 20 + 9 + 3 of the third's 30 tokens (the budget: 32), then the rest
    assert [r.tokens for r in reqs] == alone
