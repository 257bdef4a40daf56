"""The retrieval format shared by the bundled model's training data and the NIAH suite.

A needle is one line of code binding a key to a 4-6 digit value; the question is the start of a line that
the value completes. The key sits between '["' and '"]' in both, so it tokenizes the same way in both places.
"""

from __future__ import annotations

NEEDLE_TEMPLATE = 'CONSTANTS["{key}"] = {value}\n'
QUESTION_TEMPLATE = 'assert CONSTANTS["{key}"] =='
ANSWER_TEMPLATE = " {value}\n"
KEY_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def needle_text(key: str, value: int) -> str:
    """The needle line (ends with a newline; insert it at the start of a line)."""
    return NEEDLE_TEMPLATE.format(key=key, value=value)


def question_text(key: str) -> str:
    """The question that ends a prompt (no trailing space: the answer's first token carries it)."""
    return QUESTION_TEMPLATE.format(key=key)


def answer_text(value: int) -> str:
    """What the model should write after the question."""
    return ANSWER_TEMPLATE.format(value=value)


def make_needle(rng) -> tuple[str, int]:
    """A random (key, value): key = a letter and 7 letters/digits, value = a 4-6 digit integer.

    ``rng`` is a ``numpy.random.Generator``."""
    key = KEY_ALPHABET[int(rng.integers(26))] + "".join(KEY_ALPHABET[int(i)] for i in rng.integers(36, size=7))
    digits = int(rng.integers(4, 7))
    return key, int(rng.integers(10 ** (digits - 1), 10 ** digits))
