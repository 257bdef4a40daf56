"""The --lm-head-draft vocabulary built from a corpus at conversion (engine/artifact/draft_vocab.py,
``convert --draft-vocab-corpus``)."""

import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from ninfer_bench.engine.artifact import draft_vocab

CODE = ("def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y\n\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n")


def _tokenizer_json(vocab: int) -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CODE] * 20, trainer)
    assert tok.get_vocab_size() <= vocab
    return tok.to_str().encode()


def _corpus(root):
    """A folder (a text file, a JSON-lines file of strings and objects, a binary file, a hidden file) and a file."""
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text(CODE)
    (root / "src" / "b.jsonl").write_text(json.dumps({"text": "x = 1\n"}) + "\n\n" + json.dumps("y = x + 2\n") + "\n")
    (root / "src" / "logo.bin").write_bytes(b"\xff\xfe\x00\x81")
    (root / "src" / ".hidden").write_text("zzzzzzzz")
    (root / "extra.txt").write_text("return self\n")
    return [root / "src", root / "extra.txt"], [CODE, "x = 1\n", "y = x + 2\n", "return self\n"]


def test_frequency_order():
    """Most frequent first; ties, unused ids among them, by id."""
    assert draft_vocab.frequency_order(np.array([3, 0, 5, 3, 0])).tolist() == [2, 0, 3, 1, 4]


def test_corpus_order_counts_the_corpus_with_the_models_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    tj = _tokenizer_json(280)
    paths, texts = _corpus(tmp_path)
    seen = []
    order, stats = draft_vocab.corpus_order(tj, 300, paths, batch=2, progress=lambda d, t, n: seen.append((d, t)))
    tok = Tokenizer.from_str(tj.decode())
    counts = Counter(i for t in texts for i in tok.encode(t, add_special_tokens=False).ids)
    want = sorted(range(300), key=lambda i: (-counts[i], i))
    assert order.tolist() == want and order.dtype == np.int64
    assert stats.tokens == sum(counts.values()) and stats.files == 3 and len(stats.skipped) == 1
    assert stats.skipped[0].endswith("logo.bin") and "skipped" in stats.describe()
    top = sum(c for _, c in counts.most_common(4096))
    assert stats.coverage == {} or stats.coverage[4096] == top / stats.tokens  # a 300-token vocabulary: none < 300
    assert seen and seen[-1][0] == seen[-1][1]  # the progress reached the corpus's size


@pytest.mark.parametrize("content,match", [("{not json\n", r"b.jsonl:1: not JSON"),
                                           ('{"code": "x"}\n', "a 'text' string")])
def test_a_bad_json_lines_corpus_is_named(tmp_path, content, match):
    (tmp_path / "b.jsonl").write_text(content)
    with pytest.raises(ValueError, match=match):
        draft_vocab.corpus_order(_tokenizer_json(280), 300, [tmp_path / "b.jsonl"])


def test_an_empty_or_missing_corpus_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no tokens in 1 files"):
        draft_vocab.corpus_order(_tokenizer_json(280), 300, [tmp_path / "empty.txt"])
    with pytest.raises(ValueError, match="no such file or folder"):
        draft_vocab.corpus_order(_tokenizer_json(280), 300, [tmp_path / "nowhere"])
    with pytest.raises(ValueError, match="not the model's"):  # a tokenizer with ids past the vocabulary
        draft_vocab.corpus_order(_tokenizer_json(280), 100, [tmp_path / "empty.txt"])


def test_convert_stores_the_ranking_for_lm_head_draft(tmp_path, hf_qwen35):
    """`convert --draft-vocab-corpus` writes draft_head.token_ids (the ranking corpus_order gives) and prints how much
    of the corpus the head sizes cover; a checkpoint without tokenizer.json is refused before anything is written."""
    from click.testing import CliRunner

    from ninfer_bench.cli import main
    from ninfer_bench.engine.artifact.reader import Artifact

    hf = tmp_path / "hf"
    shutil.copytree(hf_qwen35[0], hf)
    paths, _ = _corpus(tmp_path / "corpus")
    out = tmp_path / "m.ninfer"
    args = ["convert", str(hf), str(out), "--quant", "fp32", *[a for p in paths for a in ("--draft-vocab-corpus", p)]]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "has none" in r.output + r.stderr and not out.exists()
    tj = _tokenizer_json(280)
    (hf / "tokenizer.json").write_bytes(tj)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "draft vocabulary from" in r.output
    want, _ = draft_vocab.corpus_order(tj, 300, paths)
    with Artifact.open(out) as art:
        got = art.tensor(draft_vocab.TENSOR, torch.float32)
    assert got.to(torch.long).tolist() == want.tolist()
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0 and "draft vocabulary (--lm-head-draft): 300 ranked token ids" in r.output, r.output


def test_inspect_says_when_there_is_no_draft_vocabulary(tiny_artifact):
    from click.testing import CliRunner

    from ninfer_bench.cli import main

    r = CliRunner().invoke(main, ["inspect", str(tiny_artifact)])
    assert r.exit_code == 0 and "draft vocabulary (--lm-head-draft): none (convert with --draft-vocab-corpus" in r.output
