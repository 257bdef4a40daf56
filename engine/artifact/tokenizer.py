"""Tokenizer and chat template of an artifact.

Artifacts carry ``tokenizer.json`` (read with the ``tokenizers`` library) and the chat template (Jinja,
rendered with jinja2 the way Hugging Face does). Presets without a tokenizer get :class:`ByteTokenizer`,
which maps bytes to ids 0..255 and puts the specials right after them.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")

# The Qwen chat template for plain text turns (used when an artifact ships none).
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template the engine needs."""

    backend: object
    eos_ids: tuple[int, ...]
    chat_template: str = DEFAULT_CHAT_TEMPLATE

    @classmethod
    def from_json(cls, data: bytes, vocab_size: int, *, eos_tokens=(), chat_template: str | None = None
                  ) -> "Tokenizer":
        """The tokenizer of ``tokenizer.json`` bytes, checked against the model's vocabulary
        (:func:`load_tokenizer_json`: ValueError when it does not load or does not fit)."""
        backend = load_tokenizer_json(data, vocab_size)
        eos = []
        for tok in list(eos_tokens) + ["<|endoftext|>", "<|im_end|>"]:
            tid = backend.token_to_id(tok)
            if tid is not None and tid not in eos:
                eos.append(tid)
        return cls(backend, tuple(eos), chat_template or DEFAULT_CHAT_TEMPLATE)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        """The vocabulary string of ``tid`` (byte-level BPE: ``Ġ`` for a space, as Hugging Face's
        ``convert_ids_to_tokens``); None for an id the tokenizer has no token for."""
        return self.backend.id_to_token(tid)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (chat markers, end tokens, the mask): control, not text."""
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (dicts with role and content) with the artifact's template."""
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token="", eos_token="")


def load_tokenizer_json(data: bytes, vocab_size: int):
    """The ``tokenizers.Tokenizer`` of ``tokenizer.json`` bytes; ValueError when they do not load or name a token id
    the model's vocabulary (``vocab_size`` embedding rows) does not have. Fewer ids than rows is common (padded
    vocabularies)."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_str(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"the tokenizer is not UTF-8 text (byte {e.start})") from None
    except Exception as e:  # tokenizers raises its own exception type
        raise ValueError(f"the tokenizer does not load ({e})") from None
    top = max(backend.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise ValueError(f"the tokenizer has token ids up to {top}, but the model's vocabulary has {vocab_size} "
                         f"(ids 0..{vocab_size - 1}): this tokenizer is not the model's")
    return backend


def _raise(message):
    raise ValueError(message)


def _byte_chars() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet: byte b -> a printable character (byte-level BPE vocabularies are written in it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = iter(range(256, 512))
    return tuple(chr(b) if b in keep else chr(next(shifted)) for b in range(256))


BYTE_CHARS = _byte_chars()


class ByteTokenizer:
    """Bytes as ids 0..255, specials from 256; for presets and models without a tokenizer."""

    def __init__(self, vocab_size: int, eos_ids: tuple[int, ...] | None = None):
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"byte tokenizer needs a vocabulary of at least one token, got {vocab_size!r}")
        self._vocab = vocab_size
        # the specials that fit (a vocabulary under 260 has fewer; under 256 not every byte has an id either)
        self.specials = {tok: 256 + i for i, tok in enumerate(SPECIALS) if 256 + i < vocab_size}
        default = tuple(self.specials[t] for t in ("<|endoftext|>", "<|im_end|>") if t in self.specials)
        self.eos_ids = tuple(eos_ids) if eos_ids is not None else default
        self.chat_template = DEFAULT_CHAT_TEMPLATE

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for tok, tid in self.specials.items():
                if text.startswith(tok, i):
                    ids.append(tid)
                    i += len(tok)
                    break
            else:
                j = i
                while j < len(text) and not any(text.startswith(t, j) for t in self.specials):
                    j += 1
                ids += list(text[i:j].encode("utf-8"))
                i = j
        if self._vocab < 256 and any(t >= self._vocab for t in ids):
            bad = next(t for t in ids if t >= self._vocab)
            raise ValueError(f"byte {bad} of the text has no id in this model's {self._vocab}-token vocabulary "
                             "(the model ships no tokenizer: pass token ids)")
        return ids

    def decode(self, ids) -> str:
        out, buf = [], bytearray()
        names = {v: k for k, v in self.specials.items()}
        for t in ids:
            t = int(t)
            if t < 256:
                buf.append(t)
                continue
            if t not in names:  # an id with no token is no text, and does not split the bytes around it
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(names[t])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        return self.specials.get(token)

    def id_to_token(self, tid: int) -> str | None:
        """A byte's byte-level character (GPT-2's table, what the exported tokenizer.json names it), a special's
        name; None for an id with no token."""
        if 0 <= tid < min(256, self._vocab):
            return BYTE_CHARS[tid]
        return next((tok for tok, i in self.specials.items() if i == tid), None)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.specials.values())

    apply_chat_template = Tokenizer.apply_chat_template
