"""Persistent sessions: the engine state of a conversation's last turn, kept so the next turn skips its prefill.

A request names its session with the extension field ``"session_id"`` in the JSON body, or with the header
``X-Session-Id`` (ids: letters, digits and ``._:-``, up to 128 characters). When such a request finishes, the
server keeps :meth:`Engine.export_state` of its slot (K/V, Gated DeltaNet and conv state, drafter state; on the
CPU) under that id. The next request of the session loads it into its slot when the saved tokens are a prefix
of the new prompt, and prefills only the rest; otherwise it prefills everything. For a prompt of token ids a
session therefore never changes what is generated, only how much work the prompt costs.

Chat clients send the whole conversation back as text. Re-tokenizing the previous reply need not give the
tokens the model produced, so a session also remembers the text the client was shown: a new prompt that starts
with it is tokenized as the saved tokens plus the new text after it (what the model actually saw). Where
re-tokenizing would have given other tokens (a reply cut at max_tokens inside a word, say), such a turn sees the
tokens the model produced and may continue differently from the same conversation sent without a session.

The store is a bounded LRU (``--session-capacity`` states). With ``--session-dir`` each retained state is also
written to ``DIR/<model>/<id>.pt`` when stored, the files are loaded on start (newest kept), and a file is deleted
with its session (``DELETE /v1/sessions/{id}``, or eviction). ``<model>`` names the model's identity (its artifact
id), so servers of different models can share a folder and both use session ``s1``: a state is only of use to the
model that made it, and no server overwrites or deletes another model's files. The file name is the session
id: a file renamed ``DIR/<model>/other.pt`` is restored as session ``other`` (and reported), so deleting a session
always deletes the one file that holds it. Files an older version kept at the top of ``DIR`` move into the
model's folder when that model's server starts.

Integrity: a file holds its model's identity, the shapes of its state's tensors and a SHA-256 of everything else in
it (:func:`state_digest`); at start a file whose digest or shapes do not match, or whose tensors are not the shapes
this engine's slots take (``check``), is dropped with one log line, and the first request that names its session
gets a 404 saying so (then the id is free again). A failed write (a full or read-only disk) never fails the request
that finished the turn: the session stays in memory, the reply says it was not persisted (``timings``'
``session_persisted``), the partial file goes, and leftovers of earlier crashes are swept at start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
FILE_FORMAT = "ninfer-bench/session"
FILE_VERSION = 2  # 2: digest and shapes; version 1 files (no digest) are not restored
SHOWN_CHARS = 64  # of an id quoted in an error message: a client's 5000-character id is not sent back whole
log = logging.getLogger("ninfer_bench.server")


def quoted(sid) -> str:
    """``repr(sid)``; of a longer string, of its first ``SHOWN_CHARS`` characters followed by its length."""
    if isinstance(sid, str) and len(sid) > SHOWN_CHARS:
        return f"{sid[:SHOWN_CHARS]!r}... ({len(sid):,} characters)"
    return repr(sid)


def check_session_id(sid: str) -> str:
    """``sid`` when it is a valid session id (it names a file under --session-dir); ValueError otherwise."""
    if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid):
        raise ValueError(f"session id must be 1-128 characters of letters, digits and '._:-' starting with a "
                         f"letter or digit, got {quoted(sid)}")
    return sid


def model_folder(model_key: str) -> str:
    """The name of a model's folder under --session-dir: its key (an artifact id) when that is a plain file name,
    else a digest of it."""
    if FOLDER_NAME.fullmatch(model_key):
        return model_key
    return "model-" + hashlib.sha256(model_key.encode()).hexdigest()[:32]


def read_session_file(path: Path) -> dict:
    """The document in a session file; ValueError saying in a few words why ``path`` is not a usable one."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"cannot be read ({e.strerror or e})") from None
    with f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on pickle protocols say nothing to whoever runs the server
        try:
            doc = torch.load(f, map_location="cpu", weights_only=True)
        except Exception:  # torch's own message advises weights_only=False: unsafe for a file from anywhere
            raise ValueError("not a session file (truncated or corrupt)") from None
    if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
        raise ValueError("not a session file (a torch file of something else)")
    if doc.get("version") != FILE_VERSION:
        raise ValueError(f"a session file of version {doc.get('version')!r}, this version reads version "
                         f"{FILE_VERSION}")
    state = doc.get("state")
    if not (isinstance(state, dict) and isinstance(state.get("ids"), list) and isinstance(doc.get("ids"), list)
            and isinstance(doc.get("text"), (str, type(None))) and isinstance(doc.get("updated"), (int, float))
            and isinstance(doc.get("digest"), str) and isinstance(doc.get("shapes"), dict)):
        raise ValueError("a damaged session file (fields missing or of the wrong type)")
    return doc


