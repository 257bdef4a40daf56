"""export-gguf: every exported tensor, read back with gguf's own dequantization, equals ours bit for bit (after the
rearrangements llama.cpp's qwen35 graph expects, computed here independently); refusals are one clear line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from ninfer_bench.engine.artifact.gguf_export import ExportError, export_gguf  # noqa: E402
from ninfer_bench.engine.artifact.loader import LoadedModel, load_source  # noqa: E402
from ninfer_bench.engine.artifact.synthetic import synthetic_raws  # noqa: E402
from ninfer_bench.engine.artifact.tokenizer import ByteTokenizer  # noqa: E402
from ninfer_bench.engine.model.config import FULL, ModelConfig  # noqa: E402

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ninfer-code-small.ninfer"


def _odd_model(policy: str = "mixed", **over) -> LoadedModel:
    """A model with more GDN value heads than key heads (the tiled reorder), K = 96 (q4 / q5 groups of 64 whose
    last one is half padding) and every quantized format among its tensors."""
    kw = dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
              linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096)
    kw.update(over)
    cfg = ModelConfig(**kw)
    return LoadedModel(cfg, synthetic_raws(cfg, policy, seed=3), ByteTokenizer(cfg.vocab_size), {"preset": "odd"})


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _expected(loaded: LoadedModel) -> dict[str, np.ndarray]:
    """What each GGUF tensor must hold, in fp32, from our own dequantization, written out per tensor kind (not
    through the exporter's plan)."""
    cfg = loaded.config
    hk, hv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    per = hv // hk

    def dense(name):
        return loaded.raws[name].dense(torch.float32).numpy()

    def tiled(a, size, axis=0):  # value heads grouped by key head -> tiled
        a = np.moveaxis(a, axis, 0)
        rest = a.shape[1:]
        a = a.reshape(hk, per, size, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest))).reshape(hk * per * size,
                                                                                                  *rest)
        return np.moveaxis(a, 0, axis)

    out = {"token_embd.weight": dense("model.embed_tokens.weight"),
           "output_norm.weight": dense("model.norm.weight") + 1}
    if "lm_head.weight" in loaded.raws:
        out["output.weight"] = dense("lm_head.weight")
    for i, kind in enumerate(cfg.layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = dense(p + "input_layernorm.weight") + 1
        out[b + "post_attention_norm.weight"] = dense(p + "post_attention_layernorm.weight") + 1
        for src, dst in (("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")):
            out[b + dst + ".weight"] = dense(p + src + ".weight")
        if kind == FULL:
            for src, dst in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                             ("o_proj", "attn_output")):
                out[b + dst + ".weight"] = dense(p + f"self_attn.{src}.weight")
            out[b + "attn_q_norm.weight"] = dense(p + "self_attn.q_norm.weight") + 1
            out[b + "attn_k_norm.weight"] = dense(p + "self_attn.k_norm.weight") + 1
            continue
        a = p + "linear_attn."
        qk = 2 * cfg.key_dim
        qkv = dense(a + "in_proj_qkv.weight")
        out[b + "attn_qkv.weight"] = np.concatenate([qkv[:qk], tiled(qkv[qk:], dv)])
        conv = dense(a + "conv1d.weight")[:, 0, :]
        out[b + "ssm_conv1d.weight"] = np.concatenate([conv[:qk], tiled(conv[qk:], dv)])
        out[b + "attn_gate.weight"] = tiled(dense(a + "in_proj_z.weight"), dv)
        out[b + "ssm_beta.weight"] = tiled(dense(a + "in_proj_b.weight"), 1)
        out[b + "ssm_alpha.weight"] = tiled(dense(a + "in_proj_a.weight"), 1)
        # the decay rate as our engine computes it (torch's exp: numpy's differs in the last bit for some inputs)
        out[b + "ssm_a"] = tiled(-torch.exp(torch.from_numpy(dense(a + "A_log"))).numpy(), 1)
        out[b + "ssm_dt.bias"] = tiled(dense(a + "dt_bias"), 1)
        out[b + "ssm_norm.weight"] = dense(a + "norm.weight")
        out[b + "ssm_out.weight"] = tiled(dense(a + "out_proj.weight"), dv, axis=1)
    return out


