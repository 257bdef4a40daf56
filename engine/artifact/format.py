"""The artifact container's format: one file holding a model's weights, tokenizer, configs and components. Its
constants, header digest and error type serve the reader (:mod:`.reader`) and the writer
(:mod:`.writer`); the fixed header and each object entry are parsed and checked here.

Byte layout (docs/DESIGN.md, "Artifact formats"; integers little-endian, object offsets relative to the payload):

====  ========================================================================================================
v3    ``b"NINFER\\0\\x03"`` | u64 JSON length | 16-byte artifact id | JSON | zeros up to 4096 | payload
      JSON ``{components, objects[{id, kind, shape, format, layout, offset, bytes, sha256}], bindings,
      metadata, provenance}``; every object starts at a multiple of 256 bytes into the payload.
v2    ``b"NINFER\\0\\x02"`` | u64 JSON length | JSON | zeros up to 4096 | payload
      JSON ``{identity{model_id, weights_id}, objects[{name, kind, shape, format, layout, offset, bytes}]}``
====  ========================================================================================================

Weights (``kind "weight"``) hold ``quant.pack(tensor, format)`` for their logical ``shape``; other payloads
(tokenizer.json, chat template) are ``kind "blob"``, ``format "bytes"``, ``shape [nbytes]``. v3 ``bindings`` map a
Hugging Face name to an object id, or to ``{"parts": [ids], "axis": a}`` (concatenation, read only); tied weights
bind two names to one object. v2 has no components/metadata/bindings, so the writer keeps them in JSON blobs
(``__components__.json``, ``__metadata__.json``, ``__provenance__.json``, ``__aliases__.json``) and ``upgrade``
loses nothing.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

from ...kernels import quant

MAGIC = b"NINFER\0"
HEADER_BYTES = {2: 16, 3: 32}
PAYLOAD_ALIGN = 4096
OBJECT_ALIGN = 256
COMPONENTS = ("text", "mtp", "dflash", "dflash2", "vision")
LAYOUTS = {"fp32": "row-major", "bf16": "row-major", "bytes": "bytes",
           **{fmt: "qpack.v1" for fmt in quant.QUANT_FORMATS}}
V2_BLOBS = {"components": "__components__.json", "metadata": "__metadata__.json",
            "provenance": "__provenance__.json", "aliases": "__aliases__.json"}
DIGEST_PLACEHOLDER = "0" * 64  # same length as a hex sha256, so the JSON length is known before hashing


def align(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


def header_digest(header: bytes) -> str:
    """SHA-256 of a v3 artifact's fixed header and JSON with ``provenance.header_sha256`` set to the placeholder:
    the configs, bindings, metadata and every object's digest (so, through them, every byte of the file)."""
    stored = json.loads(header[HEADER_BYTES[3]:]).get("provenance", {}).get("header_sha256", DIGEST_PLACEHOLDER)
    key = b'"header_sha256":"'
    return hashlib.sha256(header.replace(key + str(stored).encode() + b'"', key + DIGEST_PLACEHOLDER.encode() + b'"',
                                         1)).hexdigest()


class ArtifactError(ValueError):
    """A problem with an artifact file; the message names the file and, where there is one, the object."""


@dataclass(slots=True)
class ObjectInfo:
    """One stored object: where its bytes are and how to read them."""

    id: str
    name: str | None
    kind: str
    shape: tuple[int, ...]
    format: str
    layout: str
    offset: int  # from the payload start
    nbytes: int
    sha256: str | None  # None in v2

    @property
    def label(self) -> str:
        return f"{self.id} ({self.name})" if self.name else self.id


def parse_header(path: str, head: bytes, size: int) -> tuple[int, int, bytes]:
    """(version, JSON length, artifact id) from the first bytes of the file."""
    if len(head) < 8 or head[:7] != MAGIC:
        raise ArtifactError(f"{path}: not a ninfer artifact (magic {head[:8]!r})")
    version = head[7]
    if version not in HEADER_BYTES:
        raise ArtifactError(f"{path}: unsupported artifact version {version} (this reader knows 2 and 3)")
    hlen = HEADER_BYTES[version]
    if size < hlen:
        raise ArtifactError(f"{path}: truncated: v{version} header needs {hlen} bytes, file has {size}")
    (jlen,) = struct.unpack("<Q", head[8:16])
    if hlen + jlen > size:
        raise ArtifactError(f"{path}: truncated: JSON of {jlen} bytes runs past the end of the {size}-byte file")
    return version, jlen, head[16:32] if version == 3 else b""


def parse_object(path: str, version: int, index: int, e: dict, names: dict[str, str]) -> ObjectInfo:
    """An ``objects[index]`` entry of the JSON, checked for types and for size == size implied by shape.

    ``names`` (v3): object id -> a logical name bound to it, so that errors can name the tensor.
    """
    try:
        oid = str(e["id"]) if version == 3 else f"o{index}"
        info = ObjectInfo(id=oid, name=str(e["name"]) if version == 2 else names.get(oid),
                          kind=str(e["kind"]), shape=tuple(int(s) for s in e["shape"]), format=str(e["format"]),
                          layout=str(e.get("layout", "")), offset=int(e["offset"]), nbytes=int(e["bytes"]),
                          sha256=str(e["sha256"]) if version == 3 else None)
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{path}: objects[{index}] is malformed ({type(exc).__name__}: {exc})") from None
    where = f"{path}: object {info.label}"
    if info.offset < 0 or (version == 3 and info.offset % OBJECT_ALIGN):
        raise ArtifactError(f"{where}: offset {info.offset} is not a non-negative multiple of {OBJECT_ALIGN}")
    if info.kind == "blob":
        if info.format != "bytes" or len(info.shape) != 1:
            raise ArtifactError(f"{where}: a blob needs format 'bytes' and shape [n], got {info.format} "
                                f"{list(info.shape)}")
        expected = info.shape[0]
    elif info.kind == "weight":
        if info.format not in quant.FORMATS:
            raise ArtifactError(f"{where}: unknown format {info.format!r} (known: {', '.join(quant.FORMATS)})")
        try:
            expected = quant.nbytes(info.format, info.shape)
        except ValueError as exc:
            raise ArtifactError(f"{where}: {exc}") from None
    else:
        raise ArtifactError(f"{where}: unknown kind {info.kind!r} (expected 'weight' or 'blob')")
    if info.nbytes != expected:
        raise ArtifactError(f"{where}: shape/size mismatch: {info.format} {list(info.shape)} needs {expected} "
                            f"bytes, the entry says {info.nbytes}")
    return info