def check_session_doc(doc: dict) -> None:
    """ValueError when a session file's content is not what it was written as: its digest or recorded shapes."""
    if state_digest(doc) != doc["digest"]:
        raise ValueError("its content does not match its digest")
    if state_shapes(doc["state"]) != doc["shapes"]:
        raise ValueError("its tensors are not the shapes it records")


def oldest_first(paths) -> list[Path]:
    """``paths`` by modification time; one that vanished meanwhile sorts first (and reports itself when read)."""
    def mtime(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0
    return sorted(paths, key=mtime)


def state_bytes(obj) -> int:
    """Bytes of every tensor in a nested state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def _leaves(obj, path: str = ""):
    """(path, leaf) of a nested state in a fixed order: dicts by key, lists by position."""
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _leaves(obj[key], f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}/{i}")
    else:
        yield path, obj


def state_shapes(state: dict) -> dict[str, list]:
    """``{path: [dtype, shape]}`` of every tensor in a nested state."""
    return {p: [str(v.dtype).replace("torch.", ""), list(v.shape)] for p, v in _leaves(state)
            if isinstance(v, torch.Tensor)}


def state_digest(doc: dict) -> str:
    """SHA-256 of a session file's content but its digest: every tensor's dtype, shape and bytes, and every other
    value's JSON, in a fixed order."""
    h = hashlib.sha256()
    for path, v in _leaves({k: v for k, v in doc.items() if k != "digest"}):
        h.update(path.encode() + b"\0")
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous().reshape(-1)
            h.update(f"{t.dtype}{list(v.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        else:
            h.update(json.dumps(v, sort_keys=True, default=str).encode())
        h.update(b"\1")
    return h.hexdigest()


@dataclass
class Session:
    """One retained turn: the engine state and what it stands for."""

    id: str
    state: dict  # Engine.export_state(): "ids" (tokens its cache covers), cache, drafter
    ids: list[int]  # prompt + completion tokens (the last completion token is not in the cache yet)
    text: str | None  # the text ``ids`` stand for as the client saw it; None when it cannot be matched
    updated: float = 0.0

    @property
    def tokens(self) -> int:
        return len(self.state["ids"])

    @property
    def nbytes(self) -> int:
        return state_bytes(self.state)

    def prompt_ids(self, text: str, encode) -> list[int] | None:
        """The prompt tokens of ``text`` continuing this session: its tokens plus the new text after it."""
        if self.text is None or not text.startswith(self.text):
            return None
        return self.ids + encode(text[len(self.text):])


class SessionStore:
    """A thread-safe LRU of sessions, mirrored to a folder when one is given."""

    def __init__(self, capacity: int = 16, directory: str | Path | None = None, model_key: str = "", check=None):
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"session-capacity must be a non-negative integer, got {capacity!r}")
        self.capacity = capacity
        self.root = Path(directory) if directory else None  # --session-dir, maybe shared with other models
        self.dir = self.root / model_folder(model_key) if directory else None  # this model's files, <id>.pt
        self.model_key = model_key  # states of another model are never loaded
        self.check = check  # check(state): ValueError when the engine's slots cannot take the state
        self.damaged: dict[str, str] = {}  # session id -> why its file was dropped at start (said once, then free)
        self._items: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def _path(self, sid: str) -> Path:
        return self.dir / f"{sid}.pt"

    def get(self, sid: str) -> Session | None:
        with self._lock:
            s = self._items.get(sid)
            if s is not None:
                self._items.move_to_end(sid)
            return s

    def take_damaged(self, sid: str) -> str | None:
        """Why session ``sid``'s file was dropped at start, once (the id is then free for a new session)."""
        with self._lock:
            return self.damaged.pop(sid, None)

    def put(self, session: Session, *, write: bool = True) -> bool:
        """Retain ``session`` (replacing its previous turn), evicting the least recently used beyond capacity.
        Returns whether it is persisted: False when its file could not be written (it stays in memory, and the
        failure is one log line - never the caller's error)."""
        if self.capacity == 0:
            return False
        session.updated = session.updated or time.time()
        with self._lock:
            self._items[session.id] = session
            self._items.move_to_end(session.id)
            evicted = []
            while len(self._items) > self.capacity:
                evicted.append(self._items.popitem(last=False)[0])
            if self.dir is None:
                return False
            persisted = not write
            try:
                if write:
                    self._write(session)
                    persisted = True
                for sid in evicted:
                    self._path(sid).unlink(missing_ok=True)
            except Exception as e:  # a full or read-only disk (torch raises RuntimeError) costs the restart only
                log.warning("session %s not saved to %s: %s", quoted(session.id), self.dir,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
            return persisted

    def _write(self, s: Session) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self._path(s.id).with_suffix(".pt.tmp")
        doc = {"format": FILE_FORMAT, "version": FILE_VERSION, "model": self.model_key, "id": s.id, "state": s.state,
               "ids": s.ids, "text": s.text, "updated": s.updated, "shapes": state_shapes(s.state)}
        doc["digest"] = state_digest(doc)
        try:
            torch.save(doc, tmp)
            tmp.replace(self._path(s.id))  # a crash mid-write never leaves a truncated session file
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def delete(self, sid: str) -> bool:
        if not SESSION_ID.fullmatch(sid):
            return False
        with self._lock:
            found = self._items.pop(sid, None) is not None
            if self.dir is not None:
                path = self._path(sid)
                found = found or path.exists()
                path.unlink(missing_ok=True)
            return found

    def describe(self) -> list[dict]:
        with self._lock:
            items = list(self._items.values())
        return [{"id": s.id, "object": "session", "tokens": s.tokens, "bytes": s.nbytes, "updated": int(s.updated)}
                for s in reversed(items)]

    def load(self) -> tuple[int, list[str]]:
        """Load this model's session files (newest last, so the LRU keeps the newest), after moving in those an
        older version kept at the top of the folder; returns (loaded, problems): a line for each file skipped or
        restored under another name."""
        if self.dir is None:
            return 0, []
        try:  # an unusable folder is an error before serving, not after
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--session-dir {self.root}: {e.strerror or e}") from None
        problems = self._adopt_top_level()
        for tmp in sorted(self.dir.glob("*.pt.tmp")):  # what an interrupted write left
            try:
                tmp.unlink()
                problems.append(f"{tmp.relative_to(self.root)}: an unfinished write; removed")
            except OSError as e:
                problems.append(f"{tmp.relative_to(self.root)}: an unfinished write, not removed ({e.strerror or e})")
        loaded = 0
        for path in oldest_first(self.dir.glob("*.pt")):
            shown = path.relative_to(self.root)
            sid = path.stem  # the file's name, so that deleting the session deletes this file
            try:  # one bad file must not stop the server from starting
                doc = read_session_file(path)
            except ValueError as e:
                problems.append(f"{shown}: {e}; skipped")
                continue
            if doc.get("model") == self.model_key and SESSION_ID.fullmatch(sid):
                try:  # this model's session, damaged: dropped, and its id said so once
                    check_session_doc(doc)
                except ValueError as e:
                    problems.append(f"{shown}: a damaged session ({e}); dropped")
                    self.damaged[sid] = f"its saved state was damaged ({e}) and has been dropped"
                    path.unlink(missing_ok=True)
                    continue
                try:  # intact, but not for this engine (another dtype or capacity): left for a server it fits
                    if self.check is not None:
                        self.check(doc["state"])
                except ValueError as e:
                    problems.append(f"{shown}: a state this engine's slots cannot take ({e}); skipped")
                    self.damaged[sid] = f"its saved state does not fit this server's engine ({e})"
                    continue
            if doc.get("model") != self.model_key:  # copied here by hand: its tensors would not fit this model
                problems.append(f"{shown}: saved by another model; skipped")
            elif not SESSION_ID.fullmatch(sid):
                problems.append(f"{shown}: {quoted(sid)} is not a session id (letters, digits and '._:-'); skipped")
            else:
                if doc.get("id") != sid:
                    problems.append(f"{shown}: saved as session {quoted(doc.get('id'))}, restored as session "
                                    f"{quoted(sid)} (a session is named by its file)")
                self.put(Session(sid, doc["state"], list(doc["ids"]), doc["text"], doc["updated"]), write=False)
                loaded += 1
        return min(loaded, len(self)), problems

    def _adopt_top_level(self) -> list[str]:
        """Move this model's session files from the top of --session-dir (where versions before per-model folders
        kept them) into its folder; other models' are left for their servers. Returns the problems."""
        problems = []
        for path in sorted(p for p in self.root.glob("*.pt") if p.is_file()):
            try:
                doc = read_session_file(path)
            except ValueError as e:
                problems.append(f"{path.name}: {e}; skipped")
                continue
            if doc.get("model") != self.model_key:
                continue
            target = self.dir / path.name
            if target.exists():
                problems.append(f"{path.name}: left in place, {target.relative_to(self.root)} holds that session")
                continue
            try:
                path.replace(target)  # keeps its modification time, so its place in the LRU
            except OSError as e:
                problems.append(f"{path.name}: not moved into {self.dir} ({e.strerror or e}); skipped")
        return problems
