"""``export-tokenizer``: the engine's tokenizer as a folder transformers' AutoTokenizer loads offline, giving the
engine's ids, text, special tokens and chat template - the bundled model's tokenizer.json, and the presets' byte
tokenizer rebuilt as a byte-level BPE."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")

from ninfer_bench.cli import main  # noqa: E402
from ninfer_bench.engine.artifact.loader import bundled_model_path  # noqa: E402
from ninfer_bench.engine.artifact.reader import Artifact  # noqa: E402
from ninfer_bench.engine.artifact.tokenizer import BYTE_CHARS, ByteTokenizer  # noqa: E402
from ninfer_bench.engine.artifact.tokenizer_export import (  # noqa: E402
    TokenizerExportError,
    check_equivalent,
    export_tokenizer,
    tokenizer_source,
)

TEXTS = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", "  \t\n\n  x  y\u00a0z",
         "<|im_start|>user\nh\u00e9 \u6f22\u5b57 \U0001F600<|im_end|>\n<|im_start|>assistant\n",
         "a<|endoftext|>b<|mask|><|im_end|><|notaspecial|>", "\u0120\u010a byte-level lookalikes", ""]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <there>"},
            {"role": "assistant", "content": "ok"}]


def random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = ["a", "b", " ", "  ", "\n", "\t", "\u00e9", "\u6f22", "\U0001F600", "<|im_end|>", "<|endoftext|>",
                "<|im_start|>", "<|mask|>", "<|", "|>", "def", "(", ")", "\u0120", "\r\n", "'s", "123"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(n)]


def load(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local folder: nothing may be fetched
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def check_same(hf, tok, texts) -> None:
    for text in texts:
        ids = tok.encode(text)
        assert hf(text)["input_ids"] == ids, text  # the default (add_special_tokens) adds nothing either
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.decode(ids) == tok.decode(ids), text
        assert hf.convert_ids_to_tokens(ids) == [tok.id_to_token(i) for i in ids], text


@pytest.mark.skipif(bundled_model_path() is None, reason="no bundled model in this checkout")
def test_the_bundled_models_tokenizer_loads_offline_and_matches(tmp_path, monkeypatch):
    """The CLI writes the three files; tokenizer.json is the artifact's own bytes; AutoTokenizer gives the engine's
    ids, text and token strings, its end / padding tokens, no beginning token, and the same chat rendering."""
    out = tmp_path / "tok"
    r = CliRunner().invoke(main, ["export-tokenizer", str(bundled_model_path()), str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    with Artifact.open(bundled_model_path()) as art:
        assert (out / "tokenizer.json").read_bytes() == bytes(art.blob(art.metadata["tokenizer"]))
        template = art.metadata["chat_template"]
    tok, meta, _ = tokenizer_source(str(bundled_model_path()))
    hf = load(out, monkeypatch)
    check_same(hf, tok, TEXTS + random_texts(0, 300))
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id in tok.eos_ids and hf.pad_token == "<|endoftext|>"
    assert hf.bos_token is None
    assert hf.chat_template == template
    for gen in (True, False):
        assert hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen) == \
            tok.apply_chat_template(MESSAGES, add_generation_prompt=gen)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["clean_up_tokenization_spaces"] is False and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    # again into the same folder: the files are replaced, and said so
    r = CliRunner().invoke(main, ["export-tokenizer", str(bundled_model_path()), str(out)])
    assert r.exit_code == 0 and "replaced tokenizer.json" in r.output, r.output


def test_the_byte_tokenizer_is_written_as_an_exact_byte_level_bpe(tmp_path, monkeypatch):
    """A preset (no tokenizer.json): the byte tokenizer as byte-level BPE - every byte its own id, the specials after
    them - encoding and decoding as the engine does, broken UTF-8 and unnamed ids included."""
    out = tmp_path / "tiny"
    r = CliRunner().invoke(main, ["export-tokenizer", "tiny", str(out)])
    assert r.exit_code == 0 and "byte tokenizer" in r.output, r.output
    tok, _, _ = tokenizer_source("tiny")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 512
    hf = load(out, monkeypatch)
    check_same(hf, tok, TEXTS + random_texts(1, 300))
    assert hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]) == [256, 257, 258,
                                                                                                   259]
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == 256 and hf.pad_token_id == 256
    rng = random.Random(2)
    for _ in range(300):  # any ids, lone continuation bytes and cut characters too (ids 260..511 have no token)
        ids = [rng.randrange(0, 512) for _ in range(rng.randint(0, 16))]
        assert hf.decode(ids) == tok.decode(ids), ids
    assert tok.decode([0xE6, 300, 0xBC, 0xA2]) == "\u6f22"  # an unnamed id splits no character
    assert [tok.id_to_token(i) for i in (32, 97, 10, 258, 300)] == ["\u0120", "a", "\u010a", "<|im_end|>", None]
    assert len(set(BYTE_CHARS)) == 256


def test_what_cannot_be_exported_exactly_is_refused(tmp_path):
    """A byte tokenizer without an id for every byte; an end token named by the metadata that the tokenizer does not
    have; a written tokenizer that does not encode as the engine does; an output path that is a file."""
    with pytest.raises(TokenizerExportError, match="no id for bytes 200..255"):
        export_tokenizer(ByteTokenizer(200), tmp_path / "a")
    with pytest.raises(TokenizerExportError, match="eos_token '<\\|eot\\|>' is not in the tokenizer"):
        export_tokenizer(ByteTokenizer(300), tmp_path / "b", {"eos_token": "<|eot|>"})
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    other = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).to_str()
    with pytest.raises(TokenizerExportError, match="encodes"):
        check_equivalent(ByteTokenizer(300), other)
    (tmp_path / "file").write_text("x")
    r = CliRunner().invoke(main, ["export-tokenizer", "tiny", str(tmp_path / "file")])
    assert r.exit_code != 0 and "file" in r.output
    r = CliRunner().invoke(main, ["export-tokenizer", "no-such-model", str(tmp_path / "c")])
    assert r.exit_code == 1 and "no such model" in r.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
