"""Put retrained DFlash / DFlash2 drafters into a copy of an artifact, every other object's bytes unchanged.

The target, the MTP head, the tokenizer and ``draft_head.token_ids`` are copied as stored (their SHA-256 digests
stay the same, so greedy decoding is unchanged); the drafters' tensors are packed in the formats the build uses
for the artifact's policy (``export.drafter_extras``). The copy gets a new artifact id and a provenance entry
naming the artifact it came from.
"""

from __future__ import annotations

import os
from pathlib import Path

from ninfer_bench.engine.artifact.reader import Artifact
from ninfer_bench.engine.artifact.writer import write_artifact

from .export import drafter_extras


def replace_drafters(src: Path, nets: dict, out: Path, note: dict) -> dict:
    """Write ``out``: ``src`` with the drafter components named in ``nets`` (kind -> BlockDrafter) replaced.
    ``note`` goes into the provenance. Returns the policy used and the ids of both artifacts."""
    with Artifact.open(src) as a:
        if a.version != 3:
            raise ValueError(f"{src}: drafters live in v3 components; upgrade this v{a.version} artifact first")
        policy = str(a.metadata.get("quant_policy") or "q8")
        drop = {n for kind in nets for n in (a.components.get(kind) or {}).get("tensors", [])}
        packed, blobs, aliases = {}, {}, {}
        for name, target in a.bindings.items():
            if name in drop:
                continue
            if isinstance(target, dict):
                raise ValueError(f"{src}: {name} is bound to parts; copying those is not supported")
            info = a.objects[target]
            if info.name != name:
                aliases[name] = info.name
            elif info.kind == "blob":
                blobs[name] = a.blob(name)
            else:
                packed[name] = (info.format, info.shape, a.raw(name).clone())
        comps, tensors = drafter_extras(nets, policy)
        provenance = {**a.provenance, "drafters_replaced": {**note, "from_artifact": a.artifact_id,
                                                            "kinds": sorted(nets)}}
        new_id = os.urandom(16)
        write_artifact(out, tensors=tensors, packed=packed, blobs=blobs, components={**a.components, **comps},
                       metadata=a.metadata, provenance=provenance, aliases=aliases, version=3, model_id=a.model_id,
                       artifact_id=new_id)
        return {"policy": policy, "from_artifact": a.artifact_id, "artifact_id": new_id.hex()}
