"""The training corpus: the Python source of the running interpreter, split, attributed, and the needle format.

Sources: the standard library (``sysconfig`` ``stdlib``, without its nested site-packages) and every
site-packages directory of this interpreter, walked in sorted path order. Kept: ``*.py`` files of 200 B to
200 KB that decode as UTF-8. Duplicates (same SHA-256 of the normalized text: newlines unified, trailing
whitespace and surrounding blank lines dropped) keep their first path. A file is held out for evaluation when
its hash is 0 modulo ``holdout_mod`` (50: about 2%), so the split depends on content only.

Licences gate what is used: files of distributions whose licence is unknown or proprietary (e.g. some NVIDIA
wheels) are left out of the corpus; the held-out prompts, which ship verbatim, come only from permissively
licensed distributions (no copyleft).

The retrieval format (needle, question, answer) lives here too: the training mixes in samples made with it
and the NIAH suite builds its haystacks with the same functions, so the model is asked what it was taught.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import site
import sysconfig
from collections import Counter, defaultdict
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path

# the retrieval format is the NIAH suite's (re-exported here for the other stages)
from ninfer_bench.suites.needle import answer_text, make_needle, needle_text, question_text  # noqa: F401

MIN_BYTES, MAX_BYTES = 200, 200_000
STDLIB = "python-stdlib"
STDLIB_LICENSE = "PSF-2.0"
UNATTRIBUTED = "unattributed"
PERMISSIVE = re.compile(r"\bmit\b|\bbsd|apache|\bpsf|python software foundation|\bisc\b|zlib|unlicense|\bcc0|hpnd|cnri")
COPYLEFT = re.compile(r"\b[al]?gpl|\bmpl\b|mozilla|\bepl\b|eclipse public|\bcddl\b|\beupl\b|\bosl\b|cc-by-sa")
CLOSED = re.compile(r"proprietary|commercial|\beula\b|^unknown$|other/")

def build_haystack(filler_ids: list[int], decode, n_tokens: int, depth: float, key: str, value: int,
                   encode) -> str:
    """A prompt of about ``n_tokens`` tokens: code from ``filler_ids`` (cycled if short), the needle at the line
    nearest ``depth`` (0 = first line, 1 = last), and the question at the end."""
    reserve = len(encode(needle_text(key, value))) + len(encode("\n" + question_text(key)))
    budget = max(1, n_tokens - reserve)
    ids = list(filler_ids)
    while len(ids) < budget:
        ids += filler_ids
    lines = decode(ids[:budget]).split("\n")[:-1]  # drop the cut-off last line
    at = round(depth * len(lines))
    text = "\n".join(lines[:at]) + ("\n" if at else "") + needle_text(key, value) + "\n".join(lines[at:])
    return text.rstrip("\n") + "\n" + question_text(key)


# ---- source files ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class SourceFile:
    """One kept file: its path relative to its root, the distribution it ships in, its content hash and text."""

    rel: str
    origin: str
    sha256: str
    text: str

    def to_json(self) -> str:
        return json.dumps({"rel": self.rel, "origin": self.origin, "sha256": self.sha256, "text": self.text})

    @classmethod
    def from_json(cls, line: str) -> "SourceFile":
        return cls(**json.loads(line))


def source_roots() -> list[tuple[str, Path]]:
    """(kind, directory) of the standard library and every site-packages directory, in a fixed order."""
    paths = sysconfig.get_paths()
    sites = set(site.getsitepackages()) | {paths["purelib"], paths["platlib"]}
    roots = [("stdlib", Path(paths["stdlib"]))]
    roots += [("site", Path(p)) for p in sorted(sites) if Path(p).is_dir()]
    return roots


def list_files(roots, max_files: int | None = None) -> list[tuple[str, Path, Path]]:
    """(kind, root, path) of candidate ``.py`` files, sorted by path within each root."""
    out = []
    for kind, root in roots:
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__"
                             and not (kind == "stdlib" and x in ("site-packages", "dist-packages")))
            for name in sorted(files):
                p = Path(d) / name
                if name.endswith(".py") and p.is_file() and not p.is_symlink() \
                        and MIN_BYTES <= p.stat().st_size <= MAX_BYTES:
                    out.append((kind, root, p))
                    if max_files is not None and len(out) >= max_files:
                        return out
    return out


def normalize(text: str) -> str:
    """The text that dedupe hashes: unified newlines, no trailing whitespace, no surrounding blank lines."""
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def _read(path: Path) -> tuple[str, str] | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return hashlib.sha256(normalize(text).encode()).hexdigest(), text


def attribution(roots) -> tuple[dict[str, str], dict[str, dict]]:
    """(absolute file path -> distribution name, distribution name -> {version, license}) from RECORD files."""
    from importlib import metadata

    owner, dists = {}, {}
    for kind, root in roots:
        if kind != "site":
            continue
        for dist in metadata.distributions(path=[str(root)]):
            name = dist.metadata["Name"] or "?"
            dists[name] = {"version": dist.version, "license": license_of(dist.metadata)}
            for f in dist.files or ():
                owner[os.path.normpath(os.path.join(root, str(f)))] = name
    return owner, dists


def license_of(meta) -> str:
    """A distribution's licence from its METADATA: License-Expression, else classifiers, else License."""
    expr = meta.get("License-Expression")
    if expr:
        return expr.strip()
    classes = [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    if classes:
        return " / ".join(sorted(set(classes)))
    text = (meta.get("License") or "").strip()
    if text and text.upper() != "UNKNOWN":
        first = text.splitlines()[0].strip()
        return first if len(first) <= 60 else first[:57] + "..."
    return "unknown"


def collect(max_files: int | None = None, workers: int = 16, roots=None) -> tuple[list[SourceFile], dict]:
    """Every kept, de-duplicated source file in path order, and the distribution table for the licence note."""
    roots = roots if roots is not None else source_roots()
    cands = list_files(roots, max_files)
    with Pool(max(1, min(workers, os.cpu_count() or 1))) as pool:
        read = pool.map(_read, [p for _, _, p in cands], chunksize=64)
    owner, dists = attribution(roots)
    dists[STDLIB] = {"version": sysconfig.get_python_version(), "license": STDLIB_LICENSE}
    dists[UNATTRIBUTED] = {"version": "", "license": "unknown"}
    seen, files = set(), []
    for (kind, root, path), got in zip(cands, read):
        if got is None or got[0] in seen:
            continue
        seen.add(got[0])
        origin = STDLIB if kind == "stdlib" else owner.get(os.path.normpath(str(path)), UNATTRIBUTED)
        if trainable(dists[origin]["license"]):
            files.append(SourceFile(str(path.relative_to(root)), origin, got[0], got[1]))
        else:
            dists[origin]["excluded_files"] = dists[origin].get("excluded_files", 0) + 1
    return files, dists


def trainable(licence: str) -> bool:
    """Whether a distribution's files may be trained on: a known licence that is not proprietary."""
    return not CLOSED.search(licence.lower())


def permissive(licence: str) -> bool:
    """Whether verbatim excerpts may ship in this Apache-2.0 repository: permissive and no copyleft part."""
    lic = licence.lower()
    return bool(PERMISSIVE.search(lic)) and not COPYLEFT.search(lic) and not CLOSED.search(lic)


def is_heldout(f: SourceFile, holdout_mod: int) -> bool:
    return int(f.sha256, 16) % holdout_mod == 0


def tally(files: list[SourceFile], key) -> list[tuple[str, int, int]]:
    """(key, files, bytes) per value of ``key(file)``, most bytes first."""
    acc = defaultdict(lambda: [0, 0])
    for f in files:
        entry = acc[key(f)]
        entry[0] += 1
        entry[1] += len(f.text.encode())
    return sorted(((k, n, b) for k, (n, b) in acc.items()), key=lambda x: (-x[2], x[0]))


def by_licence(files: list[SourceFile], dists: dict) -> list[tuple[str, int, int]]:
    return tally(files, lambda f: dists.get(f.origin, {}).get("license", "unknown"))


def licence_note(files: list[SourceFile], dists: dict) -> str:
    """``corpus_LICENSES.md``: which distributions the corpus came from, under which licences, how much of each."""
    lines = ["# Corpus licences of the bundled model", "",
             "The bundled model (`models/ninfer-code-small.ninfer`) was trained on the Python source files "
             "installed with the interpreter that built it: its standard library and its site-packages. "
             "The files themselves are not redistributed; the held-out evaluation prompts "
             "(`suites/data/heldout_prompts.jsonl`) are verbatim excerpts of permissively licensed files and each "
             "names its source distribution and licence. Licences below are read from each distribution's "
             "METADATA (License-Expression, License classifiers, or the License field).", "",
             f"Files: {len(files)} (after de-duplication), {sum(len(f.text.encode()) for f in files):,} bytes.", "",
             "## By licence", "", "| licence | files | bytes |", "|---|---:|---:|"]
    lines += [f"| {lic} | {n} | {b:,} |" for lic, n, b in by_licence(files, dists)]
    lines += ["", "## By distribution", "", "| distribution | version | licence | files | bytes |",
              "|---|---|---|---:|---:|"]
    for dist, n, b in tally(files, lambda f: f.origin):
        info = dists.get(dist, {})
        lines.append(f"| {dist} | {info.get('version', '')} | {info.get('license', 'unknown')} | {n} | {b:,} |")
    left = {k: v for k, v in dists.items() if v.get("excluded_files")}
    lines += ["", "## Left out", "", "Files of distributions with an unknown or proprietary licence are not used:", ""]
    lines += [f"- {k} {v['version']} ({v['license']}): {v['excluded_files']} files" for k, v in sorted(left.items())]
    return "\n".join(lines) + "\n"


def summary(train: list[SourceFile], heldout: list[SourceFile]) -> dict:
    origins = Counter(f.origin for f in train + heldout)
    return {"train_files": len(train), "heldout_files": len(heldout),
            "train_bytes": sum(len(f.text.encode()) for f in train),
            "heldout_bytes": sum(len(f.text.encode()) for f in heldout),
            "distributions": len(origins), "top_distributions": origins.most_common(12)}


def heldout_prompts(heldout: list[SourceFile], encode, decode, dists: dict, count: int, min_tokens: int,
                    max_tokens: int, rng) -> list[dict]:
    """``count`` code prefixes of ``min_tokens``..``max_tokens`` tokens from distinct, permissively licensed
    held-out files (in hash order), each cut at a line end: {"id", "text", "source", "license"}."""
    out = []
    for f in sorted(heldout, key=lambda f: f.sha256):
        if not permissive(dists.get(f.origin, {}).get("license", "unknown")):
            continue
        ids = encode(f.text)
        if len(ids) < min_tokens + 16:
            continue
        n = int(rng.integers(min_tokens, min(max_tokens, len(ids) - 8) + 1))
        text = decode(ids[:n])
        text = text[: text.rfind("\n") + 1] if "\n" in text else text
        if len(encode(text)) < min_tokens:
            continue
        out.append({"id": f"heldout-{len(out):02d}", "text": text, "source": f"{f.origin}:{f.rel}",
                    "license": dists.get(f.origin, {}).get("license", "unknown")})
        if len(out) == count:
            break
    return out
