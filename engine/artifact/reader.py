"""Reading artifacts: :class:`Artifact` memory-maps a file (v2 or v3), checks on open that every object fits the
file and every binding resolves, and reads tensors and blobs by their Hugging Face names; digests are only checked
by ``Artifact.verify``. The byte layout is :mod:`.format`'s, writing :mod:`.writer`'s.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch

from ...kernels import quant
from .format import (
    HEADER_BYTES,
    PAYLOAD_ALIGN,
    V2_BLOBS,
    ArtifactError,
    ObjectInfo,
    align,
    header_digest,
    parse_header,
    parse_object,
)

_HASH_CHUNK = 1 << 24


class Artifact:
    """A memory-mapped artifact file (v2 or v3). Open with ``Artifact.open(path)``; use as a context manager."""

    def __init__(self, path: str, version: int, artifact_id: str, doc: dict, payload_start: int, size: int):
        self.path, self.version, self.artifact_id = path, version, artifact_id
        self.payload_start, self.file_size = payload_start, size
        objs = doc.get("objects")
        if not isinstance(objs, list):
            raise ArtifactError(f"{path}: JSON has no 'objects' list")
        for key in ("bindings", "components", "metadata", "provenance") if version == 3 else ():
            if not isinstance(doc.get(key) or {}, dict):
                raise ArtifactError(f"{path}: JSON '{key}' is a {type(doc[key]).__name__}, expected an object")
        names = {t: n for n, t in reversed((doc.get("bindings") or {}).items()) if isinstance(t, str)}
        self.objects: dict[str, ObjectInfo] = {}
        for i, e in enumerate(objs):
            info = parse_object(path, version, i, e if isinstance(e, dict) else {}, names)
            if info.id in self.objects:
                raise ArtifactError(f"{path}: object id {info.id} appears twice")
            self.objects[info.id] = info
        self._check_bounds()
        self._mm = np.memmap(path, dtype=np.uint8, mode="c") if size else np.zeros(0, np.uint8)
        self._all = torch.from_numpy(self._mm)  # copy-on-write mapping: a writable view, nothing read yet
        if version == 3:
            self.bindings = dict(doc.get("bindings") or {})
            self.components = dict(doc.get("components") or {})
            self.metadata = dict(doc.get("metadata") or {})
            self.provenance = dict(doc.get("provenance") or {})
            self._identity = {}
        else:
            self._read_v2_extras(doc)
        self._check_bindings()

    @classmethod
    def open(cls, path, *, check_header: bool = True) -> "Artifact":
        """Parse the header and JSON, check the header digest when the artifact carries one (``check_header``; verify
        reports it among its other checks instead), check every object fits the file and every binding resolves,
        then mmap."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ArtifactError(f"no such file: {path}")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(32)
            version, jlen, aid = parse_header(path, head, size)
            f.seek(HEADER_BYTES[version])
            raw_json = f.read(jlen)
        try:
            doc = json.loads(raw_json)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{path}: JSON header is unreadable ({exc})") from None
        if not isinstance(doc, dict):
            raise ArtifactError(f"{path}: JSON root is a {type(doc).__name__}, expected an object")
        if version == 2:
            aid_hex = str((doc.get("identity") or {}).get("weights_id", ""))
        else:
            aid_hex = aid.hex()
        header = head[:HEADER_BYTES[version]] + raw_json
        want = (doc.get("provenance") or {}).get("header_sha256") if version == 3 else None
        if check_header and want is not None and header_digest(header) != want:  # cheap: the header and JSON only
            raise ArtifactError(f"{path}: header digest mismatch: the configs, metadata or object table were changed "
                                f"after writing (ninfer-bench verify says more)")
        art = cls(path, version, aid_hex, doc, align(HEADER_BYTES[version] + jlen, PAYLOAD_ALIGN), size)
        art._header = header
        return art

    def _check_bounds(self) -> None:
        for info in sorted(self.objects.values(), key=lambda o: o.offset):
            end = self.payload_start + info.offset + info.nbytes
            if end > self.file_size:
                raise ArtifactError(f"{self.path}: truncated: object {info.label} needs bytes up to {end} "
                                    f"but the file has {self.file_size}")

    def _read_v2_extras(self, doc: dict) -> None:
        """v2: bindings from object names; components/metadata/provenance/aliases from their JSON blobs."""
        self._identity = dict(doc.get("identity") or {})
        self.bindings = {}
        for info in self.objects.values():
            if info.name in self.bindings:
                raise ArtifactError(f"{self.path}: object name {info.name} appears twice")
            self.bindings[info.name] = info.id
        extras = {}
        for key, blob_name in V2_BLOBS.items():
            try:
                extras[key] = json.loads(self.blob(blob_name)) if blob_name in self.bindings else {}
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ArtifactError(f"{self.path}: blob {blob_name} is not valid JSON ({exc})") from None
        self.components, self.metadata, self.provenance = extras["components"], extras["metadata"], extras["provenance"]
        for alias, target in extras["aliases"].items():
            if target not in self.bindings:
                raise ArtifactError(f"{self.path}: alias {alias} -> {target}: no object named {target}")
            self.bindings[alias] = self.bindings[target]

    def _check_bindings(self) -> None:
        """Every binding names existing objects (parts agree in shape off the axis); components name bindings."""
        # plain bindings first, so an object is labelled by the name bound to it directly
        for name, target in sorted(self.bindings.items(), key=lambda kv: isinstance(kv[1], dict)):
            ids = target.get("parts") if isinstance(target, dict) else [target]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
                raise ArtifactError(f"{self.path}: binding {name} is malformed: {target!r}")
            for oid in ids:
                if oid not in self.objects:
                    raise ArtifactError(f"{self.path}: binding {name} -> object {oid}, which does not exist")
                self.objects[oid].name = self.objects[oid].name or name
            if isinstance(target, dict):
                self._parts_shape(name)
        for comp, spec in self.components.items():
            if spec is not None and not isinstance(spec, dict):
                raise ArtifactError(f"{self.path}: component {comp} is a {type(spec).__name__}, expected an object")
            for tname in (spec or {}).get("tensors", []):
                if tname not in self.bindings:
                    raise ArtifactError(f"{self.path}: component {comp} lists {tname}, which has no binding")

    def _parts_shape(self, name: str) -> tuple[int, ...]:
        target = self.bindings[name]
        parts = [self.objects[i] for i in target["parts"]]
        axis = int(target.get("axis", 0))
        ndim = len(parts[0].shape)
        if not -ndim <= axis < ndim or any(p.kind != "weight" or len(p.shape) != ndim for p in parts):
            raise ArtifactError(f"{self.path}: binding {name}: parts must be weights of equal rank, axis {axis}")
        axis %= ndim
        rest = {p.shape[:axis] + p.shape[axis + 1:] for p in parts}
        if len(rest) != 1:
            raise ArtifactError(f"{self.path}: binding {name}: parts {[list(p.shape) for p in parts]} "
                                f"differ off axis {axis}")
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        return tuple(shape)

    # ---- lookup -----------------------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return str(self.metadata.get("model_id") or self._identity.get("model_id", ""))

    def names(self, prefix: str = "") -> list[str]:
        """Logical names of weight tensors (not blobs) starting with ``prefix``, sorted."""
        def is_weight(target):
            first = target["parts"][0] if isinstance(target, dict) else target
            return self.objects[first].kind == "weight"
        return sorted(n for n, t in self.bindings.items() if n.startswith(prefix) and is_weight(t))

    def has(self, name: str) -> bool:
        return name in self.bindings

    def info(self, name: str) -> ObjectInfo:
        """The object bound to ``name`` (a plain binding, not parts)."""
        if name not in self.bindings:
            raise ArtifactError(f"{self.path}: no binding named {name}")
        target = self.bindings[name]
        if isinstance(target, dict):
            raise ArtifactError(f"{self.path}: {name} is bound to {len(target['parts'])} parts, not one object")
        return self.objects[target]

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical shape of ``name`` (parts concatenated)."""
        if isinstance(self.bindings.get(name), dict):
            return self._parts_shape(name)
        return self.info(name).shape

    def _view(self, info: ObjectInfo) -> torch.Tensor:
        if self._all is None:
            raise ArtifactError(f"{self.path}: artifact is closed")
        start = self.payload_start + info.offset
        return self._all[start:start + info.nbytes]

    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes of ``name`` as a flat uint8 tensor viewing the mapped file (no copy)."""
        return self._view(self.info(name))

    def _typed_view(self, info: ObjectInfo) -> torch.Tensor:
        """The stored bytes, aligned for dtype views: legacy v2 objects may sit at odd offsets (then a copy)."""
        buf = self._view(info)
        return buf.clone() if buf.storage_offset() % 16 else buf

    def _dequant(self, info: ObjectInfo, dtype: torch.dtype) -> torch.Tensor:
        if info.kind != "weight":
            raise ArtifactError(f"{self.path}: object {info.label} is a {info.kind}, not a weight")
        return quant.dequantize(self._typed_view(info), info.format, info.shape, dtype)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        """``name`` dequantized to ``dtype`` on ``device`` (parts concatenated); never aliases the file mapping."""
        target = self.bindings.get(name)
        if isinstance(target, dict):
            self._parts_shape(name)
            parts = [self._dequant(self.objects[i], dtype) for i in target["parts"]]
            return torch.cat(parts, dim=int(target.get("axis", 0))).to(device)
        out = self._dequant(self.info(name), dtype).to(device)
        if out.untyped_storage().data_ptr() == self._all.untyped_storage().data_ptr():
            out = out.clone()  # fp32/bf16 read as-is would be a view; writes to it must not reach other reads
        return out

    def blob(self, name: str) -> bytes:
        """The bytes of blob ``name`` (tokenizer.json, chat template...)."""
        info = self.info(name)
        if info.kind != "blob":
            raise ArtifactError(f"{self.path}: {name} is a {info.kind}, not a blob")
        return self._view(info).numpy().tobytes()

    # ---- checks and reports -----------------------------------------------------------------------------
    def verify(self, progress=None, strict: bool = False) -> list[tuple[str, bool, str]]:
        """Hash every object against its recorded SHA-256 and check that a weight's stored floats are finite: a list
        of (object label, ok, message).

        ``progress(done_bytes, total_bytes, label)`` is called as bytes are hashed. v2 objects have no digest: they
        pass on the bounds and the finite check. With ``strict`` the first failure raises ``ArtifactError`` instead.
        """
        if self._mm is None:
            raise ArtifactError(f"{self.path}: artifact is closed")
        objs = sorted(self.objects.values(), key=lambda o: o.offset)
        total, done, results = sum(o.nbytes for o in objs), 0, self.check_header()
        if strict and not all(ok for _, ok, _ in results):
            raise ArtifactError(f"{self.path}: " + "; ".join(f"{lb}: {m}" for lb, ok, m in results if not ok))
        for info in objs:
            start, end = self.payload_start + info.offset, self.payload_start + info.offset + info.nbytes
            if end > self.file_size:
                ok, msg = False, f"truncated (needs bytes up to {end}, file has {self.file_size})"
            elif info.sha256 is None:
                ok, msg = True, "no digest (v2)"
            else:
                h = hashlib.sha256()
                for a in range(start, end, _HASH_CHUNK):
                    h.update(memoryview(self._mm[a:min(a + _HASH_CHUNK, end)]))
                    if progress:
                        progress(done + min(a + _HASH_CHUNK, end) - start, total, info.label)
                ok = h.hexdigest() == info.sha256
                msg = "ok" if ok else f"sha256 mismatch (expected {info.sha256}, got {h.hexdigest()})"
            if ok and info.kind == "weight" and (bad := self._nonfinite(info)):
                ok, msg = False, f"{bad} stored value(s) are NaN or inf"
            if strict and not ok:
                raise ArtifactError(f"{self.path}: object {info.label}: {msg}")
            results.append((info.label, ok, msg))
            done += info.nbytes
            if progress and not info.sha256:
                progress(done, total, info.label)
        return results

    def check_header(self) -> list[tuple[str, bool, str]]:
        """(label, ok, message) for what the objects' digests do not cover: the v3 header's own digest (configs,
        bindings, metadata, the object table; artifacts written before it carry none) and bytes past the last
        object (a writer ends the file there)."""
        out = []
        if self.version == 3:
            want = self.provenance.get("header_sha256")
            if want is None:
                out.append(("header", True, "no header digest (written before artifacts carried one)"))
            else:
                got = header_digest(self._header)
                out.append(("header", got == want, "ok" if got == want else
                            f"sha256 mismatch (expected {want}, got {got}): the configs, metadata or object table "
                            f"were changed after writing"))
        end = max((self.payload_start + o.offset + o.nbytes for o in self.objects.values()), default=self.payload_start)
        if self.file_size > end:
            out.append(("file end", False, f"{self.file_size - end} bytes after the last object (it ends at {end})"))
        return out

    def _nonfinite(self, info: ObjectInfo) -> int:
        """NaN / inf among a weight's stored floats (values, or a quantized format's scales): a digest holds them
        as faithfully as any other bytes, and one such weight poisons every logit."""
        return quant.nonfinite(self._typed_view(info), info.format, info.shape)

    def summary(self) -> dict:
        """Counts and bytes per component and per format (each stored object counted once), for ``inspect``."""
        def tally(ids):
            infos = [self.objects[i] for i in set(ids)]
            return {"objects": len(infos), "bytes": sum(o.nbytes for o in infos)}

        def ids_of(name):
            t = self.bindings[name]
            return list(t["parts"]) if isinstance(t, dict) else [t]

        weights = self.names()
        owned = set()
        per_component = {}
        for comp, spec in self.components.items():
            if spec:
                names = [n for n in spec.get("tensors", []) if n in weights]
                owned.update(names)
                per_component[comp] = {"tensors": len(names), **tally(i for n in names for i in ids_of(n))}
        loose = [n for n in weights if n not in owned]
        if loose:
            per_component["(none)"] = {"tensors": len(loose), **tally(i for n in loose for i in ids_of(n))}
        weight_ids = {i for n in weights for i in ids_of(n)}
        per_format = {fmt: tally(i for i in weight_ids if self.objects[i].format == fmt)
                      for fmt in sorted({self.objects[i].format for i in weight_ids})}
        blob_ids = [i for i, o in self.objects.items() if o.kind == "blob"]
        return {"path": self.path, "version": self.version, "artifact_id": self.artifact_id,
                "model_id": self.model_id, "file_bytes": self.file_size, "tensors": len(weights),
                "objects": len(self.objects), "components": per_component, "formats": per_format,
                "blobs": tally(blob_ids)}

    def close(self) -> None:
        """Drop the mapping (it is unmapped once tensors returned by ``raw`` are gone too)."""
        self._all = None
        self._mm = None

    def __enter__(self) -> "Artifact":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Artifact({self.path!r}, v{self.version}, {len(self.objects)} objects)"
