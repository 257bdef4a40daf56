"""Where media bytes come from: raw bytes, ``data:`` URIs (base64), local files - any local file for the CLI's own
user, only files inside the operator's ``--media-dir`` for what an HTTP client names - within a request's limits."""

from __future__ import annotations

import base64
import binascii
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..model.config import is_int


@dataclass(slots=True)
class MediaLimits:
    """What one request may send: bytes per item, decoded pixels per image or frame, items per request, bytes a
    video's decoded frames may take, and bytes all of a request's items may decode to together (both checked from
    headers before anything is inflated: a few MB of compressed frames can decode to gigabytes, and 16 items each
    under the per-video cap to 16 times that)."""

    max_bytes: int = 32 << 20
    max_pixels: int = 8192 * 8192
    max_items: int = 16
    max_video_bytes: int = 4 << 30
    max_request_bytes: int = 8 << 30  # two videos at max_video_bytes

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_items", "max_video_bytes", "max_request_bytes"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"media limits: {name} must be a positive integer, got {value!r}")


class MediaBudget:
    """The decoded bytes one request's items have taken so far, against ``limits.max_request_bytes``: make one per
    request and pass it to :func:`.media.load_media` for each of its items. Each item is charged from its header
    before its pixels are inflated."""

    __slots__ = ("limits", "used")

    def __init__(self, limits: MediaLimits):
        self.limits, self.used = limits, 0

    def charge(self, n: int, what: str) -> None:
        """Count ``n`` more decoded bytes of ``what`` (e.g. "image of 640x480"); ValueError past the limit."""
        total, limit = self.used + n, self.limits.max_request_bytes
        if total > limit:
            raise ValueError(f"{what}: the request's media would decode to {total:,} bytes, over the limit of "
                             f"{limit:,} per request")
        self.used = total


def declared_type(source) -> str | None:
    """The media type a ``data:`` URI declares (``image/png``), lower-cased; None for bytes, paths and a URI that
    declares none."""
    if not isinstance(source, str) or not source[:5].lower() == "data:":
        return None
    head = source.partition(",")[0][5:].split(";")[0].strip().lower()
    return head or None


def read_source(source, limits: MediaLimits) -> bytes:
    """The bytes of ``source``: bytes, a ``data:`` URI (base64), a local path or ``file://`` URL. Any path is
    read: this is for a local user (the CLI); what an HTTP client names goes through :func:`request_source`."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        s = os.fspath(source)
        low = s[:16].lower()
        if low.startswith(("http://", "https://")):
            raise ValueError("remote media URLs are not fetched (no network): pass a data URI or a local path")
        if low.startswith("data:"):
            head, sep, payload = s.partition(",")
            if not sep or not head.lower().endswith(";base64"):
                raise ValueError("malformed data URI: expected data:<type>;base64,<data>")
            if len(payload) * 3 // 4 > limits.max_bytes:
                raise ValueError(f"media of ~{len(payload) * 3 // 4:,} bytes exceeds the limit of "
                                 f"{limits.max_bytes:,} bytes")
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("malformed data URI: the payload is not valid base64") from None
        else:
            if low.startswith("file://"):
                s = s[len("file://"):]
            elif "://" in low:
                raise ValueError(f"unsupported media URL scheme in {s[:32]!r}: pass a data URI or a local path")
            if not os.path.isfile(s):
                raise ValueError(f"media file not found: {s}")
            if os.path.getsize(s) > limits.max_bytes:
                raise ValueError(f"media file {s} of {os.path.getsize(s):,} bytes exceeds the limit of "
                                 f"{limits.max_bytes:,} bytes")
            with open(s, "rb") as f:
                data = f.read()
    else:
        raise ValueError(f"media source must be bytes, a data URI or a path, got {type(source).__name__}")
    if not data:
        raise ValueError("media is empty")
    if len(data) > limits.max_bytes:
        raise ValueError(f"media of {len(data):,} bytes exceeds the limit of {limits.max_bytes:,} bytes")
    return data


def request_source(source, media_dir: str | None, limits: MediaLimits) -> bytes | str:
    """What :func:`read_source` may be given for a source named by an HTTP client: a ``data:`` URI as it is, or
    the bytes of a file inside ``media_dir`` (a local path or ``file://`` URL, relative to the folder or absolute;
    symlinks resolved, and the resolved path must stay inside the folder). Without ``media_dir`` no file is read:
    the server is not a file browser for whoever can reach its port. A refused path says neither whether it
    exists nor where it leads."""
    if not isinstance(source, str):
        raise ValueError(f"media source must be a data URI, got {type(source).__name__}")
    low = source[:16].lower()
    if low.startswith("data:"):
        return source
    shown = f"{source[:64]!r}" + ("..." if len(source) > 64 else "")
    if low.startswith(("http://", "https://")):
        raise ValueError("remote media URLs are not fetched (no network): send the media as a data URI")
    if "://" in low and not low.startswith("file://"):
        raise ValueError(f"unsupported media URL scheme in {shown}: send the media as a data URI")
    if media_dir is None:
        raise ValueError(f"media {shown}: this server reads no local files; send the media as a data URI "
                         f"(data:<type>;base64,<data>), or start it with --media-dir DIR to allow paths in DIR")
    path = source
    if low.startswith("file://"):
        url = urlsplit(source)
        if url.netloc not in ("", "localhost"):
            raise ValueError(f"media {shown}: a file:// URL must name a local path (file:///path)")
        path = unquote(url.path)
    root = Path(media_dir).resolve()
    try:
        full = (root / path).resolve()  # an absolute path replaces root; ".." and symlinks are resolved
        inside = full.is_relative_to(root)
    except (OSError, RuntimeError, ValueError):  # an embedded NUL, a name too long, a symlink loop (3.11)
        inside = False
    if not inside:
        raise ValueError(f"media {shown}: not a path inside the server's media folder")
    try:  # O_NOFOLLOW: a symlink swapped in since resolve() is not followed; O_NONBLOCK: a FIFO does not hang
        fd = os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ValueError(f"media file {shown} not found in the server's media folder") from None
    except OSError as e:
        raise ValueError(f"media file {shown} cannot be read ({e.strerror})") from None
    st = os.fstat(fd)
    problem = (f"media {shown} is not a file" if not stat.S_ISREG(st.st_mode) else
               f"media file {shown} of {st.st_size:,} bytes exceeds the limit of {limits.max_bytes:,} bytes"
               if st.st_size > limits.max_bytes else None)
    if problem is not None:
        os.close(fd)
        raise ValueError(problem)
    with os.fdopen(fd, "rb") as f:
        return f.read(limits.max_bytes + 1)  # read_source refuses a file that grew past the limit
