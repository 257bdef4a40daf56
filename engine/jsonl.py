"""JSON-lines text read line by line, with the place of a bad line in the error."""

from __future__ import annotations

import json
from collections.abc import Iterator


def json_lines(text: str, where: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line of ``text``; a line that is not JSON is refused as
    ``where:line: not JSON (...)``."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}:{n}: not JSON ({e.msg})") from None
