"""Writing artifacts (v2 and v3) and upgrading v2 to v3: see :mod:`.format` for the byte layout.

Writes are atomic (a temporary file in the same folder, fsync, rename; removed on any error), stream one row
block of one tensor at a time (memory holds a block, not the model), and hash each object while writing it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from ... import __version__
from ...kernels import quant
from .format import (
    COMPONENTS,
    DIGEST_PLACEHOLDER,
    HEADER_BYTES,
    LAYOUTS,
    MAGIC,
    OBJECT_ALIGN,
    PAYLOAD_ALIGN,
    V2_BLOBS,
    ArtifactError,
    align,
    header_digest,
)
from .reader import Artifact
from .source import FileRange, row_blocks


@dataclass(slots=True)
class _Entry:
    """One object to write: ``data`` is a tensor to pack (``pack``), or packed uint8 tensor / bytes."""

    name: str
    kind: str
    fmt: str
    shape: tuple[int, ...]
    nbytes: int
    data: object
    pack: bool
    offset: int = 0
    sha256: str = DIGEST_PLACEHOLDER


def _weight_bytes(path: str, name: str, fmt: str, shape: tuple[int, ...]) -> int:
    if fmt not in quant.FORMATS:
        raise ArtifactError(f"{path}: tensor {name}: unknown format {fmt!r} (known: {', '.join(quant.FORMATS)})")
    try:
        return quant.nbytes(fmt, shape)
    except ValueError as exc:
        raise ArtifactError(f"{path}: tensor {name}: {exc}") from None


def _plan(path: str, tensors: dict, packed: dict, blobs: dict) -> list[_Entry]:
    """Objects in write order with their sizes and 256-aligned offsets; nothing is packed yet."""
    entries: list[_Entry] = []
    for name, (fmt, t) in tensors.items():
        shape = tuple(int(s) for s in t.shape)
        entries.append(_Entry(name, "weight", fmt, shape, _weight_bytes(path, name, fmt, shape), t, True))
    for name, (fmt, shape, data) in packed.items():
        shape = tuple(int(s) for s in shape)
        need = _weight_bytes(path, name, fmt, shape)
        if isinstance(data, torch.Tensor) and data.dtype != torch.uint8:
            raise ArtifactError(f"{path}: packed {name}: expected uint8 bytes, got a {data.dtype} tensor")
        have = data.numel() if isinstance(data, torch.Tensor) else data.nbytes if isinstance(data, FileRange) \
            else len(data)
        if have != need:
            raise ArtifactError(f"{path}: packed {name}: {have} bytes but {fmt} {list(shape)} needs {need}")
        entries.append(_Entry(name, "weight", fmt, shape, need, data, False))
    for name, data in blobs.items():
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ArtifactError(f"{path}: blob {name} must be bytes, got {type(data).__name__}")
        entries.append(_Entry(name, "blob", "bytes", (len(data),), len(data), bytes(data), False))
    seen, offset = set(), 0
    for e in entries:
        if e.name in seen:
            raise ArtifactError(f"{path}: {e.name} is given twice")
        seen.add(e.name)
        e.offset = align(offset, OBJECT_ALIGN)
        offset = e.offset + e.nbytes
    return entries


def _check_components(path: str, components: dict, bound: set[str]) -> None:
    for comp, spec in components.items():
        if comp not in COMPONENTS:
            raise ArtifactError(f"{path}: unknown component {comp!r} (known: {', '.join(COMPONENTS)})")
        if spec is None:
            continue
        if not isinstance(spec, dict) or not isinstance(spec.get("config"), dict):
            raise ArtifactError(f"{path}: component {comp} needs a dict with a 'config' dict")
        for name in spec.get("tensors", []):
            if name not in bound:
                raise ArtifactError(f"{path}: component {comp} lists {name}, which is not being written")


def _document(version: int, entries: list[_Entry], aliases: dict, extras: dict, model_id: str, aid: bytes) -> dict:
    if version == 2:
        objects = [{"name": e.name, "kind": e.kind, "shape": list(e.shape), "format": e.fmt,
                    "layout": LAYOUTS[e.fmt], "offset": e.offset, "bytes": e.nbytes} for e in entries]
        model_id = model_id or str(extras["metadata"].get("model_id", ""))
        return {"identity": {"model_id": model_id, "weights_id": aid.hex()}, "objects": objects}
    objects = [{"id": f"o{i}", "kind": e.kind, "shape": list(e.shape), "format": e.fmt, "layout": LAYOUTS[e.fmt],
                "offset": e.offset, "bytes": e.nbytes, "sha256": e.sha256} for i, e in enumerate(entries)]
    bindings = {e.name: f"o{i}" for i, e in enumerate(entries)}
    bindings.update({alias: bindings[target] for alias, target in aliases.items()})
    return {"components": extras["components"], "objects": objects, "bindings": bindings,
            "metadata": extras["metadata"], "provenance": extras["provenance"]}


def _dump(path: str, doc: dict) -> bytes:
    try:
        return json.dumps(doc, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"{path}: components/metadata/provenance are not JSON-serialisable ({exc})") from None


BLOCK_BYTES = 64 << 20  # fp32 bytes of one row block packed at a time: bounds the converter's memory


def _object_chunks(path: str, e: _Entry, device, block_bytes: int):
    """The bytes of one object in order, as byte-like chunks: a tensor (or :class:`.source.TensorSource`) to pack
    is read, checked and packed one row block at a time (on ``device``), so memory holds one block, never the
    whole tensor."""
    if e.pack:
        blocks = _checked_blocks(path, e, device, quant.rows_per_block(e.shape, block_bytes))
        for chunk in quant.pack_blocks(blocks, e.fmt, e.shape):
            yield memoryview(chunk.cpu().numpy())
    elif isinstance(e.data, FileRange):
        yield from e.data.chunks()
    elif isinstance(e.data, torch.Tensor):
        flat = e.data.detach().reshape(-1)
        for i in range(0, flat.numel(), 1 << 24):
            yield memoryview(flat[i:i + (1 << 24)].cpu().contiguous().numpy())
    else:
        yield memoryview(e.data)


def _checked_blocks(path: str, e: _Entry, device, rows: int):
    """Row blocks of ``e.data`` on ``device``; a NaN or an infinity anywhere refuses the tensor (it would poison its
    group's scale, and any weight of it every logit), counting the bad values of the rest of the tensor first."""
    bad = 0
    for block in row_blocks(e.data, rows):
        block = block.detach().to(device)
        if block.numel() and block.is_floating_point():
            low, high = torch.aminmax(block)  # NaN or inf come out here: one fast pass, the exact count only then
            if not bool(torch.isfinite(low) & torch.isfinite(high)):
                bad += int(block.numel() - torch.isfinite(block).sum())
        if bad == 0:
            yield block
    if bad:
        raise ArtifactError(f"{path}: tensor {e.name} has {bad} non-finite value(s) (NaN or inf); nothing written")


def _write_file(path: str, tmp: str, version: int, aid: bytes, doc: dict, entries: list[_Entry], progress,
                device="cpu", block_bytes: int = BLOCK_BYTES) -> None:
    """Payload first (hashing as it goes), then header and JSON with the digests filled in, then fsync; ``tmp``
    is written, errors name ``path``."""
    if version == 3:  # the header's own digest (format.header_digest), filled in last
        doc["provenance"]["header_sha256"] = DIGEST_PLACEHOLDER
    body_len = len(_dump(path, doc))  # digests are placeholders of their final length
    payload_start = align(HEADER_BYTES[version] + body_len, PAYLOAD_ALIGN)
    total, pos = sum(e.nbytes for e in entries), 0
    with open(tmp, "wb") as f:
        f.write(bytes(payload_start))
        for e in entries:
            f.write(bytes(e.offset - pos))
            pos, digest = e.offset, hashlib.sha256()
            for chunk in _object_chunks(path, e, device, block_bytes):
                digest.update(chunk)
                f.write(chunk)
                pos += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                if progress:
                    progress(pos, total, e.name)
            if pos != e.offset + e.nbytes:
                raise ArtifactError(f"{path}: {e.name}: wrote {pos - e.offset} bytes, expected {e.nbytes}")
            e.sha256 = digest.hexdigest()
        if version == 3:
            for obj, e in zip(doc["objects"], entries):
                obj["sha256"] = e.sha256
        final = _dump(path, doc)
        if len(final) != body_len:
            raise RuntimeError("artifact JSON changed length when digests were filled in")
        head = MAGIC + bytes([version]) + struct.pack("<Q", len(final)) + (aid if version == 3 else b"")
        if version == 3:
            doc["provenance"]["header_sha256"] = header_digest(head + final)
            final = _dump(path, doc)
        f.seek(0)
        f.write(head + final)
        f.flush()
        os.fsync(f.fileno())


def write_artifact(path, *, tensors: dict | None = None, packed: dict | None = None, blobs: dict | None = None,
                   components: dict | None = None, metadata: dict | None = None, provenance: dict | None = None,
                   aliases: dict[str, str] | None = None, version: int = 3, artifact_id: bytes | None = None,
                   model_id: str = "", progress=None, device="cpu", block_bytes: int = BLOCK_BYTES) -> None:
    """Write an artifact atomically (temp file in the same directory, fsync, rename).

    ``tensors``: name -> (format, tensor or :class:`.source.TensorSource`), packed while streaming to disk one row
    block of at most ``block_bytes`` (as fp32) at a time, on ``device`` (the bytes are the same on any device);
    ``packed``: name -> (format, shape, uint8 tensor, bytes or :class:`.source.FileRange`) already packed (copied
    as-is); ``blobs``: name ->
    bytes; ``aliases``: name -> name of a written object bound to the same bytes (tied weights, stored once).
    ``progress(done_bytes, total_bytes, name)`` is called after each object. On any error nothing is left at
    ``path`` (an existing file there is untouched).
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if version not in HEADER_BYTES:
            raise ArtifactError(f"{path}: cannot write artifact version {version} (2 or 3)")
        aid = os.urandom(16) if artifact_id is None else bytes(artifact_id)
        if len(aid) != 16:
            raise ArtifactError(f"{path}: artifact id must be 16 bytes, got {len(aid)}")
        extras = {"components": dict(components or {}), "metadata": dict(metadata or {}),
                  "provenance": dict(provenance or {}), "aliases": dict(aliases or {})}
        if model_id:
            extras["metadata"].setdefault("model_id", model_id)
        extras["provenance"].setdefault("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
        extras["provenance"].setdefault("tool", f"ninfer-bench {__version__}")
        blobs = dict(blobs or {})
        if version == 2:  # v2 has no slots for these: keep them as JSON blobs
            blobs.update({V2_BLOBS[k]: _dump(path, v) for k, v in extras.items() if v})
        entries = _plan(path, dict(tensors or {}), dict(packed or {}), blobs)
        written = {e.name for e in entries}
        for alias, target in extras["aliases"].items():
            if target not in written or alias in written:
                raise ArtifactError(f"{path}: alias {alias} -> {target}: the target must be written and the alias "
                                    f"must not be")
        _check_components(path, extras["components"], written | set(extras["aliases"]))
        doc = _document(version, entries, extras["aliases"], extras, model_id, aid)
        _dump(path, doc)  # fail on unserialisable metadata before any file exists
        try:
            _write_file(path, tmp, version, aid, doc, entries, progress, device, block_bytes)
            os.replace(tmp, path)
        except OSError as exc:  # name the user's path, not the temporary file
            raise OSError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def add_header_digest(src_path, dst_path, progress=None) -> None:
    """A v3 artifact written before artifacts carried a header digest, rewritten with one: the same artifact id,
    JSON and object bytes (object offsets count from the payload start, which may move to fit the longer JSON), and
    ``provenance.header_sha256`` over the new header. Atomic, as :func:`write_artifact`."""
    with Artifact.open(src_path) as src:
        if src.version != 3:
            raise ArtifactError(f"{src.path}: a v{src.version} artifact; upgrade it to v3 instead")
        if src.provenance.get("header_sha256") is not None:
            raise ArtifactError(f"{src.path}: already carries a header digest")
        doc = json.loads(src._header[HEADER_BYTES[3]:])
        aid, old_start, size = bytes.fromhex(src.artifact_id), src.payload_start, src.file_size
    path = os.fspath(dst_path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        doc.setdefault("provenance", {})["header_sha256"] = DIGEST_PLACEHOLDER
        body = _dump(path, doc)
        head = MAGIC + bytes([3]) + struct.pack("<Q", len(body)) + aid
        doc["provenance"]["header_sha256"] = header_digest(head + body)
        body = _dump(path, doc)
        start = align(HEADER_BYTES[3] + len(body), PAYLOAD_ALIGN)
        with open(os.fspath(src_path), "rb") as fin, open(tmp, "wb") as fout:
            fout.write(head + body + bytes(start - len(head) - len(body)))
            fin.seek(old_start)
            done, total = 0, size - old_start
            while chunk := fin.read(1 << 24):
                fout.write(chunk)
                done += len(chunk)
                if progress:
                    progress(done, total, "payload")
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def upgrade(src_v2, dst_v3, progress=None) -> None:
    """Rewrite a v2 artifact as v3 with every object's bytes unchanged (components/metadata from its blobs); a v3
    artifact without a header digest gains one (:func:`add_header_digest`)."""
    with Artifact.open(src_v2) as src:
        version, digest = src.version, src.provenance.get("header_sha256")
    if version == 3 and digest is None:
        return add_header_digest(src_v2, dst_v3, progress)
    with Artifact.open(src_v2) as src:
        if src.version != 2:
            raise ArtifactError(f"{src.path}: is already v{src.version} with a header digest; nothing to upgrade")
        packed, blobs, aliases = {}, {}, {}
        reserved = set(V2_BLOBS.values())
        for name, oid in src.bindings.items():
            info = src.objects[oid]
            if name in reserved:
                continue
            if info.name != name:
                aliases[name] = info.name
            elif info.kind == "blob":
                blobs[name] = src.blob(name)
            else:
                packed[name] = (info.format, info.shape, FileRange(src.path, src.payload_start + info.offset,
                                                                   info.nbytes))
        try:
            aid = bytes.fromhex(src.artifact_id)
        except ValueError:
            aid = b""
        provenance = {**src.provenance, "upgraded_from": {"version": 2, "file": os.path.basename(src.path),
                                                          "weights_id": src.artifact_id}}
        write_artifact(dst_v3, packed=packed, blobs=blobs, components=src.components, metadata=src.metadata,
                       provenance=provenance, aliases=aliases, version=3,
                       artifact_id=aid if len(aid) == 16 else None, model_id=src.model_id, progress=progress)
