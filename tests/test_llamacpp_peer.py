"""--engine llamacpp: llama.cpp on the exact GGUF export of the same weights, in the decode suite's grid, with its
agreement with our plain run. The runs need llama-cpp-python (the [peers] extra, built from source) and skip
without it; the option checks run everywhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ninfer_bench.suites.decode import DecodeOptions, decode_runs

BUNDLED = str(Path(__file__).resolve().parent.parent / "models" / "ninfer-code-small.ninfer")
HELDOUT = str(Path(__file__).resolve().parent.parent / "suites" / "data" / "heldout_prompts.jsonl")


def test_grid_places_the_peer_after_ours_and_refuses_what_it_cannot_run():
    runs = decode_runs(dict(model=BUNDLED, max_new_tokens=8, repeats=1, warmup=0),
                       engines=("llamacpp", "ours"), specs=("none",))
    assert [r.engine for r in runs] == ["ours", "llamacpp"]
    assert [r.label for r in runs] == ["v3-none", "llamacpp-peer"]
    with pytest.raises(ValueError, match="plain greedy"):
        DecodeOptions.make(model=BUNDLED, engine="llamacpp", spec="mtp")
    with pytest.raises(ValueError, match="plain greedy"):
        decode_runs(dict(model=BUNDLED), engines=("llamacpp",), specs=("dflash2:7",))
    with pytest.raises(ValueError, match="engine must be one of"):
        DecodeOptions.make(model=BUNDLED, engine="vllm")
    with pytest.raises(ValueError, match="add --engine llamacpp"):
        decode_runs(dict(model=BUNDLED, llamacpp_flash_attn=True), engines=("ours",), specs=("none",))


def test_missing_llama_cpp_is_one_clear_line(monkeypatch):
    from ninfer_bench.suites import llamacpp_peer

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'ninfer-bench\[peers\]'"):
        llamacpp_peer.require_llama_cpp()


def test_llamacpp_beside_ours_on_the_bundled_model():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from ninfer_bench.suites.decode import run_matrix

    runs = decode_runs(dict(model=BUNDLED, prompt_file=HELDOUT, prompts=2, max_new_tokens=24, repeats=1, warmup=0,
                            device="cpu"), engines=("ours", "llamacpp"), specs=("none",))
    ours, peer = run_matrix(runs)
    assert peer["config"]["engine"] == "llamacpp" and peer["model"]["engine"] == "llama.cpp"
    assert peer["summary"]["decode_tok_s"] > 0 and peer["summary"]["completion_tokens"] == 48
    a = peer["summary"]["agreement"]
    assert a["reference"] == ours["label"] and a["prompts"] == 2 and len(a["per_prompt"]) == 2
    # the same weights: most teacher-forced positions agree and the distributions are close (not identical:
    # llama.cpp quantizes activations for its q8 products)
    assert a["top1_agreement"] >= 0.9
    assert 0 <= a["kl_mean"] < 0.05
    assert all(0 <= p["prefix_tokens"] <= 24 for p in a["per_prompt"])
    if peer["summary"]["tokens_sha256"] == ours["summary"]["tokens_sha256"]:
        assert a["prompts_equal_to_bar"] == 2
    assert peer["model"]["flash_attn"] is False  # the CPU default


def test_llamacpp_flash_attention_is_a_recorded_switch():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from ninfer_bench.suites.decode import run_matrix

    runs = decode_runs(dict(model=BUNDLED, prompt_file=HELDOUT, prompts=1, max_new_tokens=16, repeats=1, warmup=0,
                            device="cpu", llamacpp_flash_attn=True), engines=("ours", "llamacpp"), specs=("none",))
    _, peer = run_matrix(runs)
    assert peer["model"]["flash_attn"] is True and peer["config"]["llamacpp_flash_attn"] is True
    assert peer["summary"]["agreement"]["top1_agreement"] >= 0.9  # the same weights through its FA kernels


def test_agreement_counts_divergence_and_teacher_forcing():
    """agreement() on a stand-in peer whose logits are ours plus a known bias: the numbers follow by hand."""
    from ninfer_bench.suites.llamacpp_peer import agreement

    vocab = 5
    rng = np.random.default_rng(0)
    table = rng.normal(size=(64, vocab)).astype(np.float32)

    def ours_logits(ids, start):
        return table[start:len(ids)]

    class Peer:
        def path_logits(self, ids, start):
            out = table[start:len(ids)].copy()
            out[1, 0] += 100.0  # the second scored position prefers token 0 whatever ours says
            return out

    prompt = [1, 2, 3]
    mine = [int(table[2 + i].argmax()) for i in range(6)]
    theirs = mine[:4] + [(mine[4] + 1) % vocab, 0]
    a = agreement(Peer(), ours_logits, [prompt], [mine], [theirs], "v3-none")
    p = a["per_prompt"][0]
    assert p["prefix_tokens"] == 4
    assert p["top1_agreement"] == (5 + (mine[1] == 0)) / 6
    assert a["kl_max"] > 1.0 and a["kl_mean"] == pytest.approx(a["kl_max"] / 6, rel=1e-6)


def test_byte_tokenizer_export_loads_in_llama_cpp(tmp_path):
    """A preset's byte tokenizer (no merges) and tiled GDN value heads in every format: llama.cpp (in its worker
    process) loads the file, tokenizes text (UTF-8 and a special token) as our byte tokenizer does, and picks the
    same top token as ours at most positions of a prefill."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from test_gguf_export import _odd_model

    from ninfer_bench.engine.artifact.gguf_export import export_gguf
    from ninfer_bench.engine.runtime.engine import Engine
    from ninfer_bench.engine.runtime.options import EngineOptions
    from ninfer_bench.suites.llamacpp_peer import Worker

    loaded = _odd_model("mixed")
    export_gguf(loaded, tmp_path / "odd.gguf")
    worker = Worker(tmp_path)
    try:
        info = worker.call("load", path=str(tmp_path / "odd.gguf"), n_ctx=256, n_gpu_layers=0, n_threads=1)
        assert info["n_vocab"] == loaded.config.vocab_size
        text = "héllo wörld <|im_end|>"
        assert worker.call("tokenize", text=text)["ids"] == loaded.tokenizer.encode(text)
        ids = loaded.tokenizer.encode("def f(x):\n    return x * 2\n")
        worker.call("path_logits", ids=ids, start=0, out=str(tmp_path / "l.npy"))
        theirs = np.load(tmp_path / "l.npy")
        with pytest.raises(RuntimeError, match="unknown op"):
            worker.call("__init__")
    finally:
        worker.close()
    ours = Engine(loaded, EngineOptions(device="cpu")).logits(ids).numpy()
    assert theirs.shape == ours.shape
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


def test_same_weights_spots_another_models_file(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf_export import _odd_model

    from ninfer_bench.engine.artifact.gguf_export import export_gguf, same_weights
    from ninfer_bench.engine.artifact.loader import LoadedModel
    from ninfer_bench.engine.artifact.synthetic import synthetic_raws

    a = _odd_model("mixed")
    export_gguf(a, tmp_path / "a.gguf")
    assert same_weights(a, tmp_path / "a.gguf") is None
    other = LoadedModel(a.config, synthetic_raws(a.config, "mixed", seed=4), a.tokenizer, {})
    assert "other weights" in same_weights(other, tmp_path / "a.gguf")
    assert "not those" in same_weights(_odd_model("mixed", num_hidden_layers=8), tmp_path / "a.gguf")
    assert "is Q5_0" in same_weights(_odd_model("q4"), tmp_path / "a.gguf") or \
        "is Q8_0" in same_weights(_odd_model("q4"), tmp_path / "a.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not gguf")
    assert "not a GGUF file" in same_weights(a, tmp_path / "junk.gguf")
    with pytest.raises(ValueError, match="add --engine llamacpp"):
        decode_runs(dict(model=BUNDLED, llamacpp_gguf=str(tmp_path / "a.gguf")), engines=("ours",))
