"""The kernels suite on a CPU: the CLI writes a result document covering every registered op family with every
check passing; a broken implementation is reported and the command exits 1; bytes of a packed projection."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ninfer_bench.cli import main
from ninfer_bench.kernels import quant
from ninfer_bench.engine.model.config import preset
from ninfer_bench.engine.artifact.convert import weight_format
from ninfer_bench.reports.schema import read_result
from ninfer_bench.suites import kernel_cases as kc
from ninfer_bench.suites.kernel_registry import entries
from ninfer_bench.suites import kernels as ks
from ninfer_bench.suites.kernel_projections import projection_bytes


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def one(doc, **match):
    found = [r for r in doc["records"] if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, len(found))
    return found[0]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels") / "kernels.json"
    code, text = run("kernels", "--shape", "tiny", "--t", "1,8", "--repeats", "3", "--device", "cpu", "--json", out)
    assert code == 0, text
    return read_result(out), text


def test_cli_measures_every_family_and_every_check_passes(cpu_run):
    doc, text = cpu_run
    recs = doc["records"]
    registered = entries()
    families = {e.family for e in registered}
    assert {"projection", "attention", "gdn", "conv", "norm", "sampling"} <= families
    assert {r["family"] for r in recs} == families
    assert {r["op"] for r in recs} == {e.op for e in registered}
    assert [ks.failure_text(r) for r in recs if not r["ok"]] == []
    for r in recs:
        assert len(r["samples_us"]) == 3 and r["us_p10"] <= r["us_median"] <= r["us_p90"]
        assert r["bytes"] > 0 and r["gbps"] > 0 and r["roofline_fraction"] > 0
        assert 0 <= r["max_rel_err"] <= r["tolerance"]
    # every (op, shape, t) has both variants; v3 on a CPU says what it fell back to
    keys = {(r["op"], tuple(r["shape"]), r["t"]) for r in recs}
    assert len(recs) == 2 * len(keys)
    assert {r["timing"] for r in recs} == {"eager"}
    assert "CPU" in one(doc, op="mlp.down", t=1, variant="v3")["note"]
    assert "CPU" in one(doc, op="attn.decode_int8", t=8, context=4096, variant="v3")["note"]
    assert sorted({r["context"] for r in recs if r["family"] == "attention"}) == [1024, 4096]
    s = doc["summary"]
    assert s["timer"] == "torch-cpu" and s["device"] == "cpu" and s["failures"] == []
    assert s["ops"] == len(registered) and s["copy_bandwidth_gbps"] > 0
    assert doc["config"]["shape"] == "tiny" and doc["config"]["ts"] == [1, 8] and doc["config"]["repeats"] == 3
    assert "not GPU numbers" in text and "copy bandwidth" in text


def test_q4_projection_bytes_are_the_packed_weight_plus_activations(cpu_run):
    doc, _ = cpu_run
    cfg = preset("tiny")
    n, k = cfg.hidden_size, cfg.intermediate_size  # mlp.down: [hidden, intermediate]
    assert weight_format("model.layers.0.mlp.down_proj.weight", (n, k), "mixed") == "q4_g64_fp16"
    for t in (1, 8):
        for variant in ("v2", "v3"):
            rec = one(doc, op="mlp.down", t=t, variant=variant)
            assert rec["fmt"] == "q4_g64_fp16" and rec["shape"] == [n, k]
            assert rec["bytes"] == quant.nbytes("q4_g64_fp16", (n, k)) + t * k * 4 + t * n * 4  # fp32 on a CPU
    # K = 96 is not a multiple of the group: the padded packing counts
    assert projection_bytes("q4_g64_fp16", 160, 96, 8, 2) == 160 * 128 // 2 + 160 * 2 * 2 + 8 * 96 * 2 + 8 * 160 * 2
    assert one(doc, op="lm_head", t=1, variant="v3")["fmt"] == "q8_g32_fp16"
    assert one(doc, op="gdn.b", t=1, variant="v3")["fmt"] == "bf16"


def test_broken_implementation_fails_its_check_and_exits_1(tmp_path, monkeypatch):
    entries()  # the declarations are registered before the registry is copied
    monkeypatch.setattr(kc, "REGISTRY", dict(kc.REGISTRY))

    @kc.register(op="test.scaled_ref", family="test", tolerance=(1e-3, 1e-3))
    def _scaled(ctx, t, _param):
        x = ctx.randn(t, 64, gen=ctx.generator("test", t))
        return kc.Case([t, 64], 2 * x.numel() * ctx.elt, lambda: x.float() * 2,
                       {"v2": kc.Impl(lambda: x * 2, "exact"), "v3": kc.Impl(lambda: x * 2 * 1.1, "scaled by 1.1")})

    @kc.register(op="test.raises", family="test")
    def _raises(ctx, t, _param):
        def boom():
            raise RuntimeError("kernel launch failed")

        return kc.Case([t], 8, lambda: torch.ones(t), {"v2": kc.Impl(lambda: torch.ones(t)), "v3": kc.Impl(boom)})

    @kc.register(op="test.build_fails", family="test")
    def _build_fails(ctx, t, _param):
        raise MemoryError("no room for the weights")

    out = tmp_path / "broken.json"
    code, text = run("kernels", "--device", "cpu", "--ops", "test.", "--t", "1", "--repeats", "2", "--json", out)
    assert code == 1, text
    assert "4 of 6 kernel checks failed" in text and "test.scaled_ref" in text and "kernel launch failed" in text
    doc = read_result(out)  # written before the exit
    scaled = {r["variant"]: r for r in doc["records"] if r["op"] == "test.scaled_ref"}
    assert scaled["v2"]["ok"] and not scaled["v3"]["ok"]
    assert scaled["v3"]["max_rel_err"] == pytest.approx(0.1, rel=1e-3)
    raised = one(doc, op="test.raises", variant="v3")
    assert not raised["ok"] and raised["us_median"] is None and "RuntimeError" in raised["note"]
    built = [r for r in doc["records"] if r["op"] == "test.build_fails"]
    assert len(built) == 2 and not any(r["ok"] for r in built) and "MemoryError" in built[0]["note"]
    assert len(doc["summary"]["failures"]) == 4


def test_max_rel_err_is_the_largest_relative_rms():
    ref = (torch.ones(4), torch.full((2,), 2.0))
    assert kc.max_rel_err((torch.ones(4), torch.full((2,), 2.2)), ref) == pytest.approx(0.1)
    assert math.isnan(kc.max_rel_err(torch.tensor([1.0, float("nan")]), torch.ones(2)))
    with pytest.raises(ValueError, match="shape"):
        kc.max_rel_err(torch.ones(3), torch.ones(4))


def test_model_artifact_gives_the_shapes(tiny_artifact, tmp_path):
    out = tmp_path / "model.json"
    code, text = run("kernels", "--model", tiny_artifact, "--ops", "norm.rms", "--t", "2", "--repeats", "2",
                     "--device", "cpu", "--json", out)
    assert code == 0, text
    doc = read_result(out)
    hidden = doc["records"][0]["shape"][1]
    from ninfer_bench.engine.artifact.reader import Artifact

    with Artifact.open(tiny_artifact) as art:
        assert hidden == art.components["text"]["config"]["hidden_size"]
    assert doc["model"]["artifact_id"] and doc["config"]["model"] == str(tiny_artifact)


BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ninfer-code-small.ninfer"


def test_an_artifacts_projections_are_timed_in_its_stored_formats():
    """The bundled artifact stores its projections as q8: they are timed as q8 (not the mixed policy's q5 / q4 / bf16),
    under a label naming the artifact; a --quant given overrides that and the label and config say so."""
    opts = dict(model=str(BUNDLED), ops=("attn.o", "gdn.b", "lm_head"), ts=(1,), repeats=2, warmup=0, device="cpu")
    doc = ks.run_kernels(ks.KernelOptions(**opts))
    assert {(r["op"], r["fmt"]) for r in doc["records"]} == {
        ("attn.o", "q8_g32_fp16"), ("gdn.b", "q8_g32_fp16"), ("gdn.ba", "q8_g32_fp16"), ("lm_head", "q8_g32_fp16")}
    assert all(r["ok"] for r in doc["records"])
    assert doc["label"] == "kernels-ninfer-code-small-cpu" and doc["config"]["quant"] is None
    assert doc["config"]["weight_formats"] == "artifact" and doc["model"]["quant_policy"] == "q8"
    n, k = one(doc, op="attn.o", variant="v2")["shape"]
    assert one(doc, op="attn.o", variant="v2")["bytes"] == projection_bytes("q8_g32_fp16", n, k, 1, 4)
    fp32 = ks.run_kernels(ks.KernelOptions(**{**opts, "ops": ("attn.o",)}, quant="fp32"))
    assert {r["fmt"] for r in fp32["records"]} == {"fp32"}
    assert fp32["label"] == "kernels-ninfer-code-small-fp32-cpu"
    assert fp32["config"]["quant"] == "fp32" and fp32["config"]["weight_formats"] == "quant policy"


def test_a_preset_keeps_the_mixed_policy_by_default():
    doc = ks.run_kernels(ks.KernelOptions(shape="tiny", ops=("attn.o", "mlp.down"), ts=(1,), repeats=2, warmup=0,
                                          device="cpu"))
    assert {(r["op"], r["fmt"]) for r in doc["records"]} == {("attn.o", "q5_g64_fp16"), ("mlp.down", "q4_g64_fp16")}
    assert doc["label"] == "kernels-tiny-cpu" and doc["config"]["quant"] == "mixed"


def test_stored_formats_drop_the_layer_and_follow_aliases():
    from ninfer_bench.engine.artifact.reader import Artifact

    with Artifact.open(BUNDLED) as art:
        formats = ks.stored_formats(art)
    assert formats["self_attn.o_proj.weight"] == formats["lm_head.weight"] == "q8_g32_fp16"
    assert formats["input_layernorm.weight"] == "fp32"
    ctx = kc.KernelContext(preset("tiny"), torch.device("cpu"), torch.float32, formats={"mlp.down_proj.weight": "q8"})
    assert ctx.weight_format("model.layers.0.mlp.down_proj.weight", (4, 4)) == "q8"
    with pytest.raises(ValueError, match="stores no mlp.up_proj.weight"):
        ctx.weight_format("model.layers.0.mlp.up_proj.weight", (4, 4))


@pytest.mark.parametrize("args,message", [
    (("--shape", "tiny", "--model", "x.ninfer"), "not both"),
    (("--ops", "no-such-op"), "no registered op matches"),
    (("--kernels", "v4"), "--kernels"),
    (("--t", "1,x"), "--t must be"),
])
def test_bad_requests_are_one_line_errors(args, message):
    code, text = run("kernels", "--device", "cpu", *args)
    assert code == 1 and message in text, text


def test_l2_flushers_read_or_zero_the_buffer_and_refuse_other_modes():
    """The read flush leaves its buffer as it was (clean lines: nothing for the timed op to write back); the write
    flush zeroes it; the options refuse any other mode."""
    from ninfer_bench.suites.kernels import L2_FLUSHES, KernelOptions, l2_flusher

    buf = torch.arange(1, 4097, dtype=torch.float32)
    before = buf.clone()
    read = l2_flusher(buf, "read")
    read()
    assert torch.equal(buf, before)
    l2_flusher(buf, "write")()
    assert not buf.any()
    with pytest.raises(ValueError, match="l2 flush"):
        l2_flusher(buf, "evict")
    with pytest.raises(ValueError, match="--l2-flush"):
        KernelOptions(l2_flush="evict")
    assert set(L2_FLUSHES) == {"read", "write"} and len(set(L2_FLUSHES.values())) == 2


def test_chain_launches_spread_the_graph_launch_and_refuse_odd_counts():
    """Auto: copies enough to hold CHAIN_BYTES, at most MAX_CHAIN, none for a weight that large alone; a count given
    is taken as it is; one launch is no chain."""
    from ninfer_bench.suites.kernels import CHAIN_BYTES, MAX_CHAIN, KernelOptions, chain_launches

    assert chain_launches(95_000_000, None) == -(-CHAIN_BYTES // 95_000_000) == 6  # 27B mlp.gate_up q4
    assert chain_launches(6_900_000, None) == MAX_CHAIN  # 27B attention k + v: 78 wanted
    assert chain_launches(CHAIN_BYTES // 2, None) == 2
    assert chain_launches(CHAIN_BYTES, None) == 0 and chain_launches(1_350_000_000, None) == 0  # the lm_head
    assert chain_launches(6_900_000, 0) == 0 and chain_launches(6_900_000, 5) == 5
    for bad in (-1, 1, MAX_CHAIN + 1):
        with pytest.raises(ValueError, match="--chain"):
            KernelOptions(chain=bad)


def test_cpu_records_have_no_chain_and_a_bad_chain_is_one_line():
    """A chain is a CUDA measurement (v3's graph): a CPU run's records carry none; --chain takes auto, off or a
    count."""
    from ninfer_bench.suites.kernels import KernelOptions, run_kernels

    doc = run_kernels(KernelOptions(shape="tiny", device="cpu", ops=("mlp.down",), ts=(1,), repeats=1, warmup=0))
    assert doc["records"] and not any("chain_us" in r for r in doc["records"])
    code, text = run("kernels", "--device", "cpu", "--chain", "many")
    assert code == 1 and "--chain must be auto, off or a number" in text, text
    code, text = run("kernels", "--device", "cpu", "--chain", "1")
    assert code == 1 and "--chain must be auto, 0 (off) or 2.." in text, text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_run_times_v3_as_graph_replays(tmp_path):
    out = tmp_path / "cuda.json"
    code, text = run("kernels", "--device", "cuda", "--shape", "tiny", "--t", "1,7", "--repeats", "5",
                     "--ops", "attn.,mlp.down,mlp.gate_up_silu,lm_head,gdn.step,norm.rms", "--json", out)
    assert code == 0, text
    doc = read_result(out)
    assert doc["summary"]["timer"] == "cuda-events-clean-l2" and doc["summary"]["failures"] == []
    assert doc["config"]["l2_flush"] == "read"
    assert {r["timing"] for r in doc["records"] if r["variant"] == "v2"} == {"eager"}
    assert {r["timing"] for r in doc["records"] if r["variant"] == "v3"} == {"cuda-graph"}
    from ninfer_bench.kernels import qmv_cuda

    qmv = qmv_cuda.available()  # with CuPy the projections of up to 8 rows go through qmv, else through Triton
    assert ("tensor-core qmv" if qmv else "Triton qlinear") in one(doc, op="mlp.down", t=7, variant="v3")["note"]
    silu = one(doc, op="mlp.gate_up_silu", t=1, variant="v3")
    assert silu["ok"] and ("qmv storing silu(gate) * up" in silu["note"]) == qmv
    if qmv:  # each qmv projection also as a chain of launches over weight copies (the tiny shape's: MAX_CHAIN)
        from ninfer_bench.suites.kernels import MAX_CHAIN

        for rec in (one(doc, op="mlp.down", t=7, variant="v3"), silu):
            assert rec["chain_launches"] == MAX_CHAIN and rec["chain_us"] > 0 and rec["chain_fraction"] > 0, rec
        assert not any("chain_us" in r for r in doc["records"] if r["variant"] == "v2")


def test_timeline_profiles_the_engines_own_decode_step(tmp_path):
    """--timeline: the engine's plain decode step on the suite's model, profiled (a CPU: torch ops by self time),
    a row per op with its share of the step's wall time, in the result and in a table."""
    out = tmp_path / "timeline.json"
    code, text = run("kernels", "--shape", "tiny", "--t", "1", "--repeats", "2", "--device", "cpu", "--ops", "attn.o",
                     "--timeline", "--timeline-steps", "6", "--json", out)
    assert code == 0, text
    tl = read_result(out)["summary"]["timeline"]
    assert tl["device"] == "cpu" and tl["steps"] == 6 and tl["source"].startswith("torch ops")
    assert tl["step_wall_us"] > 0 and 0 < tl["busy_us"] and tl["weights"] == "synthetic mixed"
    rows = tl["kernels"]
    assert rows and all(r["us_per_step"] > 0 and r["calls_per_step"] > 0 for r in rows)
    assert [r["us_per_step"] for r in rows] == sorted((r["us_per_step"] for r in rows), reverse=True)
    assert all(r["own_us_per_step"] == r["us_per_step"] for r in rows)  # CPU self times do not overlap
    assert any(r["name"].startswith("aten::") for r in rows)
    assert all(r["share_of_step"] == pytest.approx(r["us_per_step"] / tl["step_wall_us"]) for r in rows)
    assert "decode step timeline" in text and rows[0]["name"][:20] in text
    # without the flag no engine is built and the summary says so
    code, _ = run("kernels", "--shape", "tiny", "--t", "1", "--repeats", "2", "--device", "cpu", "--ops", "attn.o",
                  "--json", tmp_path / "plain.json")
    assert code == 0 and read_result(tmp_path / "plain.json")["summary"]["timeline"] is None


def test_timeline_helpers():
    from ninfer_bench.engine.runtime.engine import Engine
    from ninfer_bench.suites.step_timeline import busy_us, decode_timeline, idle_gaps, own_times

    assert busy_us([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    # programmatic dependent launch: b starts inside a and waits for it; c inside b; d alone, e nested in d
    spans = [(0, 10, "a"), (8, 14, "b"), (13, 15, "c"), (20, 30, "d"), (22, 25, "e"), (40, 41, "a")]
    own = own_times(spans)
    assert own == {"a": 11, "b": 4, "c": 1, "d": 10, "e": 0}
    assert sum(own.values()) == busy_us([(s, e) for s, e, _ in spans])
    assert busy_us([]) == 0
    # idle stretches: between d's end (30; e ends inside it) and a (40), b / c overlap (none), c -> d (15 -> 20)
    gaps = idle_gaps(spans, 5)
    assert [(g["us"], g["at_us"], g["after"], g["before"]) for g in gaps] == [(10, 30, "d", "a"), (5, 15, "c", "d")]
    # with the run's bounds: the lead before the first kernel and the tail after the last, measured from begin
    gaps = idle_gaps(spans, 2, begin=-3, end=47)
    assert [(g["us"], g["at_us"], g["after"], g["before"]) for g in gaps] == [(10, 33, "d", "a"),
                                                                            (6, 44, "a", "(end)")]
    assert [g["before"] for g in idle_gaps(spans, 9, begin=-3)][-1] == "a" and len(idle_gaps(spans, 9, -3)) == 3
    assert sum(g["us"] for g in idle_gaps(spans, 9, begin=-3, end=47)) == 50 - busy_us([(s, e) for s, e, _ in spans])
    assert idle_gaps([], 3) == []
    eng = Engine.load("tiny", device="cpu", spec="mtp", draft_tokens=2)
    with pytest.raises(ValueError, match="without a drafter"):
        decode_timeline(eng)
    with pytest.raises(ValueError, match="--timeline-steps"):
        ks.KernelOptions(timeline=True, timeline_steps=0)
