"""The foundation commands end to end: convert, logits, inspect, verify, upgrade, oracle, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ninfer_bench.cli import main
from ninfer_bench.engine.artifact.reader import Artifact
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.oracles.store import load_oracle

from tinyhf import make_hf


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def one_line_error(output: str) -> str:
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("error:"), output
    return lines[0]


def test_convert_then_logits_matches_transformers(tmp_path, hf_qwen35):
    folder, model = hf_qwen35
    art, out = tmp_path / "m.ninfer", tmp_path / "l.npy"
    code, text = run("convert", folder, art, "--quant", "fp32")
    assert code == 0, text
    code, text = run("logits", art, "--ids", ",".join(str(i) for i in range(3, 230)), "--out", out,
                     "--device", "cpu", "--kv-dtype", "fp32")
    assert code == 0, text
    ours = torch.from_numpy(np.load(out))
    with torch.no_grad():
        ref = model(torch.tensor([list(range(3, 230))])).logits[0]
    assert float((ours - ref).norm() / ref.norm()) <= 1e-4


def test_console_script_runs(tmp_path, tiny_artifact):
    exe = shutil.which("ninfer-bench", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe, "console script ninfer-bench is not installed"
    res = subprocess.run([exe, "inspect", str(tiny_artifact)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "text" in res.stdout and "digests" in res.stdout


def test_inspect_and_verify(tiny_artifact):
    code, text = run("verify", tiny_artifact)
    assert code == 0 and "ok" in text
    code, text = run("inspect", tiny_artifact, "--json")
    assert code == 0
    assert json.loads(text)["checks"]["digests"] is True


def test_flipped_byte_names_the_object(tmp_path, tiny_artifact):
    bad = tmp_path / "bad.ninfer"
    shutil.copy(tiny_artifact, bad)
    with Artifact.open(bad) as art:
        info = art.info("model.layers.3.self_attn.o_proj.weight")
        where = art.payload_start + info.offset + 5
    data = bytearray(bad.read_bytes())
    data[where] ^= 0xFF
    bad.write_bytes(bytes(data))
    code, text = run("verify", bad)
    assert code != 0
    assert "model.layers.3.self_attn.o_proj.weight" in text
    code, text = run("inspect", bad, "--json")
    doc = json.loads(text)
    assert code == 1 and doc["checks"]["digests"] is False
    assert any("model.layers.3.self_attn.o_proj.weight" in line for line in doc["failures"])


@pytest.mark.parametrize("damage", ["truncate", "magic"])
def test_damaged_files_fail_in_one_line(tmp_path, tiny_artifact, damage):
    bad = tmp_path / "bad.ninfer"
    data = tiny_artifact.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"GGUF" + data[4:])
    for cmd in (["inspect", bad], ["verify", bad], ["logits", bad, "--ids", "1,2", "--out", tmp_path / "x.npy"]):
        code, text = run(*cmd)
        assert code != 0
        line = one_line_error(text)
        assert ("not a ninfer artifact" in line) if damage == "magic" else ("model." in line or "truncat" in line)
    assert not (tmp_path / "x.npy").exists()


def test_bad_hf_folders(tmp_path):
    folder = tmp_path / "hf"
    make_hf("qwen3_5", folder, num_hidden_layers=4)
    out = tmp_path / "out.ninfer"
    # unknown model_type
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    code, text = run("convert", folder, out)
    assert code != 0 and "model_type" in one_line_error(text)
    # shape mismatch: the config claims a wider MLP than the tensors hold
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    code, text = run("convert", folder, out)
    assert code != 0 and "mlp" in one_line_error(text) and "shape" in text
    # missing tensor: the config claims more layers
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 8,
                                                    "layer_types": cfg["layer_types"] * 2}))
    code, text = run("convert", folder, out)
    assert code != 0 and "missing" in one_line_error(text)
    # nonexistent path
    code, text = run("convert", tmp_path / "nope", out)
    assert code != 0 and "no such" in one_line_error(text)
    assert not out.exists()
    assert not list(tmp_path.glob("out.ninfer*"))


@pytest.mark.parametrize("edit, named", [
    (lambda c: {**c, "layer_types": None, "full_attention_interval": 0}, "full_attention_interval"),
    (lambda c: {**c, "layer_types": None, "full_attention_interval": "4"}, "full_attention_interval"),
    (lambda c: {**c, "layer_types": "linear_attention"}, "layer_types"),
    (lambda c: {**c, "rope_parameters": "default"}, "rope_parameters"),
    (lambda c: {**c, "num_hidden_layers": None}, "num_hidden_layers"),
    (lambda c: {**c, "model_type": "qwen3_next", "num_hidden_layers": None}, "num_hidden_layers"),
    (lambda c: [c], "JSON object"),
])
def test_config_values_of_the_wrong_kind_fail_in_one_line(tmp_path, hf_qwen35, edit, named):
    """config.json values of the wrong type or range are named in one line, not a ZeroDivisionError / TypeError /
    AttributeError traceback from reading them."""
    folder = tmp_path / "hf"
    shutil.copytree(hf_qwen35[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(cfg)))
    code, text = run("convert", folder, tmp_path / "out.ninfer")
    assert code == 1 and named in one_line_error(text)


def test_broken_or_foreign_tokenizers_are_refused(tmp_path, hf_qwen35):
    """A tokenizer.json that does not load, or names ids past the model's vocabulary, and a tokenizer_config.json that
    is not JSON are refused by convert, naming the file; an artifact that carries a broken tokenizer (written by
    hand: convert refuses it) fails verify and gives a one-line error where it is loaded."""
    from tokenizers import Tokenizer, models

    from ninfer_bench.engine.artifact.convert import write_model
    from ninfer_bench.engine.artifact.hf_checkpoint import HFCheckpoint

    folder, out = tmp_path / "hf", tmp_path / "m.ninfer"
    shutil.copytree(hf_qwen35[0], folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    (folder / "tokenizer.json").write_text('{"model": 12}')
    code, text = run("convert", folder, out)
    assert code == 1 and "tokenizer.json: the tokenizer does not load" in one_line_error(text)
    words = lambda n: Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0")).to_str()  # noqa: E731
    (folder / "tokenizer.json").write_text(words(vocab + 5))
    code, text = run("convert", folder, out)
    assert code == 1 and f"token ids up to {vocab + 4}, but the model's vocabulary has {vocab}" in one_line_error(text)
    (folder / "tokenizer.json").write_text(words(vocab - 20))  # fewer ids than embedding rows: fine
    (folder / "tokenizer_config.json").write_text("{'eos_token': 1}")
    code, text = run("convert", folder, out)
    assert code == 1 and "tokenizer_config.json: not valid JSON" in one_line_error(text)
    assert not out.exists()
    (folder / "tokenizer_config.json").unlink()
    code, text = run("convert", folder, out, "--quant", "fp32")
    assert code == 0 and out.exists()
    ck = HFCheckpoint(hf_qwen35[0])
    write_model(out, ck.config, ck.tensors(), policy="fp32", blobs={"tokenizer.json": b'{"model": 12}'})
    code, text = run("verify", out)
    assert code == 1 and "the tokenizer component does not load" in text
    code, text = run("generate", out, "-p", "x", "-n", "2", "--device", "cpu")
    assert code == 1 and "tokenizer.json: the tokenizer does not load" in one_line_error(text)


def test_nonexistent_artifact(tmp_path):
    code, text = run("inspect", tmp_path / "missing.ninfer")
    assert code != 0 and "no such file" in one_line_error(text)
    code, text = run("generate", tmp_path / "missing.ninfer", "-p", "x")
    assert code != 0 and "no such model" in one_line_error(text)
    hf = tmp_path / "hf"  # a Hugging Face folder given where an artifact goes: say how to convert it
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    code, text = run("generate", hf, "-p", "x")
    assert code != 0 and "is a folder, not an artifact: convert it first" in one_line_error(text)


def test_debug_shows_traceback(tmp_path):
    res = CliRunner().invoke(main, ["--debug", "inspect", str(tmp_path / "missing.ninfer")])
    assert res.exit_code != 0 and res.exception is not None


def test_v2_upgrade_keeps_bytes_and_logits(tmp_path, hf_qwen35):
    v2, v3 = tmp_path / "m2.ninfer", tmp_path / "m3.ninfer"
    assert run("convert", hf_qwen35[0], v2, "--quant", "mixed", "--format-version", "2")[0] == 0
    code, text = run("verify", v2)
    assert code == 0 and "bounds-checked" in text and "no digests" in text
    code, text = run("inspect", v2, "--json")
    assert code == 0 and json.loads(text)["checks"]["digests"] is None  # n/a, not "pass": v2 carries none
    code, text = run("upgrade", v2, v3)
    assert code == 0 and "certify the bytes" in text and "overwritten" not in text
    code, text = run("upgrade", v2, v3)
    assert code == 0 and f"the existing {v3} was overwritten" in text
    with Artifact.open(v2) as a2, Artifact.open(v3) as a3:
        assert a2.version == 2 and a3.version == 3
        assert a2.names() == a3.names()
        for n in a2.names():
            assert torch.equal(a2.raw(n), a3.raw(n)), n
    ids = list(range(10, 90))
    l2 = Engine.load(str(v2), device="cpu", kv_dtype="fp32").logits(ids)
    l3 = Engine.load(str(v3), device="cpu", kv_dtype="fp32").logits(ids)
    assert torch.equal(l2, l3)


def test_generate_of_one_token_has_no_decode_rate(tiny_artifact):
    code, text = run("generate", tiny_artifact, "-p", "abc", "-n", "1", "--device", "cpu")
    assert code == 0 and "decode - tok/s" in text and "nan" not in text


def test_generated_text_is_printed_as_generated(tiny_artifact, monkeypatch):
    """generate prints the completion unchanged: not hard-wrapped at the console width when piped (a newline into a
    long code line), no ``:name:`` emoji codes replaced."""
    text = "x = a[:smile:] + [1]  # " + "word " * 60
    real = Engine.generate

    def with_text(self, *args, **kwargs):
        res = real(self, *args, **kwargs)
        res.text = text
        return res

    monkeypatch.setattr(Engine, "generate", with_text)
    code, out = run("generate", tiny_artifact, "-p", "abc", "-n", "2", "--device", "cpu")
    assert code == 0 and text in out


def test_oracle_command_and_engine_agree(tmp_path, tiny_artifact):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "ids": list(range(7 * i + 1, 7 * i + 40))})
                                 for i in range(3)))
    out = tmp_path / "oracle.json.gz"
    code, text = run("oracle", "prompts", tiny_artifact, "--prompts", prompts, "-n", "12", "--out", out)
    assert code == 0, text
    records, meta = load_oracle(out)
    assert len(records) == 3 and meta["top_k"] == 8
    eng = Engine.load(str(tiny_artifact), device="cpu", kv_dtype="fp32")
    for rec in records:
        got = eng.generate(rec["prompt_ids"], max_new_tokens=12).tokens
        assert got == rec["tokens"][: len(got)]


def test_logits_rejects_ids_outside_the_vocabulary(tmp_path):
    eng = Engine.load("tiny", device="cpu", kv_dtype="fp32")
    vocab = eng.config.vocab_size
    with pytest.raises(ValueError, match=rf"token id {vocab} is outside the vocabulary \(0..{vocab - 1}\)"):
        eng.logits([1, vocab])
    for ids in ("-1,2", f"1,{vocab}"):
        code, text = run("logits", "tiny", "--ids", ids, "--out", tmp_path / "x.npy", "--device", "cpu")
        assert code == 1 and "outside the vocabulary" in one_line_error(text)


def test_logits_ids_and_out_are_taken_as_given(tmp_path):
    out = tmp_path / "l2"
    code, text = run("logits", "tiny", "--ids", "5, 5,7", "--out", out, "--device", "cpu")
    assert code == 0, text
    assert np.load(out).shape[0] == 3 and not (tmp_path / "l2.npy").exists()  # repeats kept, no suffix added
    for ids in ("1,,2", "1,2,", " "):
        code, text = run("logits", "tiny", "--ids", ids, "--out", tmp_path / "x.npy", "--device", "cpu")
        assert code == 1 and "--ids" in one_line_error(text)


def test_bad_output_folders_are_found_before_any_work(tmp_path):
    out = tmp_path / "no-such-folder" / "x"
    for cmd in (["convert", tmp_path / "no-such-checkpoint", out], ["upgrade", tmp_path / "no-such.ninfer", out],
                ["logits", tmp_path / "no-such.ninfer", "--ids", "1", "--out", out]):
        code, text = run(*cmd)
        line = one_line_error(text)
        assert code == 1 and f"cannot write {out}: folder" in line and ".tmp-" not in line


def test_convert_refuses_to_write_into_its_input_and_says_when_it_overwrites(tmp_path, hf_qwen35):
    folder = tmp_path / "hf"
    shutil.copytree(hf_qwen35[0], folder)
    source = folder / "model.safetensors"
    before = source.read_bytes()
    code, text = run("convert", folder, source)
    assert code == 1 and "inside the input folder" in one_line_error(text)
    assert source.read_bytes() == before
    out = tmp_path / "m.ninfer"
    code, text = run("convert", folder, out, "--quant", "q8")
    assert code == 0 and "overwritten" not in text
    code, text = run("convert", folder, out, "--quant", "q8")
    assert code == 0 and f"the existing {out} was overwritten" in text


def test_non_finite_weights_are_refused_or_reported(tmp_path, hf_qwen35, tiny_artifact):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    shutil.copytree(hf_qwen35[0], folder)
    tensors = load_file(folder / "model.safetensors")
    name = next(n for n in tensors if n.endswith("layers.1.mlp.down_proj.weight"))
    tensors[name][3, 4] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "m.ninfer"
    code, text = run("convert", folder, out)
    assert code == 1 and "model.layers.1.mlp.down_proj.weight has 1 non-finite value" in one_line_error(text)
    assert not out.exists()
    # an artifact whose bytes hold a NaN (its digest fails, but logits does not hash): no logits are written
    bad = tmp_path / "nan.ninfer"
    shutil.copy(tiny_artifact, bad)
    with Artifact.open(bad) as art:
        where = art.payload_start + art.info("model.norm.weight").offset
    data = bytearray(bad.read_bytes())
    data[where:where + 4] = np.array([np.nan], np.float32).tobytes()
    bad.write_bytes(bytes(data))
    code, text = run("logits", bad, "--ids", "1,2,3", "--out", tmp_path / "l.npy", "--device", "cpu")
    assert code == 1 and "not finite" in one_line_error(text)
    assert not (tmp_path / "l.npy").exists()


def test_header_config_that_cannot_load_fails_inspect_and_verify(tmp_path, tiny_artifact):
    bad = tmp_path / "bad.ninfer"
    data = tiny_artifact.read_bytes()
    head = data[:4096]
    assert head.count(b'"intermediate_size"') == 1
    bad.write_bytes(head.replace(b'"intermediate_size"', b'"intermediate_sizf"') + data[4096:])
    code, text = run("verify", bad)
    assert code == 1 and "text component" in text and "intermediate_sizf" in text
    code, text = run("inspect", bad, "--json")
    doc = json.loads(text)
    assert code == 1 and doc["checks"]["text"] is False and doc["checks"]["digests"] is False  # the header's
    assert any("intermediate_sizf" in f for f in doc["failures"])
    assert any(f.startswith("header: sha256 mismatch") for f in doc["failures"])
    code, text = run("inspect", bad)
    assert code == 1 and "FAIL  text" in text


def test_verify_fails_on_nan_weights_with_matching_digests(tmp_path, tiny_artifact):
    """An artifact exported with a NaN in a weight (its digest made over those bytes) loads, but verify and
    inspect fail on it."""
    import hashlib

    bad = tmp_path / "nan.ninfer"
    data = bytearray(tiny_artifact.read_bytes())
    with Artifact.open(tiny_artifact) as art:
        info = art.info("model.norm.weight")
        start = art.payload_start + info.offset
    old = hashlib.sha256(data[start:start + info.nbytes]).hexdigest()
    data[start + 4:start + 8] = struct.pack("<f", float("nan"))
    new = hashlib.sha256(data[start:start + info.nbytes]).hexdigest()
    assert data.count(old.encode()) == 1
    data = bytearray(bytes(data).replace(old.encode(), new.encode()))
    # and the header's own digest made anew, as an exporter writing those bytes would have made it
    from ninfer_bench.engine.artifact.format import HEADER_BYTES, header_digest

    (jlen,) = struct.unpack("<Q", data[8:16])
    head = bytes(data[:HEADER_BYTES[3] + jlen])
    stale = json.loads(head[HEADER_BYTES[3]:])["provenance"]["header_sha256"]
    data[:len(head)] = head.replace(stale.encode(), header_digest(head).encode())
    bad.write_bytes(bytes(data))
    with Artifact.open(bad):  # it loads: every digest matches
        pass
    code, text = run("verify", bad)
    assert code == 1 and "model.norm.weight" in text and "NaN or inf" in text
    code, text = run("inspect", bad, "--json")
    assert code == 1 and json.loads(text)["checks"]["digests"] is False


def test_a_prompt_file_with_a_byte_order_mark_reads_as_its_text(tmp_path):
    """A UTF-8 prompt file saved with a byte-order mark (as some Windows editors write it) is its text: the mark is
    no prompt token; a file that is not UTF-8 is still named."""
    from ninfer_bench.suites.common import read_text

    (tmp_path / "bom.txt").write_bytes("\ufeffdef f(x):\r\n    return x\n".encode("utf-8"))
    assert read_text(tmp_path / "bom.txt") == "def f(x):\r\n    return x\n"
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt: not UTF-8 text"):
        read_text(tmp_path / "latin1.txt")


def test_serve_without_its_extra_names_it_before_loading(monkeypatch):
    """`pip install -e '.[hf]'` (the README's main set-up) has no HTTP stack: serve says which extra, no traceback."""
    from ninfer_bench.engine.runtime import engine as runtime

    monkeypatch.setitem(sys.modules, "fastapi", None)  # find_spec and import both treat it as not installed
    monkeypatch.setattr(runtime, "load_source", lambda *a, **k: pytest.fail("the model loaded"))
    code, text = run("serve", "--port", "0")
    assert code == 1 and "'.[serve]'" in one_line_error(text) and "fastapi" in text


@pytest.mark.parametrize("columns, width", [(None, 140), ("80", 140), ("250", 250), ("wide", 140)])
def test_console_width_off_a_terminal(columns, width):
    """Piped output is 140 columns wide, or wider where COLUMNS says so (a device log's grid table); never narrower
    (pytest-xdist's workers set COLUMNS=80, and the tables' cells would be cut)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": columns} if columns else {})
    out = subprocess.run([sys.executable, "-c", "from ninfer_bench.cli.common import console; print(console.width)"],
                         capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(width)
