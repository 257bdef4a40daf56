"""The tokenizer (byte-level BPE with Qwen-style specials) and the token streams it makes of the corpus.

Specials come first, so their ids are fixed: ``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2,
``<|mask|>`` 3 (the DFlash block filler); the 256 byte tokens follow, then the merges. The training stream is
every training file's tokens followed by ``<|endoftext|>``, as uint16 (the vocabulary is below 65536). Corpus
text is encoded with special tokens treated as plain text: a source file that spells ``<|endoftext|>`` must
not end a document in the middle.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ninfer_bench.engine.artifact import draft_vocab
from ninfer_bench.engine.artifact.tokenizer import DEFAULT_CHAT_TEMPLATE, SPECIALS

EOT = "<|endoftext|>"
MASK = "<|mask|>"
ENCODE_BATCH = 512  # files per encode_batch call: bounds the memory of the Encoding objects


def train_tokenizer(texts: list[str], vocab_size: int, max_bytes: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` trained on ``texts``.

    When the texts exceed ``max_bytes`` an evenly spaced subset of them is used (deterministic)."""
    total = sum(len(t) for t in texts)
    step = max(1, -(-total // max_bytes))
    sample = texts[::step]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    for i, s in enumerate(SPECIALS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"tokenizer: special {s} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def tokenizer_config() -> dict:
    """``tokenizer_config.json``: end-of-text as eos and pad, the Qwen chat template."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "pad_token": EOT,
            "bos_token": None, "chat_template": DEFAULT_CHAT_TEMPLATE, "model_max_length": 131072,
            "additional_special_tokens": list(SPECIALS[1:])}


def save(tok, folder) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def load(folder):
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def encode_all(tok, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text (specials as plain text), multi-threaded in batches."""
    tok.encode_special_tokens = True
    try:
        out = []
        for i in range(0, len(texts), ENCODE_BATCH):
            encs = tok.encode_batch_fast(texts[i:i + ENCODE_BATCH], add_special_tokens=False)
            out += [np.asarray(e.ids, dtype=np.uint16) for e in encs]
        return out
    finally:
        tok.encode_special_tokens = False


def stream(docs: list[np.ndarray], eot: int) -> np.ndarray:
    """Every document followed by ``eot``, as one uint16 array."""
    out = np.full(sum(len(d) + 1 for d in docs), eot, dtype=np.uint16)
    at = 0
    for d in docs:
        out[at:at + len(d)] = d
        at += len(d) + 1
    return out


def frequency_order(train_stream: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids sorted by count in the training stream, most frequent first (ties: lower id first), as
    ``convert --draft-vocab-corpus`` ranks a corpus."""
    return draft_vocab.frequency_order(np.bincount(train_stream, minlength=vocab_size))


def newline_mask(tok, vocab_size: int) -> np.ndarray:
    """Whether each token's text ends with a newline (cut points for retrieval samples)."""
    return np.array([tok.decode([i], skip_special_tokens=False).endswith("\n") for i in range(vocab_size)])
