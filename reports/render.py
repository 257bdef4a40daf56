"""Rendering the release-validation report's blocks: number formatting, Markdown, and one self-contained HTML page.

A block is ``("h2" | "h3" | "p", text)`` (a paragraph may add a tone: ``("p", text, "bad")``, shown as a coloured
box in HTML and in bold in Markdown), ``("table", Table)`` or ``("figure", name, caption)``; figures are PNG files by
name. All text is escaped.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field


@dataclass(slots=True)
class Table:
    columns: list[str]
    rows: list[list] = field(default_factory=list)  # a cell is text, or (text, tone) with tone good/bad/warn
    css: str = ""  # an HTML class of the table


# ---- formatting ----------------------------------------------------------------------------------------
def num(v, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def pct(v) -> str:
    return "-" if v is None or v != v else f"{v:.1%}"


def size(v) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def sha(v) -> str:
    return v[:12] if isinstance(v, str) else "-"


def value_text(v) -> str:
    """A config or environment value as a table cell (never a Python repr): lists joined with commas, objects as
    ``key=value``, null as "-", numbers as written."""
    if isinstance(v, (list, tuple)):
        return ", ".join(value_text(x) for x in v) if v else "(none)"
    if isinstance(v, dict):
        return ", ".join(f"{k}={value_text(x)}" for k, x in v.items()) if v else "(none)"
    if isinstance(v, float) and v == v:
        return f"{v:g}"
    return num(v)


def numbers(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and v == v for v in values)


# ---- rendering -----------------------------------------------------------------------------------------
def _cell(cell) -> tuple[str, str]:
    return (str(cell[0]), cell[1]) if isinstance(cell, tuple) else (str(cell), "")


def _md_text(text: str) -> str:
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
            .replace("\n", " "))


def markdown(title: str, blocks, figures) -> str:
    out = [f"# {_md_text(title)}", ""]
    for kind, *body in blocks:
        if kind in ("h2", "h3"):
            out += [f"{'#' * int(kind[1])} {_md_text(body[0])}", ""]
        elif kind == "p":
            bold = len(body) > 1 and body[1] in ("good", "bad", "warn")
            out += [f"**{_md_text(body[0])}**" if bold else _md_text(body[0]), ""]
        elif kind == "table":
            t = body[0]
            out.append("| " + " | ".join(_md_text(c) for c in t.columns) + " |")
            out.append("|" + "---|" * len(t.columns))
            out += ["| " + " | ".join(_md_text(_cell(c)[0]) for c in row) + " |" for row in t.rows]
            out.append("")
        elif kind == "figure":
            name, caption = body
            out += [f"![{_md_text(caption)}]({figures[name].name})", ""]
    return "\n".join(out)


_CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:1em auto;max-width:1400px;padding:0 1em;color:#222}
h1{font-size:22px;margin:.3em 0 .4em}table{border-collapse:collapse;margin:.5em 0 1.1em;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 7px;vertical-align:top}th{background:#f3f3f3;text-align:left}
td{font-variant-numeric:tabular-nums}.good{background:#e3f4e1}.bad{background:#fadbd8}.warn{background:#fdf2d0}
p.good,p.bad,p.warn{padding:6px 10px;font-weight:600;border-radius:3px}figure{margin:1em 0}img{max-width:100%}
figcaption{color:#555;font-size:12px}h2{border-bottom:1px solid #ddd;margin-top:1.6em}
p.note{color:#555;font-size:12px}table.verdict td:nth-child(-n+3){white-space:nowrap}"""


def html_page(title: str, blocks, figures) -> str:
    esc = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{esc(title)}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{esc(title)}</h1>"]
    for kind, *body in blocks:
        if kind == "p" and len(body) > 1 and body[1]:
            out.append(f'<p class="{esc(body[1])}">{esc(str(body[0]))}</p>')
        elif kind in ("h2", "h3", "p"):
            out.append(f"<{kind}>{esc(str(body[0]))}</{kind}>")
        elif kind == "table":
            t = body[0]
            css = f' class="{esc(t.css)}"' if t.css else ""
            out.append(f"<table{css}><thead><tr>" + "".join(f"<th>{esc(c)}</th>" for c in t.columns)
                       + "</tr></thead><tbody>")
            for row in t.rows:
                cells = [_cell(c) for c in row]
                out.append("<tr>" + "".join(f'<td class="{tone}">{esc(text)}</td>' if tone else f"<td>{esc(text)}</td>"
                                            for text, tone in cells) + "</tr>")
            out.append("</tbody></table>")
        elif kind == "figure":
            name, caption = body
            data = base64.b64encode(figures[name].read_bytes()).decode("ascii")
            out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{esc(caption)}">'
                       f"<figcaption>{esc(caption)}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out)
