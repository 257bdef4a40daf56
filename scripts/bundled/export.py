"""Export: the final Hugging Face folder, the v3 artifact with both drafters, shipping it in parts, joining them.

The artifact is ``write_model`` of the HF folder's tensors (the target and ``mtp.*``, read back through
``HFCheckpoint`` as ``convert`` reads any checkpoint) plus ``extra_components`` ``dflash`` / ``dflash2``
(tensors ``dflash.<state_dict name>``) and ``draft_head.token_ids`` (token ids by training-corpus frequency,
fp32, read by ``--lm-head-draft``). Policy ``q8``: every 2-D weight q8_g32 (1.06 bytes a weight), the DFlash2
selector tables bf16, vectors fp32; when that exceeds the size limit, ``mixed``.

The device returns at most 8 files of 16 MiB, so the artifact travels as ``<name>.part0..N`` (15 MiB each)
with its SHA-256 in card_facts.json; ``python3 scripts/bundled/export.py join SHIPDIR`` puts it back together
here and installs it (artifact, licence note and card into ``models/``, prompts into ``suites/data/``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import this file as ``bundled.export`` (package imports) and run it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import _bootstrap

    _bootstrap.ensure_package()
    from bundled.export import main

    sys.exit(main())

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from ninfer_bench.engine.artifact.convert import write_model  # noqa: E402
from ninfer_bench.engine.artifact.hf_checkpoint import HFCheckpoint  # noqa: E402
from ninfer_bench.engine.artifact.loader import BUNDLED_NAME  # noqa: E402

from . import card  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PART_BYTES = 15 * 2**20
MAX_SHIP_FILES = 8
LIMIT_BYTES = 40_000_000
POLICIES = ("q8", "mixed")
DRAFTER_FORMAT = {"fp32": "fp32", "bf16": "bf16", "q8": "q8_g32_fp16", "mixed": "q5_g64_fp16"}
SHIP_FILES = ("heldout_prompts.jsonl", "train_log.jsonl", "corpus_LICENSES.md", "card_facts.json")


def final_hf(work: Path, out: Path) -> Path:
    """``hf/`` with ``mtp.*`` replaced by the drafter stage's fine-tuned head (when there is one)."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(work / "hf", out)
    tuned = work / "drafters" / "mtp.safetensors"
    if tuned.is_file():
        state = load_file(str(out / "model.safetensors"))
        state.update(load_file(str(tuned)))
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def drafter_extras(drafters: dict, policy: str, token_order=None) -> tuple[dict, dict]:
    """(extra_components, extra_tensors) for ``write_model``: both drafters and, given ``token_order``,
    ``draft_head.token_ids``."""
    comps, tensors = {}, {}
    for kind, net in drafters.items():
        names = []
        for name, t in net.state_dict().items():
            fmt = "fp32" if t.ndim != 2 else ("bf16" if name.startswith("selector.") and policy != "fp32"
                                              else DRAFTER_FORMAT[policy])
            tensors[f"{kind}.{name}"] = (fmt, t.detach().float().cpu())
            names.append(f"{kind}.{name}")
        comps[kind] = {"config": net.c.to_dict(), "tensors": names}
    if token_order is not None:
        tensors["draft_head.token_ids"] = ("fp32", torch.as_tensor(token_order, dtype=torch.float32))
    return comps, tensors


def write(hf_dir: Path, drafters: dict, token_order, out: Path, policies=POLICIES, limit: int = LIMIT_BYTES) -> dict:
    """Write the artifact with the first policy that fits ``limit`` bytes; returns size, policy and digest."""
    ckpt = HFCheckpoint(hf_dir)
    tensors = ckpt.tensors()
    for policy in policies:
        comps, extra = drafter_extras(drafters, policy, token_order)
        write_model(out, ckpt.config, tensors, policy=policy, blobs=ckpt.blobs(), model_id="ninfer-code-small",
                    source="scripts/train_bundled.py", extra_components=comps, extra_tensors=extra)
        size = out.stat().st_size
        if size <= limit:
            return {"policy": policy, "bytes": size, "sha256": sha256(out), "limit_bytes": limit}
    raise RuntimeError(f"{out}: {size} bytes with policy {policies[-1]!r}, over the {limit}-byte limit")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def split(artifact: Path, ship: Path, beside: int = len(SHIP_FILES)) -> list[str]:
    """Copy ``artifact`` into ``ship`` as ``<name>.part0..N`` of at most ``PART_BYTES``; returns the part names.
    ``beside``: how many other files ship with them (the device returns at most ``MAX_SHIP_FILES``)."""
    ship.mkdir(parents=True, exist_ok=True)
    names = []
    with open(artifact, "rb") as f:
        while block := f.read(PART_BYTES):
            names.append(f"{artifact.name}.part{len(names)}")
            (ship / names[-1]).write_bytes(block)
    if len(names) + beside > MAX_SHIP_FILES:
        raise RuntimeError(f"{len(names)} parts + {beside} files exceed the {MAX_SHIP_FILES} files the device "
                           f"returns")
    return names


def assemble(ship: Path, parts: list[str], want: str, tmp: Path, source: str) -> Path:
    """Concatenate the shipped ``parts`` into ``tmp`` and return it once its SHA-256 equals ``want`` (the digest
    ``source`` records); on a mismatch ``tmp`` is removed and RuntimeError raised. The caller renames ``tmp``."""
    with open(tmp, "wb") as f:
        for name in parts:
            f.write((ship / name).read_bytes())
    got = sha256(tmp)
    if got != want:
        tmp.unlink()
        raise RuntimeError(f"joined artifact has SHA-256 {got}, {source} records {want}")
    return tmp


def join(ship: Path, models: Path, suites_data: Path) -> Path:
    """Reassemble the artifact from ``ship`` into ``models`` (checking its SHA-256), install the prompts, the
    licence note and the facts, and write the model card."""
    facts = json.loads((ship / "card_facts.json").read_text())
    models.mkdir(parents=True, exist_ok=True)
    out = models / BUNDLED_NAME
    ex = facts["export"]
    assemble(ship, ex["parts"], ex["sha256"], models / (BUNDLED_NAME + ".tmp"), "card_facts.json").replace(out)
    suites_data.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ship / "heldout_prompts.jsonl", suites_data / "heldout_prompts.jsonl")
    shutil.copyfile(ship / "corpus_LICENSES.md", models / "corpus_LICENSES.md")
    shutil.copyfile(ship / "card_facts.json", models / "card_facts.json")
    shutil.copyfile(ship / "train_log.jsonl", models / "train_log.jsonl")  # the card can be rewritten later
    log = [json.loads(line) for line in (ship / "train_log.jsonl").read_text().splitlines() if line.strip()]
    card.write(models, facts, log)
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Join a shipped bundled model into models/ and suites/data/.")
    ap.add_argument("command", choices=["join"])
    ap.add_argument("ship", type=Path, help="folder holding the .partN files, card_facts.json and the rest")
    ap.add_argument("--models", type=Path, default=REPO / "models")
    ap.add_argument("--suites-data", type=Path, default=REPO / "suites" / "data")
    args = ap.parse_args(argv)
    out = join(args.ship, args.models, args.suites_data)
    print(f"wrote {out} ({out.stat().st_size:,} bytes), {args.models / 'MODEL_CARD.md'}, "
          f"{args.suites_data / 'heldout_prompts.jsonl'}")
    return 0
