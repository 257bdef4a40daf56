"""Tensor parallelism (engine/model/tensor_parallel.py, engine/runtime/parallel.py) on CPUs: each rank's weight
slices put back together are the model's weights; a model whose heads a size does not divide is refused by name; two
gloo ranks give one rank's greedy tokens and its logits to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

import triton_interp  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA: the fused kernels' test)
from ninfer_bench.engine.artifact.loader import load_source
from ninfer_bench.engine.model import tensor_parallel as tpm
from ninfer_bench.engine.model.config import preset
from ninfer_bench.engine.model.weights import RawWeight
from ninfer_bench.kernels import quant
from tp_ranks import _die_on_one, _fail_on_one, _fused_run, _mirrored_scheduler, _rank_run, _spec_run


def _dense(raw):
    return raw.dense(torch.float32)


@pytest.mark.parametrize("fmt", quant.QUANT_FORMATS + ("fp32", "bf16"))
@pytest.mark.parametrize("k,k0,k1", [(256, 64, 192), (256, 128, 256), (160, 64, 160), (160, 80, 160), (96, 32, 64)])
def test_column_slices_are_the_weights_columns(fmt, k, k0, k1):
    """A column slice on group boundaries keeps the packed bytes (the same values); off them it is the dequantized
    columns in fp32."""
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(k0))
    buf = quant.pack(w, fmt) if fmt in quant.QUANT_FORMATS else w.to(quant_dtype(fmt)).view(torch.uint8).reshape(-1)
    raw = RawWeight(fmt, (24, k), buf)
    part = tpm.take_cols(raw, k0, k1)
    assert part.shape == (24, k1 - k0)
    assert torch.equal(_dense(part), _dense(raw)[:, k0:k1])
    group = quant.QSPEC[fmt][0] if fmt in quant.QUANT_FORMATS else 1
    assert part.fmt == (fmt if k0 % group == 0 and (k1 % group == 0 or k1 == k) else "fp32")


def quant_dtype(fmt):
    return torch.float32 if fmt == "fp32" else torch.bfloat16


def test_rank_slices_put_together_are_the_model():
    """Every split weight of the tiny preset: the ranks' rows (column-parallel, by head and section) or columns
    (row-parallel) in rank order give the whole weight back; whole weights are left as they are."""
    loaded = load_source("tiny")
    cfg, raws = loaded.config, {n: r for n, r in loaded.raws.items() if not n.startswith("mtp.")}
    parts = [tpm.shard_raws(raws, cfg, r, 2) for r in range(2)]
    local = tpm.local_config(cfg, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.linear_num_key_heads,
            local.linear_num_value_heads, local.intermediate_size) == (2, 1, 1, 2, 80)
    kd, vd = cfg.key_dim, cfg.value_dim
    for name, raw in raws.items():
        whole = _dense(raw)
        got = [_dense(p[name]) for p in parts]
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(got, dim=1), whole), name
        elif name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            # a rank's rows: its half of q, then of k, then of v
            at = [(0, kd // 2), (kd // 2, kd), (kd, kd + vd // 2)]
            back = torch.cat([torch.cat([g[a:b] for g in got]) for a, b in at])
            assert torch.equal(back, whole), name
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "in_proj_z.weight", "in_proj_b.weight",
                            "in_proj_a.weight", "gate_proj.weight", "up_proj.weight", "A_log", "dt_bias")) \
                or name in ("lm_head.weight", "model.embed_tokens.weight"):
            assert torch.equal(torch.cat(got), whole), name
            assert got[0].shape[0] * 2 == whole.shape[0]
        else:
            assert parts[0][name] is raw and parts[1][name] is raw, name


def test_sizes_that_do_not_divide_the_heads_are_refused():
    """The bundled model (one key / value head, one GDN key head, three value heads) cannot be split 2 ways; the
    message names each count; the tiny preset splits 2 ways, not 3."""
    from ninfer_bench.engine.model.config import ModelConfig

    bundled = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=64, linear_num_key_heads=1,
                          linear_num_value_heads=3, linear_key_head_dim=64, linear_value_head_dim=64)
    with pytest.raises(ValueError, match=r"key / value heads .*1.*GDN key heads .*1.*GDN value heads .*3") as e:
        tpm.check_divisible(bundled, 2)
    assert "attention heads (num_attention_heads)" not in str(e.value)  # 4 heads divide
    tpm.check_divisible(preset("tiny"), 2)
    with pytest.raises(ValueError, match="not a multiple of 3"):
        tpm.local_config(preset("tiny"), 3)


def test_engine_options_refuse_what_is_not_split_yet():
    from ninfer_bench.engine.runtime.options import EngineOptions

    with pytest.raises(ValueError, match="--lm-head-draft"):
        EngineOptions(tensor_parallel=2, spec="mtp", draft_tokens=3, lm_head_draft=64)
    with pytest.raises(ValueError, match="positive integer"):
        EngineOptions(tensor_parallel=0)
    with pytest.raises(ValueError, match="not initialised"):  # no process group in this process
        from ninfer_bench.engine.runtime.engine import Engine

        Engine.load("tiny", device="cpu", kv_dtype="fp32", tensor_parallel=2)




def test_two_gloo_ranks_give_one_ranks_tokens_and_logits():
    """--tensor-parallel 2 over gloo (two CPU processes): both ranks hold the whole logits (gathered) and pick the
    same tokens, which are one rank's greedy tokens; the logits are one rank's to fp32 rounding (the partial sums of
    the row-parallel projections are added in another order)."""
    from ninfer_bench.engine.runtime.parallel import launch

    one = _rank_run(0, 1)
    ranks = launch(2, _rank_run, 2, backend="gloo")
    assert [(r["heads"], r["head_rows"], r["embed_rows"]) for r in ranks] == [(2, 256, 256)] * 2  # each holds half
    #                                                                      (tiny: 4 heads, a 512-token vocabulary)
    for r in ranks:
        assert r["tokens"] == one["tokens"]
        assert r["logits"].shape == one["logits"].shape
        torch.testing.assert_close(r["logits"], one["logits"], rtol=1e-4, atol=1e-4)
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    # a rank keeps its share only (the whole model's weights leave the loaded model), and its step reads that much
    assert [r["shard"] for r in ranks] == [(0, 2), (1, 2)] and one["shard"] is None
    assert all(2 * r["loaded_qkv_rows"] == one["loaded_qkv_rows"] for r in ranks)
    # (tiny's row-parallel slices miss the q4 groups and are held dequantized: its step bytes do not halve)
    assert all(r["step_bytes"] < one["step_bytes"] for r in ranks)


def test_a_failing_rank_reports_its_error():
    from ninfer_bench.engine.runtime.parallel import launch

    with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: rank one breaks\n.*Traceback") as e:
        launch(2, _fail_on_one, backend="gloo")
    assert str(e.value).splitlines()[0] == "tensor parallel rank 1 failed: ValueError: rank one breaks"




def test_decode_command_splits_over_ranks(tmp_path):
    """``ninfer-bench decode --tensor-parallel 2``: two gloo ranks, rank 0's document, labelled ``-tp2`` and
    recording the size, with the tokens of the same decode on one rank; a size the model's heads do not divide is
    refused in one line, naming the counts."""
    import json

    from click.testing import CliRunner
    from ninfer_bench.cli import main

    runner = CliRunner()
    args = ["decode", "--model", "tiny", "-n", "12", "--repeats", "1", "--kv-dtype", "fp32", "--device", "cpu"]
    one, two = tmp_path / "tp1.json", tmp_path / "tp2.json"
    r1 = runner.invoke(main, [*args, "--json", str(one)])
    r2 = runner.invoke(main, [*args, "--tensor-parallel", "2", "--json", str(two)])
    assert r1.exit_code == 0, r1.output
    assert r2.exit_code == 0, r2.output
    d1, d2 = json.loads(one.read_text()), json.loads(two.read_text())
    assert d2["label"] == d1["label"] + "-tp2" and d2["config"]["tensor_parallel"] == 2
    assert d2["summary"]["tokens_sha256"] == d1["summary"]["tokens_sha256"]
    r3 = runner.invoke(main, [*args, "--tensor-parallel", "3"])
    assert r3.exit_code != 0 and "cannot be split 3 ways" in r3.output and "attention heads" in r3.output
    r4 = runner.invoke(main, [*args, "--tensor-parallel", "2", "--engine", "hf"])
    assert r4.exit_code != 0 and "--engine ours" in r4.output




def test_speculative_decoding_over_two_ranks_keeps_the_plain_tokens():
    """MTP3 and DFlash2 K=7 over two gloo ranks give one rank's plain greedy tokens (token invariance holds across
    the split), as the same runs on one rank do, in as many rounds."""
    from ninfer_bench.engine.runtime.parallel import launch

    one = _spec_run(0, 1)
    ranks = launch(2, _spec_run, 2, backend="gloo")
    plain = one["none"][0]
    assert one["mtp"][0] == plain and one["dflash2"][0] == plain
    for r in ranks:
        for spec, (tokens, rounds) in r.items():
            assert tokens == plain, spec
            assert rounds == one[spec][1], spec  # the same drafts accepted: as many rounds as on one rank
    assert one["mtp"][1] < 20 and one["dflash2"][1] < 20  # (drafts were accepted at all)


def test_niah_command_splits_over_ranks(tmp_path):
    """``ninfer-bench niah --tensor-parallel 2``: the same answers as one rank, labelled ``-tp2``, the size recorded."""
    import json

    from click.testing import CliRunner
    from ninfer_bench.cli import main

    args = ["niah", "--model", "tiny", "--ctx", "256", "--depths", "0,50", "--kv-dtype", "fp32", "--device", "cpu"]
    one, two = tmp_path / "n1.json", tmp_path / "n2.json"
    runner = CliRunner()
    for extra, path in (([], one), (["--tensor-parallel", "2"], two)):
        res = runner.invoke(main, [*args, *extra, "--json", str(path)])
        assert res.exit_code == 0, res.output
    d1, d2 = json.loads(one.read_text()), json.loads(two.read_text())
    assert [r["tokens"] for r in d2["records"]] == [r["tokens"] for r in d1["records"]]
    assert d2["label"] == "v3-niah-tp2" and d2["config"]["tensor_parallel"] == 2


def test_a_rank_that_dies_is_reported_at_once():
    """A rank that ends without a result (killed, out of memory) is named with its exit code, without waiting out
    the launch's timeout."""
    import time

    from ninfer_bench.engine.runtime.parallel import launch

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] ended with exit code\(s\) \[3\]"):
        launch(2, _die_on_one, backend="gloo", timeout_s=300)
    assert time.monotonic() - t0 < 120