def _check_file(path: Path, loaded: LoadedModel) -> set[str]:
    reader = gguf.GGUFReader(str(path))
    expected = _expected(loaded)
    seen, types = set(), set()
    for t in reader.tensors:
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        want = expected[t.name]
        assert got.shape == want.shape, t.name
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=t.name)
        seen.add(t.name)
        types.add(t.tensor_type.name)
    assert seen == set(expected)
    return types


def test_bundled_model_exports_bit_exact(tmp_path):
    loaded = load_source(str(BUNDLED))
    out = tmp_path / "small.gguf"
    res = export_gguf(loaded, out)
    assert _check_file(out, loaded) == {"Q8_0", "F32"}
    assert res.pre_tokenizer == "gpt-2" and "mtp (the MTP head)" in res.skipped
    reader = gguf.GGUFReader(str(out))
    field = reader.get_field("general.architecture")
    assert field.contents() == "qwen35"
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    assert len(tokens) == loaded.config.vocab_size
    for tid in (0, 5, 300, 4000):  # the vocabulary's own spellings, id for id
        assert tokens[tid] == loaded.tokenizer.backend.id_to_token(tid)
    recurrent = reader.get_field("qwen35.attention.recurrent_layers").contents()
    assert recurrent == [t != FULL for t in loaded.config.layer_types]
    assert reader.get_field("qwen35.attention.key_length").contents() == loaded.config.head_dim
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("policy", ["mixed", "q5", "q4", "bf16"])
def test_tiled_heads_and_every_format_bit_exact(tmp_path, policy):
    loaded = _odd_model(policy)
    out = tmp_path / f"odd-{policy}.gguf"
    export_gguf(loaded, out)
    types = _check_file(out, loaded)
    want = {"mixed": {"Q8_0", "Q5_0", "Q4_0", "BF16", "F32"}, "q5": {"Q5_0", "F32"}, "q4": {"Q4_0", "F32"},
            "bf16": {"BF16", "F32"}}[policy]
    assert types == want
    tokens = gguf.GGUFReader(str(out)).get_field("tokenizer.ggml.tokens").contents()
    assert len(tokens) == 300 and tokens[256] == "<|endoftext|>" and tokens[ord("a")] == "a"


def test_refusals_are_clear(tmp_path):
    with pytest.raises(ExportError, match="one GDN head size"):
        export_gguf(_odd_model(linear_value_head_dim=64), tmp_path / "a.gguf")
    with pytest.raises(ExportError, match="multiple of 32"):  # a q8 K of 80: no whole ggml block
        export_gguf(_odd_model("q8", hidden_size=80), tmp_path / "b.gguf")
    odd = _odd_model("q4", linear_value_head_dim=16, linear_key_head_dim=16)
    with pytest.raises(ExportError, match="32-column blocks"):  # value heads of 16 columns split ggml blocks
        export_gguf(odd, tmp_path / "c.gguf")
    broken = _odd_model()
    raws = dict(broken.raws)
    del raws["model.layers.0.linear_attn.in_proj_z.weight"]
    with pytest.raises(ExportError, match="in_proj_z"):
        export_gguf(dataclasses.replace(broken, raws=raws), tmp_path / "d.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def test_cli_export_gguf(tmp_path):
    from click.testing import CliRunner

    from ninfer_bench.cli import main

    out = tmp_path / "m.gguf"
    res = CliRunner().invoke(main, ["export-gguf", str(BUNDLED), str(out)])
    assert res.exit_code == 0, res.output
    assert "109 tensors" in res.output and "Q8_0" in res.output and out.stat().st_size > 20_000_000
    res = CliRunner().invoke(main, ["export-gguf", "qwen3.8-27b", str(tmp_path / "x.gguf")])
    assert res.exit_code != 0 and "--synthetic" in res.output
