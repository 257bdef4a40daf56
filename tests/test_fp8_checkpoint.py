"""FP8 checkpoints (Qwen's fine-grained ``fp8`` layout, llm-compressor's compressed-tensors FP8): convert reads each
FP8 weight back with its scale, so the artifact equals one converted from the same weights stored dequantized; other
quantized checkpoints, and FP8 tensors without their scales, are refused naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer_bench.engine.artifact.convert import convert
from ninfer_bench.engine.artifact.hf_checkpoint import CheckpointError, HFCheckpoint
from ninfer_bench.engine.runtime.engine import Engine
from tinyhf import make_hf

FP8_MAX = 448.0  # the largest float8_e4m3fn value
BLOCK = (16, 32)  # smaller than the tiny model's projections, and not dividing 96 or 144: ragged edge blocks


def _quantizable(name: str, t: torch.Tensor) -> bool:
    """The projections a published FP8 checkpoint stores in FP8 (embeddings, lm_head, norms and the tiny GDN b / a
    stay as they are)."""
    return t.dim() == 2 and name.endswith("proj.weight") and "in_proj_b" not in name and "in_proj_a" not in name


def _block_fp8(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 codes, scale per [bn, bk] block, the dequantized weight) of ``w`` [N, K]."""
    bn, bk = block
    n, k = w.shape
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    pad[:n, :k] = w
    blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX  # [N / bn, K / bk]
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    codes = (w / full).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * full


def _row_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [N, 1]
    codes = (w / scale).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * scale


def _write_pair(hf, fp8_dir, ref_dir, *, method: str) -> None:
    """Save an FP8 copy of checkpoint ``hf`` in ``fp8_dir`` and the same weights dequantized in ``ref_dir``."""
    for d in (fp8_dir, ref_dir):
        shutil.copytree(hf, d)
        for f in d.glob("*.safetensors"):
            f.unlink()
    tensors = {}
    for f in hf.glob("*.safetensors"):
        tensors.update(load_file(f))
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if not _quantizable(name, t):
            fp8[name] = ref[name] = t
            continue
        if method == "fp8":
            codes, scale, deq = _block_fp8(t.float(), BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = codes, scale
        else:
            codes, scale, deq = _row_fp8(t.float())
            fp8[name], fp8[name[:-len("weight")] + "weight_scale"] = codes, scale
            fp8[name[:-len("weight")] + "input_scale"] = torch.ones(1)  # a static activation scale: dropped
            if name.endswith("self_attn.k_proj.weight"):  # K/V cache scales: dropped too
                attn = name[:-len("k_proj.weight")]
                fp8[attn + "k_scale"], fp8[attn + "v_scale"] = torch.ones(()), torch.ones(())
        ref[name] = deq.to(t.dtype)
    save_file(fp8, str(fp8_dir / "model.safetensors"))
    save_file(ref, str(ref_dir / "model.safetensors"))
    cfg = json.loads((hf / "config.json").read_text())
    if method == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
              "modules_to_not_convert": ["lm_head"]}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                               "strategy": "channel"}}}}
    (fp8_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8") / "hf"
    make_hf("qwen3_5", d, seed=7, intermediate_size=144)
    return d


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_fp8_checkpoint_reads_as_its_dequantized_weights(tmp_path, hf_dir, method):
    _write_pair(hf_dir, tmp_path / "fp8", tmp_path / "ref", method=method)
    ours, ref = HFCheckpoint(tmp_path / "fp8").tensors(), HFCheckpoint(tmp_path / "ref").tensors()
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert ours[name].dtype == ref[name].dtype and torch.equal(ours[name], ref[name]), name
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({**cfg, "dtype": "float16"}))
    half = HFCheckpoint(tmp_path / "fp8").tensors()
    assert half["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16  # the dtype the checkpoint declares


def test_fp8_checkpoint_converts_and_decodes_as_the_dequantized_one(tmp_path, hf_dir):
    _write_pair(hf_dir, tmp_path / "fp8", tmp_path / "ref", method="fp8")
    outs = []
    for d in ("fp8", "ref"):
        convert(tmp_path / d, tmp_path / f"{d}.ninfer", policy="mixed")
        eng = Engine.load(str(tmp_path / f"{d}.ninfer"), device="cpu", kv_dtype="fp32", max_context=256)
        outs.append(eng.generate([5, 17, 99, 3, 250, 41], max_new_tokens=24).tokens)
    assert outs[0] == outs[1]


def _set_qc(folder, qc) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "4-bit 'int' weights"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, True]}, r"weight_block_size .* got \[128, True\]"),
])
def test_other_quantizations_are_refused_naming_them(tmp_path, hf_dir, qc, match):
    shutil.copytree(hf_dir, tmp_path / "q")
    _set_qc(tmp_path / "q", qc)
    with pytest.raises(CheckpointError, match=match):
        convert(tmp_path / "q", tmp_path / "q.ninfer", policy="mixed")
    assert not (tmp_path / "q.ninfer").exists()


def test_fp8_tensors_without_their_scales_are_refused(tmp_path, hf_dir):
    _write_pair(hf_dir, tmp_path / "fp8", tmp_path / "ref", method="fp8")
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(path)
    victim = next(n for n in tensors if n.endswith("mlp.down_proj.weight_scale_inv"))
    wrong = dict(tensors)
    wrong[victim] = torch.ones(3, 3)
    save_file(wrong, str(path))
    with pytest.raises(CheckpointError, match=r"scale of shape \[3, 3\] does not fit"):
        HFCheckpoint(tmp_path / "fp8").tensors()
    del wrong[victim]
    save_file(wrong, str(path))
    with pytest.raises(CheckpointError, match=f"has no {victim} beside it"):
        HFCheckpoint(tmp_path / "fp8").tensors()
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del cfg["quantization_config"]  # FP8 tensors, but a config that declares no quantization
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="declares no quantization_config"):
        HFCheckpoint(tmp_path / "fp8").tensors()
