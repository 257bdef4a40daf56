"""Drafters from z-lab style folders, and the --lm-head-draft proposal head."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

from ninfer_bench.cli import main
from ninfer_bench.engine.model.config import DraftConfig
from ninfer_bench.engine.artifact.convert import write_model
from ninfer_bench.engine.artifact.hf_checkpoint import HFCheckpoint
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.model.dflash import BlockDrafter
from ninfer_bench.engine.artifact.zlab import read_zlab_drafter, write_zlab_drafter

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


def _with_drafter(path, hf_folder, cfg, tensors, config: dict | None = None):
    """An fp32 artifact of ``hf_folder`` with the drafter ``cfg`` / ``tensors``; ``config`` replaces the stored
    config dict (values DraftConfig itself would refuse, as a hand-edited or foreign artifact may hold)."""
    ckpt = HFCheckpoint(hf_folder)
    write_model(path, ckpt.config, ckpt.tensors(), policy="fp32",
                extra_components={cfg.kind: {"config": config or cfg.to_dict(), "tensors": sorted(tensors)}},
                extra_tensors={n: ("fp32", t) for n, t in tensors.items()})


@pytest.mark.parametrize("edit,message", [
    ("shape", r"misshapen: layers\.0\.down_proj\.weight \[64, 95\] \(expected \[64, 96\]\)"),
    ("drop", r"missing \['norm\.weight'\]"),
    ("extra", r"unexpected \['layers\.9\.bias'\]"),
    ("taps", r"does not fit this target: target_layer_ids \[1, 40\] name layer\(s\) \[40\] outside its layers "
             r"\(0\.\.7\)"),
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


def _zlab_folder(tmp_path, kind: str = "dflash2", **edits):
    """A z-lab folder of ``random_drafter(kind)`` whose config.json has ``edits`` applied (in ``dflash_config`` for
    the keys kept there, else at the top level; a value of None deletes the key)."""
    cfg, tensors = random_drafter(kind)
    folder = tmp_path / "drafter"
    write_zlab_drafter(folder, cfg, tensors)
    conf = json.loads((folder / "config.json").read_text())
    for key, value in edits.items():
        where = conf["dflash_config"] if key in conf["dflash_config"] else conf
        if value is None:
            del where[key]
        else:
            where[key] = value
    (folder / "config.json").write_text(json.dumps(conf))
    return folder


def _convert_error(tmp_path, hf_folder, drafter) -> str:
    """``convert --drafter`` of a bad drafter folder: the one line it prints (nothing written)."""
    out = tmp_path / "m.ninfer"
    res = CliRunner().invoke(main, ["convert", str(hf_folder), str(out), "--quant", "fp32", "--drafter", str(drafter)])
    assert res.exit_code == 1 and not out.exists(), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception  # no traceback
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


FIT = r"/drafter: the dflash2 drafter does not fit this target: "  # the folder named, at convert

@pytest.mark.parametrize("edits,message", [
    # values that used to convert and verify cleanly, then fail inside torch at the first decode
    ({"mask_token_id": -1}, r"config\.json: mask_token_id must be a non-negative integer, got -1$"),
    ({"target_layer_ids": [1, 1]}, r"config\.json: target_layer_ids \[1, 1\] repeats layer\(s\) \[1\]$"),
    ({"target_layer_ids": [-1, 5]}, r"config\.json: target_layer_ids \[-1, 5\] has a negative layer$"),
    ({"selector_top_k": 0}, r"config\.json: selector_top_k must be a positive integer, got 0$"),
    ({"block_size": 1}, r"config\.json: block_size must be >= 2"),
    ({"use_sliding_window": True, "layer_types": ["sliding_attention"] * 2, "sliding_window": -4},
     r"config\.json: sliding_window must be a non-negative integer, got -4$"),
    ({"num_hidden_layers": 0}, r"config\.json: num_hidden_layers must be a positive integer, got 0$"),
    ({"num_key_value_heads": 3}, r"config\.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3$"),
    ({"head_dim": 15}, r"config\.json: head_dim must be even"),
    ({"selector_rank": -2}, r"config\.json: selector_rank must be a non-negative integer, got -2$"),
    ({"rms_norm_eps": 0}, r"config\.json: rms_norm_eps must be a positive number, got 0$"),
    ({"output_multiplier": "2"}, r"config\.json: output_multiplier must be a finite number, got '2'$"),
    # other config.json mistakes that gave a traceback or a message without the file
    ({"num_hidden_layers": None}, r"config\.json: missing 'num_hidden_layers'$"),
    ({"target_layer_ids": "1,5"}, r"config\.json: target_layer_ids must be a list of integers, got '1,5'$"),
    ({"dflash_config": [1, 5]}, r"config\.json: dflash_config must be a JSON object"),
    # values that only the target rules out: named at convert, before anything is written
    ({"mask_token_id": 300}, FIT + r"mask_token_id 300 is outside its vocabulary \(0\.\.299\)$"),
    ({"target_layer_ids": [1, 8]}, FIT + r"target_layer_ids \[1, 8\] name layer\(s\) \[8\] outside"),
    ({"selector_top_k": 301}, FIT + r"candidates \(z-lab selector_top_k\) 301 exceed its vocabulary"),
], ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "")
def test_a_bad_zlab_config_is_one_line_at_convert(tmp_path, hf_qwen35, edits, message):
    """A drafter config.json the drafter cannot run with is refused by ``convert --drafter`` in one line naming the
    file (or the drafter) and the key, not by a torch error at decode or a traceback."""
    folder = _zlab_folder(tmp_path, **edits)
    line = _convert_error(tmp_path, hf_qwen35[0], folder)
    if "config\\.json" in message:
        assert line.startswith(f"error: {folder / 'config.json'}: "), line
    assert re.search(message, line), line


def test_a_zlab_config_that_is_not_json_names_the_file(tmp_path, hf_qwen35):
    folder = _zlab_folder(tmp_path)
    (folder / "config.json").write_text('{"num_hidden_layers": 2,}')
    line = _convert_error(tmp_path, hf_qwen35[0], folder)
    assert line.startswith(f"error: {folder / 'config.json'}: not valid JSON (Expecting property name"), line
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
        read_zlab_drafter(folder)


@pytest.mark.parametrize("edit,message", [
    ({"mask_token_id": -1}, r"dflash2 component: draft config: mask_token_id must be a non-negative integer"),
    ({"target_layer_ids": [1, 1]}, r"dflash2 component: draft config: target_layer_ids \[1, 1\] repeats layer"),
    ({"candidates": 0}, r"dflash2 component: draft config: candidates must be a positive integer, got 0"),
    ({"candidates": 301}, r"dflash2 component: the dflash2 drafter does not fit this target: candidates"),
    ({"window": -1}, r"dflash2 component: draft config: window must be a non-negative integer, got -1"),
    ({"target_layer_ids": "1,5"}, r"dflash2 component: draft config: target_layer_ids must be a list of integers"),
    ({"taps": [1, 5]}, r"dflash2 component: draft config: unknown field\(s\) \['taps'\]"),
], ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "")
def test_bad_drafter_values_in_an_artifact_are_refused_at_load_and_verify(tmp_path, hf_qwen35, edit, message):
    """An artifact whose drafter config holds a value the drafter cannot run with (written by another tool, or by
    hand): loading and ``verify`` name the component and the field, before any decode."""
    cfg, tensors = random_drafter("dflash2")
    art = tmp_path / "m.ninfer"
    _with_drafter(art, hf_qwen35[0], cfg, tensors, config={**cfg.to_dict(), **edit})
    with pytest.raises(ValueError, match=message):
        Engine.load(str(art), device="cpu", spec="dflash2", draft_tokens=3)
    res = CliRunner().invoke(main, ["verify", str(art)])
    assert res.exit_code == 1 and re.search(message, res.output), res.output


def test_a_proposal_head_narrower_than_the_candidates_is_refused():
    """--lm-head-draft N below DFlash2's candidates a position would fail inside top-k at the first round."""
    from ninfer_bench.engine.artifact.loader import default_model

    with pytest.raises(ValueError, match="--lm-head-draft 4 is fewer tokens than the dflash2 drafter's 16 candidates"):
        Engine.load(default_model(), device="cpu", spec="dflash2", lm_head_draft=4)


@pytest.mark.parametrize("spec", ["mtp", "dflash2"])
def test_lm_head_draft_on_random_weights(spec):
    """A preset's random weights have no token frequencies: --lm-head-draft N drafts over the first N ids (what
    --replay-acceptance runs at the 27B shape cost), greedy tokens stay plain decoding's; N past the vocabulary is
    refused."""
    plain = Engine.load("tiny", device="cpu", kv_dtype="fp32").generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32", spec=spec, draft_tokens=3, lm_head_draft=32)
    assert eng.drafter.head.ids.tolist() == list(range(32))
    assert eng.generate(PROMPT, max_new_tokens=24, ignore_eos=True).tokens == plain.tokens
    vocab = eng.config.vocab_size
    with pytest.raises(ValueError, match=f"only {vocab} tokens"):
        Engine.load("tiny", device="cpu", spec=spec, lm_head_draft=vocab + 1)