def test_a_scheduler_drives_every_rank_through_the_mirror():
    """Continuous batching over two gloo ranks (engine/runtime/mirror.py): rank 0's scheduler admits, prefills in
    chunks, batches and releases; the other rank replays those calls. Greedy and seeded requests give one rank's
    tokens, an unseeded sampling request the same tokens on both ranks (its stream travels with it), and both ranks
    release the same sequences with the same tokens, in the same order."""
    from ninfer_bench.engine.runtime.parallel import launch

    one, _ = _mirrored_scheduler(0, 1)
    (out, released0), (none, released1) = launch(2, _mirrored_scheduler, 2, backend="gloo")
    assert none is None and released0 == released1 and len(released0) == 4  # the cancelled one was never admitted
    assert out[0] == one[0] and out[1] == one[1] and out[2] == one[2]
    assert [len(t) for t in out] == [10, 9, 3, 8, 0]
    assert sorted(map(tuple, released0)) == sorted(tuple(t) for t in out[:4])


def test_concurrency_command_splits_over_ranks(tmp_path):
    """``ninfer-bench concurrency --tensor-parallel 2``: the same tokens as on one rank (the sequential baseline's
    hashes and every request's), labelled ``-tp2``, the size recorded; replayed acceptance is refused under it."""
    import json

    from click.testing import CliRunner
    from ninfer_bench.cli import main

    args = ["concurrency", "--model", "tiny", "-c", "1,2", "-n", "6", "--rounds", "1", "--prompt-tokens", "24",
            "--kv-dtype", "fp32", "--device", "cpu"]
    one, two = tmp_path / "c1.json", tmp_path / "c2.json"
    runner = CliRunner()
    for extra, path in (([], one), (["--tensor-parallel", "2"], two)):
        res = runner.invoke(main, [*args, *extra, "--json", str(path)])
        assert res.exit_code == 0, res.output
    d1, d2 = json.loads(one.read_text()), json.loads(two.read_text())
    assert [r["tokens_sha256"] for r in d2["records"]] == [r["tokens_sha256"] for r in d1["records"]]
    assert all(lv["matches_sequential"] for lv in d2["summary"]["levels"])
    assert d2["label"] == d1["label"].replace("-conc", "-tp2-conc") and d2["config"]["tensor_parallel"] == 2
    res = runner.invoke(main, [*args, "--tensor-parallel", "2", "--spec", "mtp", "--replay-acceptance", "seed"])
    assert res.exit_code != 0 and "--replay-acceptance is not mirrored" in res.output


def test_serve_refuses_what_is_not_split():
    from click.testing import CliRunner
    from ninfer_bench.cli import main

    res = CliRunner().invoke(main, ["serve", "tiny", "--tensor-parallel", "2", "--session-dir", "x", "--port", "0"])
    assert res.exit_code != 0 and "--session-dir" in res.output


def test_the_fused_kernels_split_over_ranks():
    """v3's fused decode / verify kernels over two gloo ranks (each row-parallel output all-reduced before the fused
    residual norm): one rank's tokens (its eager path's, which tests/test_fastpath.py holds equal to its fused one),
    and speculative rounds (MTP3, its layer split as the model's) give the plain tokens."""
    from ninfer_bench.engine.runtime.parallel import launch

    pytest.importorskip("triton")
    one = _fused_run(0, 1, "torch")
    ranks = launch(2, _fused_run, 2, backend="gloo")
    for r in ranks:
        assert r == one
    assert one["mtp"] == one["none"][:3]
