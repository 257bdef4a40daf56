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
written to ``DIR/<id>.pt`` when stored, the files are loaded on start (newest kept), and a file is deleted with
its session (``DELETE /v1/sessions/{id}``, or eviction).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
FILE_FORMAT = "ninfer-bench/session"
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


def state_bytes(obj) -> int:
    """Bytes of every tensor in a nested state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


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

    def __init__(self, capacity: int = 16, directory: str | Path | None = None, model_key: str = ""):
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"session-capacity must be a non-negative integer, got {capacity!r}")
        self.capacity = capacity
        self.dir = Path(directory) if directory else None
        self.model_key = model_key  # states of another model are never loaded
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

    def put(self, session: Session, *, write: bool = True) -> None:
        """Retain ``session`` (replacing its previous turn), evicting the least recently used beyond capacity."""
        if self.capacity == 0:
            return
        session.updated = session.updated or time.time()
        with self._lock:
            self._items[session.id] = session
            self._items.move_to_end(session.id)
            evicted = []
            while len(self._items) > self.capacity:
                evicted.append(self._items.popitem(last=False)[0])
            if self.dir is None:
                return
            try:
                if write:
                    self._write(session)
                for sid in evicted:
                    self._path(sid).unlink(missing_ok=True)
            except OSError as e:  # a full or read-only disk costs the restart, not the request
                log.warning("session %s not saved to %s: %s", session.id, self.dir, e)

    def _write(self, s: Session) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self._path(s.id).with_suffix(".pt.tmp")
        torch.save({"format": FILE_FORMAT, "version": 1, "model": self.model_key, "id": s.id, "state": s.state,
                    "ids": s.ids, "text": s.text, "updated": s.updated}, tmp)
        tmp.replace(self._path(s.id))  # a crash mid-write never leaves a truncated session file

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
        """Load the folder's session files (newest last, so the LRU keeps the newest); returns (loaded,
        problems), skipping files that are unreadable or of another model."""
        if self.dir is None:
            return 0, []
        try:  # an unusable folder is an error before serving, not after
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--session-dir {self.dir}: {e.strerror or e}") from None
        loaded, problems = 0, []
        for path in sorted(self.dir.glob("*.pt"), key=lambda p: p.stat().st_mtime):
            try:
                doc = torch.load(path, map_location="cpu", weights_only=True)
                if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
                    raise ValueError("not a session file")
                if doc.get("model") != self.model_key:
                    problems.append(f"{path.name}: saved by another model, skipped")
                    continue
                sid = check_session_id(doc["id"])
                self.put(Session(sid, doc["state"], list(doc["ids"]), doc["text"], doc["updated"]), write=False)
                loaded += 1
            except Exception as e:  # one bad file must not stop the server from starting
                problems.append(f"{path.name}: {e}")
        return min(loaded, len(self)), problems
