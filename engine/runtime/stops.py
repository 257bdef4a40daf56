"""When a sequence ends, and its text: end and stop ids, stop strings, the length limit.

The text leaves control ids out (end tokens and the tokenizer's special tokens: chat markers, the mask), and stop
strings are matched in that text, as servers do by default (vLLM's ``skip_special_tokens``): the server's stream
and the engine's own check agree.
"""

from __future__ import annotations

from ..sampling import SamplingParams
from .sequence import Sequence


class StopRule:
    """The stop checks of one tokenizer (:meth:`finish` after every new token)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.control_ids = frozenset(tokenizer.eos_ids) | frozenset(tokenizer.special_ids)

    def text(self, ids) -> str:
        """The text of generated ids: control ids left out."""
        return self.tokenizer.decode([t for t in ids if t not in self.control_ids])

    def stop_ids(self, p: SamplingParams) -> set[int]:
        """Token ids that end a request: its stop ids, and EOS unless it ignores EOS."""
        return set(p.stop_token_ids) | set(() if p.ignore_eos else self.tokenizer.eos_ids)

    def finish(self, seq: Sequence) -> bool:
        """Set ``finish_reason`` when ``seq`` must stop after its newest token (``seq.text``: the text cut before
        the stop string that ended it)."""
        p, tok = seq.params, seq.tokens[-1]
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tokenizer.eos_ids):
            seq.finish_reason = "stop"
        elif p.stop:
            tail = self.tail(seq.tokens, max(map(len, p.stop)))
            if any(stop in tail for stop in p.stop):
                text = self.text(seq.tokens)
                cut = min(text.index(stop) for stop in p.stop if stop in text)
                seq.text = text[:cut]
                seq.finish_reason = "stop"
        if seq.finish_reason is None and len(seq.tokens) >= p.max_new_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def tail(self, tokens: list[int], longest: int) -> str:
        """The decoded end of ``tokens`` that holds any stop string of up to ``longest`` characters ending in the
        newest token (the whole text is decoded only on a hit): 4 * longest + 1 tokens before the newest one (>= 1
        byte a token, <= 4 bytes a character), more while those decode to too few characters - ids that are no
        text: control ids, a byte tokenizer's unnamed ids, a padded vocabulary's. The margin of 5 covers the
        replacement characters of a character cut at either end."""
        n = 4 * longest + 2
        tail = self.text(tokens[-n:])
        newest = len(self.text(tokens[-1:]))
        while n < len(tokens) and len(tail) - newest < longest + 5:
            n *= 2
            tail = self.text(tokens[-n:])
        return tail
