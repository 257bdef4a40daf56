"""Drafters from z-lab style folders, and the --lm-head-draft proposal head."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from ninfer_bench.cli import main
from ninfer_bench.engine.config import DraftConfig
from ninfer_bench.engine.convert import write_model
from ninfer_bench.engine.hf import HFCheckpoint
from ninfer_bench.engine.runtime import Engine
from ninfer_bench.engine.spec.dflash import BlockDrafter
from ninfer_bench.engine.spec.zlab import read_zlab_drafter, write_zlab_drafter

PROMPT = list(range(7, 90))


def random_drafter(kind: str, seed: int = 0) -> tuple[DraftConfig, dict]:
    cfg = DraftConfig(kind=kind, num_layers=2, block_size=8, target_layer_ids=(1, 5), mask_token_id=299,
                      hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, window=32 if kind == "dflash2" else 0, candidates=8 if kind == "dflash2" else 16,
                      scorer_rank=8 if kind == "dflash2" else 0)
    torch.manual_seed(seed)
    net = BlockDrafter(cfg, 64, 300)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from zero so 1 + w vs w shows
    return cfg, {f"{kind}.{k}": v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_zlab_folder_round_trip_and_convert(tmp_path, hf_qwen35, kind):
    cfg, tensors = random_drafter(kind)
    write_zlab_drafter(tmp_path / "drafter", cfg, tensors)
    got_cfg, got = read_zlab_drafter(tmp_path / "drafter")
    assert got_cfg.to_dict() == cfg.to_dict()
    for name, t in tensors.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-6)
    art = tmp_path / "m.ninfer"
    res = CliRunner().invoke(main, ["convert", str(hf_qwen35[0]), str(art), "--quant", "fp32",
                                    "--drafter", str(tmp_path / "drafter")])
    assert res.exit_code == 0, res.output
    plain = Engine.load(str(art), device="cpu", kv_dtype="fp32").generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    eng = Engine.load(str(art), device="cpu", kv_dtype="fp32", spec=kind, draft_tokens=5)
    for name, t in tensors.items():
        torch.testing.assert_close(eng.drafter.net.state_dict()[name.split(".", 1)[1]], t, rtol=0, atol=1e-6)
    assert eng.generate(PROMPT, max_new_tokens=40, ignore_eos=True).tokens == plain.tokens


def test_zlab_folder_with_dynamic_convs_is_refused(tmp_path):
    cfg, tensors = random_drafter("dflash2")
    write_zlab_drafter(tmp_path / "d", cfg, tensors)
    import json

    conf = json.loads((tmp_path / "d" / "config.json").read_text())
    conf["dflash_config"]["conv_kernel_size"] = 2
    (tmp_path / "d" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="dynamic convolutions"):
        read_zlab_drafter(tmp_path / "d")


def test_lm_head_draft_keeps_greedy_exact(tmp_path, hf_qwen35):
    ckpt = HFCheckpoint(hf_qwen35[0])
    art = tmp_path / "m.ninfer"
    cfg, drafter = random_drafter("dflash2")
    order = torch.randperm(300, generator=torch.Generator().manual_seed(0)).float()
    write_model(art, ckpt.config, ckpt.tensors(), policy="fp32",
                extra_components={"dflash2": {"config": cfg.to_dict(), "tensors": sorted(drafter)}},
                extra_tensors={**{n: ("fp32", t) for n, t in drafter.items()},
                               "draft_head.token_ids": ("fp32", order)})
    plain = Engine.load(str(art), device="cpu", kv_dtype="fp32").generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    eng = Engine.load(str(art), device="cpu", kv_dtype="fp32", spec="dflash2", draft_tokens=4, lm_head_draft=64)
    assert eng.drafter.head.ids.tolist() == order[:64].long().tolist()
    res = eng.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert res.tokens == plain.tokens
    assert eng.drafter.head.linear.out_features == 64  # the drafter scores only the 64 head rows
    with pytest.raises(ValueError, match="ranks only"):
        Engine.load(str(art), device="cpu", spec="dflash2", draft_tokens=4, lm_head_draft=1000)


def _with_drafter(path, hf_folder, cfg, tensors):
    ckpt = HFCheckpoint(hf_folder)
    write_model(path, ckpt.config, ckpt.tensors(), policy="fp32",
                extra_components={cfg.kind: {"config": cfg.to_dict(), "tensors": sorted(tensors)}},
                extra_tensors={n: ("fp32", t) for n, t in tensors.items()})


@pytest.mark.parametrize("edit,message", [
    ("shape", r"misshapen: layers\.0\.down_proj\.weight \[64, 95\] \(expected \[64, 96\]\)"),
    ("drop", r"missing \['norm\.weight'\]"),
    ("extra", r"unexpected \['layers\.9\.bias'\]"),
    ("taps", r"does not fit this target \(mask token 299, taps \[1, 40\]"),
])
def test_a_drafter_unlike_its_config_is_refused_at_load(tmp_path, hf_qwen35, edit, message):
    """An artifact whose drafter tensors do not match its config (a hand-edited or foreign export): loading,
    ``verify`` and ``convert --drafter`` say which tensors, instead of a torch error when --spec first runs."""
    cfg, tensors = random_drafter("dflash2")
    if edit == "shape":
        name = "dflash2.layers.0.down_proj.weight"
        tensors[name] = tensors[name][:, :95].clone()
    elif edit == "drop":
        del tensors["dflash2.norm.weight"]
    elif edit == "extra":
        tensors["dflash2.layers.9.bias"] = torch.zeros(3)
    else:
        cfg.target_layer_ids = (1, 40)
    art = tmp_path / "m.ninfer"
    _with_drafter(art, hf_qwen35[0], cfg, tensors)
    with pytest.raises(ValueError, match=message):
        Engine.load(str(art), device="cpu")
    res = CliRunner().invoke(main, ["verify", str(art)])
    assert res.exit_code == 1 and "dflash2 component" in res.output, res.output
    write_zlab_drafter(tmp_path / "d", cfg, tensors)
    res = CliRunner().invoke(main, ["convert", str(hf_qwen35[0]), str(tmp_path / "c.ninfer"), "--quant", "fp32",
                                    "--drafter", str(tmp_path / "d")])
    assert res.exit_code != 0 and not (tmp_path / "c.ninfer").exists(), res.output
