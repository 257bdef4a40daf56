"""An engine tokenizer written as a Hugging Face tokenizer folder (``export-tokenizer``): what
``transformers.AutoTokenizer.from_pretrained(DIR)`` loads with no network, giving the engine's ids and text.

The folder holds ``tokenizer.json`` (an artifact's own bytes, unchanged), ``tokenizer_config.json`` (the fast
tokenizer class that reads tokenizer.json as it is, the end / padding / beginning tokens, the chat template, no
clean-up of spaces on decode) and ``special_tokens_map.json``. Clients that tokenize for themselves -
lm-evaluation-harness's ``local-completions`` with ``tokenizer_backend=huggingface`` - then send the ids the
server's model was trained on.

A model without a tokenizer.json (the presets) has the engine's byte tokenizer: ids 0..255 are bytes, the specials
follow. It is written as the equivalent ``tokenizers`` byte-level BPE - the 256 byte characters as its vocabulary, no
merges, no splitting regex, the specials as added tokens - which encodes and decodes as the byte tokenizer does
(checked on every export). A byte tokenizer of fewer than 256 ids cannot encode every text, and is refused.

The engine adds no special tokens to a prompt; neither do these tokenizers' post-processors for the Qwen family, so
``tokenizer(text)`` and ``tokenizer(text, add_special_tokens=False)`` both give the engine's ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..model.config import PRESETS, preset
from .tokenizer import BYTE_CHARS, ByteTokenizer, Tokenizer

# texts the written tokenizer must encode and decode exactly as the engine's (specials, multi-byte characters,
# whitespace runs, a marker inside a word)
CHECK_TEXTS = ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
               "<|im_start|>user\nhé, 漢字 \U0001F600!<|im_end|>\n<|im_start|>assistant\n",
               "  \t\n\n   x<|endoftext|>y<|mask|>", "")


FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class TokenizerExportError(ValueError):
    """The tokenizer cannot be written as an exact Hugging Face tokenizer."""


@dataclass
class ExportedTokenizer:
    folder: Path
    files: list[str] = field(default_factory=list)
    kind: str = ""  # "tokenizer.json" (the artifact's own) or "byte" (the byte tokenizer's equivalent)
    vocab: int = 0  # ids the tokenizer has tokens for
    eos_token: str | None = None
    pad_token: str | None = None
    bos_token: str | None = None


def tokenizer_source(source: str | None) -> tuple[object, dict, bytes | None]:
    """(engine tokenizer, artifact metadata, the artifact's tokenizer.json bytes or None) of what ``--model`` names -
    an artifact path or a preset, the bundled model when None - without reading any weight."""
    from .loader import default_model, text_config, tokenizer_of
    from .reader import Artifact

    source = source or default_model()
    if source in PRESETS:
        return ByteTokenizer(preset(source).vocab_size), {}, None
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"no such model: {source!r} (an artifact path, or a preset: {', '.join(sorted(PRESETS))})")
    with Artifact.open(path) as art:
        cfg = text_config(art, path)
        meta = dict(art.metadata or {})
        name = meta.get("tokenizer")
        return tokenizer_of(art, cfg), meta, bytes(art.blob(name)) if name else None


def byte_tokenizer_json(tok: ByteTokenizer) -> str:
    """The ``tokenizers`` equivalent of the byte tokenizer, as tokenizer.json text."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if tok.vocab_size < 256:
        raise TokenizerExportError(f"the byte tokenizer of a {tok.vocab_size}-token vocabulary has no id for bytes "
                                   f"{tok.vocab_size}..255: no tokenizer.json refuses the same texts it does")
    hf = HFTokenizer(models.BPE(vocab={BYTE_CHARS[b]: b for b in range(256)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tok.specials.items(), key=lambda kv: kv[1])
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    got = {name: hf.token_to_id(name) for name, _ in specials}
    if got != dict(specials):  # (the specials are 256, 257, ... in order: the ids the library gives them)
        raise TokenizerExportError(f"the byte tokenizer's specials {dict(specials)} came out as {got}")
    return hf.to_str(pretty=True)


def check_equivalent(tok, data: str, texts=CHECK_TEXTS) -> None:
    """TokenizerExportError unless ``data`` (tokenizer.json text) encodes ``texts`` to ``tok``'s ids and decodes
    them back to ``tok``'s text (a byte tokenizer: its whole vocabulary too)."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(data)
    cases = [tok.encode(text) for text in texts]
    for text, want in zip(texts, cases):
        got = hf.encode(text, add_special_tokens=False).ids
        if got != want:
            raise TokenizerExportError(f"the written tokenizer encodes {text[:40]!r} as {got[:12]}..., the engine's "
                                       f"as {want[:12]}...")
    if isinstance(tok, ByteTokenizer):
        cases.append([*range(256), *tok.specials.values()])
    for ids in cases:
        if hf.decode(ids, skip_special_tokens=False) != tok.decode(ids):
            raise TokenizerExportError(f"the written tokenizer decodes {ids[:12]}... differently from the engine's")


def _known(tok, name: str) -> bool:
    return tok.token_to_id(name) is not None or (isinstance(tok, ByteTokenizer) and name in BYTE_CHARS)


def export_tokenizer(tok, folder: str | Path, meta: dict | None = None, data: bytes | None = None
                     ) -> ExportedTokenizer:
    """Write ``tok`` (an engine :class:`Tokenizer` or :class:`ByteTokenizer`) into ``folder`` (made when missing;
    the three files replaced when there). ``meta``: the artifact's metadata (its eos / pad / bos token names and chat
    template come before the tokenizer's own); ``data``: the artifact's tokenizer.json bytes, written unchanged."""
    meta = meta or {}
    if isinstance(tok, ByteTokenizer):
        text, kind = byte_tokenizer_json(tok), "byte"
    elif isinstance(tok, Tokenizer):
        text = data.decode("utf-8") if data is not None else tok.backend.to_str(pretty=True)
        kind = "tokenizer.json"
    else:
        raise TokenizerExportError(f"cannot export a {type(tok).__name__}")
    check_equivalent(tok, text)

    def named(key: str, default: str | None) -> str | None:
        name = meta.get(key)
        name = name if isinstance(name, str) and name else default
        if name is not None and not _known(tok, name):
            raise TokenizerExportError(f"the {key} {name!r} is not in the tokenizer's vocabulary")
        return name

    eos_ids = tuple(getattr(tok, "eos_ids", ()) or ())
    eos = named("eos_token", tok.id_to_token(eos_ids[0]) if eos_ids else None)
    pad, bos = named("pad_token", eos), named("bos_token", None)
    template = meta.get("chat_template") if isinstance(meta.get("chat_template"), str) else tok.chat_template
    # PreTrainedTokenizerFast reads tokenizer.json as it is (a model's own class may rebuild the pipeline by its
    # rules); no special tokens added, no spaces cleaned up on decode: the engine does neither
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
              "unk_token": None, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"],
              "chat_template": template}
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)) if v is not None}
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise TokenizerExportError(f"{folder} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    files = dict(zip(FILES, (text, json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                             json.dumps(specials, indent=2, ensure_ascii=False) + "\n")))
    for name, content in files.items():
        tmp = folder / f".{name}.tmp"
        tmp.write_text(content, encoding="utf-8")
        tmp.replace(folder / name)
    vocab = 256 + len(tok.specials) if isinstance(tok, ByteTokenizer) else tok.backend.get_vocab_size()
    return ExportedTokenizer(folder, list(files), kind, vocab, eos, pad, bos)
