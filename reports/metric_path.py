"""Metric paths: how a gate rule names a value inside a result document.

::

    decode_tok_s                              summary["decode_tok_s"]
    samples.decode_tok_s                      summary["samples"]["decode_tok_s"]
    levels[concurrency=4].aggregate_tok_s     the element of summary["levels"] whose concurrency is 4
    levels[0].aggregate_tok_s                 by position
    records[op=rmsnorm,variant=v3,t=1].us_median
                                              ``records`` means the document's records (the summary has none)
    levels[concurrency=*].aggregate_tok_s     a wildcard: :func:`instances` lists the concrete paths

Selector values compare as text (a list such as a shape is written ``1x48x128``); a value holding ``,``, ``]``,
``=``, ``"``, ``.`` or a space is written as a JSON string (``shape="B=1, T=7"``).
"""

from __future__ import annotations

import json

STAR = object()  # a wildcard selector value


def _split(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets and double quotes."""
    parts, cur, depth, quoted, escaped = [], [], 0, False, False
    for ch in text:
        if quoted:
            quoted = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            quoted = True
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if quoted or depth:
        raise ValueError(f"metric path {text!r}: unbalanced {'quote' if quoted else 'brackets'}")
    parts.append("".join(cur))
    return parts


def parse_path(path: str) -> tuple:
    """``"levels[concurrency=4].x"`` -> ``(("levels", (("concurrency", "4"),)), ("x", None))``; a selector is
    None, an int (position) or a tuple of (key, text value or STAR)."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"metric path must be a non-empty string, got {path!r}")
    segs = []
    for part in _split(path, "."):
        name, bracket, rest = part.partition("[")
        if not name or (bracket and not rest.endswith("]")) or "]" in name:
            raise ValueError(f"metric path {path!r}: bad segment {part!r} (expected name or name[selector])")
        if not bracket:
            segs.append((name, None))
            continue
        body = rest[:-1].strip()
        if body.lstrip("-").isdigit():
            segs.append((name, int(body)))
            continue
        conds = []
        for cond in _split(body, ","):
            key, eq, value = cond.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise ValueError(f"metric path {path!r}: bad selector {cond!r} (expected key=value)")
            conds.append((key, STAR if value == "*" else json.loads(value) if value.startswith('"') else value))
        segs.append((name, tuple(conds)))
    return tuple(segs)


def key_text(value) -> str:
    """How a selector sees a value: lists as ``1x48x128``, everything else as ``str``."""
    if isinstance(value, (list, tuple)):
        return "x".join(key_text(v) for v in value)
    return str(value)


def _value_text(v) -> str:
    if v is STAR:
        return "*"
    return json.dumps(v) if not v or any(c in v for c in ',]=". ') else v


def format_path(segs) -> str:
    """The text of a parsed path (the inverse of :func:`parse_path`)."""
    out = []
    for name, sel in segs:
        if sel is None:
            out.append(name)
        elif isinstance(sel, int):
            out.append(f"{name}[{sel}]")
        else:
            out.append(f"{name}[{','.join(f'{k}={_value_text(v)}' for k, v in sel)}]")
    return ".".join(out)


class MetricMissing(KeyError):
    """A metric path that does not resolve in a document; the message says where it stopped."""

    def __str__(self) -> str:
        return self.args[0]


def root(doc: dict) -> dict:
    """What a path starts from: the summary, with the document's records under ``records``."""
    start = dict(doc["summary"])
    start.setdefault("records", doc["records"])
    return start


def _matches(item, sel) -> bool:
    return isinstance(item, dict) and all(v is STAR or key_text(item.get(k)) == v for k, v in sel)


def _step(node, name: str, sel):
    if not isinstance(node, dict) or name not in node:
        raise MetricMissing(f"no {name!r}")
    child = node[name]
    if sel is None:
        return child
    if not isinstance(child, list):
        raise MetricMissing(f"{name!r} is not a list")
    if isinstance(sel, int):
        if not -len(child) <= sel < len(child):
            raise MetricMissing(f"{name}[{sel}] is out of range ({len(child)} items)")
        return child[sel]
    found = [item for item in child if _matches(item, sel)]
    if len(found) != 1:
        what = format_path([(name, sel)])
        raise MetricMissing(f"no {what}" if not found else f"{len(found)} items match {what}")
    return found[0]


def lookup(doc: dict, path: str):
    """The value at ``path`` in a result document; raises :class:`MetricMissing` naming what is absent."""
    node = root(doc)
    for name, sel in parse_path(path):
        node = _step(node, name, sel)
    return node


def instances(node, segs, prefix=()):
    """Concrete segment lists for ``segs`` in ``node``: wildcards replaced by the values found there."""
    if not segs:
        yield prefix
        return
    (name, sel), rest = segs[0], segs[1:]
    if not isinstance(sel, tuple) or not any(v is STAR for _, v in sel):
        try:
            child = _step(node, name, sel)
        except MetricMissing:
            yield prefix + tuple(segs)  # left for lookup() to report
            return
        yield from instances(child, rest, prefix + (segs[0],))
        return
    items = node.get(name) if isinstance(node, dict) else None
    for item in items if isinstance(items, list) else []:
        if _matches(item, sel):
            concrete = tuple((k, key_text(item.get(k)) if v is STAR else v) for k, v in sel)
            yield from instances(item, rest, prefix + ((name, concrete),))


def stars(segs) -> set:
    """The (list name, key) pairs a parsed path has wildcards for."""
    return {(name, k) for name, sel in segs if isinstance(sel, tuple) for k, v in sel if v is STAR}


def substitute(path: str, concrete) -> str:
    """``path`` with its wildcards filled in from a concrete segment list of :func:`instances` (how a rule's
    samples path follows its metric: ``levels[concurrency=*].samples.x`` -> ``levels[concurrency=4].samples.x``)."""
    binding = {(name, k): v for name, sel in concrete if isinstance(sel, tuple) for k, v in sel}
    return format_path([(name, tuple((k, binding.get((name, k), STAR) if v is STAR else v) for k, v in sel)
                         if isinstance(sel, tuple) else sel) for name, sel in parse_path(path)])
