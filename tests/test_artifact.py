"""Artifact container: round trips (v2, v3, every format), alignment, digests, errors, atomic writes, upgrade."""

import json
import os
import re
import struct

import pytest
import torch

from ninfer_bench.kernels import quant
from ninfer_bench.engine.artifact.reader import Artifact
from ninfer_bench.engine.artifact.format import DIGEST_PLACEHOLDER, ArtifactError, header_digest
from ninfer_bench.engine.artifact.loader import bundled_model_path
from ninfer_bench.engine.artifact.writer import upgrade, write_artifact

# (format, shape): K not a multiple of the group, a multiple, a 3-D tensor; floats also as 1-D / conv weights
CASES = [(fmt, shape) for fmt in quant.QUANT_FORMATS for shape in [(5, 100), (3, 64), (2, 3, 70)]]
CASES += [(fmt, shape) for fmt in quant.FLOAT_FORMATS for shape in [(5, 100), (7,), (6, 1, 4)]]
HEADER = {2: 16, 3: 32}


def _case_name(fmt, shape):
    return f"model.layers.0.w_{fmt}_{'x'.join(map(str, shape))}.weight"


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {_case_name(fmt, shape): (fmt, torch.randn(shape, generator=g)) for fmt, shape in CASES}


def _write_small(path, version=3, **kw):
    """A small artifact: every format, a tied lm_head, a tokenizer blob and a text component."""
    tensors = _tensors()
    tensors["model.embed_tokens.weight"] = ("q8_g32_fp16", torch.randn(11, 48))
    kw.setdefault("aliases", {"lm_head.weight": "model.embed_tokens.weight"})
    kw.setdefault("blobs", {"tokenizer.json": b'{"model": "bpe"}', "chat_template.jinja": b"{{ messages }}"})
    kw.setdefault("components", {"text": {"config": {"hidden_size": 48}, "tensors": sorted(tensors)}, "vision": None})
    kw.setdefault("metadata", {"chat_template": "chat_template.jinja", "tokenizer": "tokenizer.json"})
    write_artifact(path, tensors=tensors, version=version, model_id="tiny", **kw)
    return tensors


def _read_doc(path):
    """(version, JSON document, payload bytes) parsed independently of the reader under test."""
    data = open(path, "rb").read()
    version = data[7]
    (jlen,) = struct.unpack("<Q", data[8:16])
    start = HEADER[version] + jlen
    payload_start = (start + 4095) // 4096 * 4096
    return version, json.loads(data[HEADER[version]:start]), data[payload_start:], payload_start


def _rewrite_doc(path, mutate, *, digest: bool = True):
    """Apply ``mutate(doc)`` to the JSON of an artifact, moving the payload as needed; with ``digest`` a v3 header
    digest is made anew (so the reader's other checks are reached), else the stale one stays."""
    data = open(path, "rb").read()
    version, doc, payload, _ = _read_doc(path)
    mutate(doc)
    renew = digest and version == 3 and "header_sha256" in doc.get("provenance", {})
    if renew:
        doc["provenance"]["header_sha256"] = DIGEST_PLACEHOLDER
    body = json.dumps(doc, separators=(",", ":")).encode()  # as the writer writes it
    head = data[:8] + struct.pack("<Q", len(body)) + data[16:HEADER[version]]
    if renew:
        doc["provenance"]["header_sha256"] = header_digest(head + body)
        body = json.dumps(doc, separators=(",", ":")).encode()  # as the writer writes it
    head += body
    with open(path, "wb") as f:
        f.write(head + bytes(-len(head) % 4096) + payload)


@pytest.mark.parametrize("version", [2, 3])
def test_round_trip_every_format(tmp_path, version):
    path = tmp_path / "a.ninfer"
    tensors = _write_small(path, version)
    with Artifact.open(path) as art:
        assert art.version == version
        for name, (fmt, w) in tensors.items():
            packed = quant.pack(w, fmt)
            assert torch.equal(art.raw(name), packed), name
            expected = quant.dequantize(packed, fmt, tuple(w.shape))
            got = art.tensor(name)
            assert got.shape == w.shape and got.dtype == torch.float32
            assert torch.equal(got, expected), name
            if fmt == "fp32":
                assert torch.equal(got, w)
            assert art.info(name).format == fmt and art.info(name).shape == tuple(w.shape)
        assert torch.equal(art.tensor("model.layers.0.w_bf16_5x100.weight", dtype=torch.bfloat16),
                           tensors["model.layers.0.w_bf16_5x100.weight"][1].to(torch.bfloat16))
        assert art.names() == sorted([*tensors, "lm_head.weight"])
        assert art.names("model.embed") == ["model.embed_tokens.weight"]
        assert art.components["text"]["config"] == {"hidden_size": 48}
        assert art.metadata["tokenizer"] == "tokenizer.json" and art.model_id == "tiny"


def test_tensor_does_not_alias_the_file(tmp_path):
    path = tmp_path / "a.ninfer"
    tensors = _write_small(path)
    name = "model.layers.0.w_fp32_7.weight"
    with Artifact.open(path) as art:
        art.tensor(name).fill_(123.0)
        assert torch.equal(art.tensor(name), tensors[name][1])


@pytest.mark.parametrize("version", [2, 3])
def test_alignment(tmp_path, version):
    path = tmp_path / "a.ninfer"
    tensors = _write_small(path, version)
    _, doc, payload, payload_start = _read_doc(path)
    assert payload_start % 4096 == 0
    with Artifact.open(path) as art:
        assert art.payload_start == payload_start
    raw_file = open(path, "rb").read()
    assert raw_file[HEADER[version] + struct.unpack("<Q", raw_file[8:16])[0]:payload_start].strip(b"\0") == b""
    for obj in doc["objects"]:
        if version == 3:
            assert obj["offset"] % 256 == 0, obj
    by_name = {o.get("name"): o for o in doc["objects"]} if version == 2 else \
        {n: next(o for o in doc["objects"] if o["id"] == i) for n, i in doc["bindings"].items()}
    for name, (fmt, w) in tensors.items():
        obj = by_name[name]
        assert payload[obj["offset"]:obj["offset"] + obj["bytes"]] == quant.pack(w, fmt).numpy().tobytes()


@pytest.mark.parametrize("version", [2, 3])
def test_blobs(tmp_path, version):
    path = tmp_path / "a.ninfer"
    _write_small(path, version)
    with Artifact.open(path) as art:
        assert art.blob("tokenizer.json") == b'{"model": "bpe"}'
        assert art.blob("chat_template.jinja") == b"{{ messages }}"
        assert art.has("tokenizer.json") and "tokenizer.json" not in art.names()
        assert art.info("tokenizer.json").kind == "blob" and art.info("tokenizer.json").shape == (16,)
        with pytest.raises(ArtifactError, match="not a blob"):
            art.blob("model.embed_tokens.weight")
        with pytest.raises(ArtifactError, match="not a weight"):
            art.tensor("tokenizer.json")
        with pytest.raises(ArtifactError, match="no binding named nope"):
            art.info("nope")


@pytest.mark.parametrize("version", [2, 3])
def test_tied_alias_written_once(tmp_path, version):
    path = tmp_path / "a.ninfer"
    tensors = _write_small(path, version)
    _, doc, _, _ = _read_doc(path)
    n_embed = sum(o["bytes"] == quant.nbytes("q8_g32_fp16", (11, 48)) and o["kind"] == "weight"
                  for o in doc["objects"])
    assert n_embed == 1
    with Artifact.open(path) as art:
        assert art.info("lm_head.weight").id == art.info("model.embed_tokens.weight").id
        assert torch.equal(art.tensor("lm_head.weight"), art.tensor("model.embed_tokens.weight"))
        assert art.info("lm_head.weight").name == "model.embed_tokens.weight"
        assert len(art.names()) == len(tensors) + 1


def test_verify_passes_and_reports_progress(tmp_path):
    path = tmp_path / "a.ninfer"
    _write_small(path)
    calls = []
    with Artifact.open(path) as art:
        results = art.verify(progress=lambda done, total, label: calls.append((done, total, label)))
        assert results[0] == ("header", True, "ok") and len(results) == len(art.objects) + 1
        assert all(ok and msg == "ok" for _, ok, msg in results)
        total = sum(o.nbytes for o in art.objects.values())
    assert calls[-1][:2] == (total, total)
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)


def test_verify_checks_the_header_and_the_file_end(tmp_path):
    """The objects' digests do not cover the JSON header (configs, metadata, the object table) or bytes past the
    last object: the header's own digest does, and a file longer than its objects fails."""
    path = tmp_path / "a.ninfer"
    _write_small(path)
    data = path.read_bytes()
    with Artifact.open(path) as art:
        end = art.payload_start + max(o.offset + o.nbytes for o in art.objects.values())
        assert len(data) == end and art.provenance["header_sha256"] != "0" * 64
    edited = tmp_path / "edited.ninfer"
    assert data.count(b'"model_id":"tiny"') == 1
    edited.write_bytes(data.replace(b'"model_id":"tiny"', b'"model_id":"tinx"'))
    with pytest.raises(ArtifactError, match="header digest mismatch"):  # refused on load
        Artifact.open(edited)
    with Artifact.open(edited, check_header=False) as art:  # as verify opens it
        (label, ok, msg), *rest = art.verify()
        assert (label, ok) == ("header", False) and "sha256 mismatch" in msg and all(r[1] for r in rest)
        with pytest.raises(ArtifactError, match="header: sha256 mismatch"):
            art.verify(strict=True)
    longer = tmp_path / "longer.ninfer"
    longer.write_bytes(data + b"x" * 5)
    with Artifact.open(longer) as art:
        assert [r for r in art.verify() if not r[1]] == [("file end", False, f"5 bytes after the last object "
                                                                            f"(it ends at {end})")]


def test_verify_v2_has_no_digests(tmp_path):
    path = tmp_path / "a.ninfer"
    _write_small(path, version=2)
    with Artifact.open(path) as art:
        assert {(ok, msg) for _, ok, msg in art.verify()} == {(True, "no digest (v2)")}


def test_flipped_byte_is_reported_by_verify(tmp_path):
    path = tmp_path / "a.ninfer"
    _write_small(path)
    name = "model.layers.0.w_q4_g64_fp16_5x100.weight"
    with Artifact.open(path) as art:
        info = art.info(name)
        where = art.payload_start + info.offset + info.nbytes // 2
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0x10]))
    with Artifact.open(path) as art:  # open does not hash
        bad = [(label, msg) for label, ok, msg in art.verify() if not ok]
        assert bad == [(f"{info.id} ({name})", bad[0][1])]
        assert "sha256 mismatch" in bad[0][1]
        with pytest.raises(ArtifactError, match=rf"object {info.id} \({name}\): sha256 mismatch"):
            art.verify(strict=True)


def test_truncated_file_names_an_object(tmp_path):
    path = tmp_path / "a.ninfer"
    _write_small(path)
    with Artifact.open(path) as art:
        last = max(art.objects.values(), key=lambda o: o.offset)
        first = min(art.objects.values(), key=lambda o: o.offset)
        cut = art.payload_start + last.offset + 1
    os.truncate(path, cut)
    with pytest.raises(ArtifactError, match=rf"truncated.*object {last.id} \({last.name}\)"):
        Artifact.open(path)
    os.truncate(path, cut - last.offset - 1 + first.offset + 1)
    with pytest.raises(ArtifactError, match=rf"truncated.*object {first.id} \({first.name}\)"):
        Artifact.open(path)
    os.truncate(path, 20)
    with pytest.raises(ArtifactError, match="truncated"):
        Artifact.open(path)


def test_bad_header(tmp_path):
    path = tmp_path / "a.ninfer"
    _write_small(path)
    data = open(path, "rb").read()
    (tmp_path / "magic.ninfer").write_bytes(b"GGUF\0\0\0\x03" + data[8:])
    with pytest.raises(ArtifactError, match="magic.ninfer: not a ninfer artifact"):
        Artifact.open(tmp_path / "magic.ninfer")
    (tmp_path / "v9.ninfer").write_bytes(data[:7] + b"\x09" + data[8:])
    with pytest.raises(ArtifactError, match="unsupported artifact version 9"):
        Artifact.open(tmp_path / "v9.ninfer")
    (tmp_path / "json.ninfer").write_bytes(data[:32] + b"}" + data[33:])
    with pytest.raises(ArtifactError, match="JSON header is unreadable"):
        Artifact.open(tmp_path / "json.ninfer")
    with pytest.raises(ArtifactError, match="no such file: .*missing.ninfer"):
        Artifact.open(tmp_path / "missing.ninfer")


def test_missing_binding(tmp_path):
    path = tmp_path / "a.ninfer"
    _write_small(path)
    _rewrite_doc(path, lambda doc: doc["bindings"].update({"lm_head.weight": "o99"}))
    with pytest.raises(ArtifactError, match="binding lm_head.weight -> object o99, which does not exist"):
        Artifact.open(path)
    _write_small(path)
    _rewrite_doc(path, lambda doc: doc["bindings"].pop("model.layers.0.w_fp32_7.weight"))
    with pytest.raises(ArtifactError, match="component text lists model.layers.0.w_fp32_7.weight"):
        Artifact.open(path)


def _edit_object(name, key, value):
    def mutate(doc):
        oid = doc["bindings"][name]
        next(o for o in doc["objects"] if o["id"] == oid)[key] = value
    return mutate


def test_size_mismatch_in_json(tmp_path):
    path = tmp_path / "a.ninfer"
    name = "model.layers.0.w_q5_g64_fp16_5x100.weight"
    _write_small(path)
    _rewrite_doc(path, _edit_object(name, "shape", [5, 200]))
    with pytest.raises(ArtifactError, match=rf"object o\d+ \({name}\): shape/size mismatch"):
        Artifact.open(path)
    _write_small(path)
    _rewrite_doc(path, _edit_object(name, "bytes", 1))
    with pytest.raises(ArtifactError, match=rf"\({name}\): shape/size mismatch"):
        Artifact.open(path)
    _write_small(path)
    _rewrite_doc(path, _edit_object(name, "format", "q3_k"))
    with pytest.raises(ArtifactError, match=rf"\({name}\): unknown format 'q3_k'"):
        Artifact.open(path)


def test_parts_binding_is_concatenated(tmp_path):
    path = tmp_path / "a.ninfer"
    a, b = torch.randn(2, 40), torch.randn(3, 40)
    write_artifact(path, tensors={"a": ("fp32", a), "b": ("q8_g32_fp16", b)})
    _rewrite_doc(path, lambda doc: doc["bindings"].update({"ab": {"parts": ["o0", "o1"], "axis": 0}}))
    with Artifact.open(path) as art:
        assert art.shape("ab") == (5, 40) and "ab" in art.names()
        assert torch.equal(art.tensor("ab"), torch.cat([a, art.tensor("b")]))
        with pytest.raises(ArtifactError, match="bound to 2 parts"):
            art.raw("ab")
    _rewrite_doc(path, lambda doc: doc["bindings"].update({"ab": {"parts": ["o0", "o1"], "axis": 1}}))
    with pytest.raises(ArtifactError, match="binding ab: parts .* differ off axis 1"):
        Artifact.open(path)


def test_upgrade_keeps_bytes(tmp_path):
    src, dst = tmp_path / "v2.ninfer", tmp_path / "v3.ninfer"
    _write_small(src, version=2, provenance={"source": "unit test"})
    upgrade(src, dst)
    with Artifact.open(src) as old, Artifact.open(dst) as new:
        assert (old.version, new.version) == (2, 3)
        assert new.names() == old.names() and new.artifact_id == old.artifact_id
        for name in old.names():
            assert torch.equal(new.raw(name), old.raw(name)), name
            assert torch.equal(new.tensor(name), old.tensor(name)), name
        assert new.info("lm_head.weight").id == new.info("model.embed_tokens.weight").id
        assert new.blob("tokenizer.json") == old.blob("tokenizer.json")
        assert new.components == old.components and new.metadata == old.metadata
        assert new.provenance["source"] == "unit test" and new.provenance["upgraded_from"]["version"] == 2
        assert not any(n.startswith("__") for n in new.bindings)
        assert all(ok for _, ok, _ in new.verify())
    with pytest.raises(ArtifactError, match="already v3"):
        upgrade(dst, tmp_path / "again.ninfer")


def test_summary_counts_each_object_once(tmp_path):
    path = tmp_path / "a.ninfer"
    tensors = _write_small(path)
    with Artifact.open(path) as art:
        s = art.summary()
    text = s["components"]["text"]
    assert text["tensors"] == len(tensors) and text["objects"] == len(tensors)
    assert s["components"]["(none)"] == {"tensors": 1, "objects": 1,
                                         "bytes": quant.nbytes("q8_g32_fp16", (11, 48))}  # lm_head, not listed
    assert s["formats"]["q4_g64_fp16"]["objects"] == 3
    assert s["blobs"] == {"objects": 2, "bytes": 16 + 14}


def test_closed_artifact_refuses_reads(tmp_path):
    path = tmp_path / "a.ninfer"
    _write_small(path)
    with Artifact.open(path) as art:
        pass
    with pytest.raises(ArtifactError, match="closed"):
        art.raw("lm_head.weight")


def _left_over(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir())


def test_writer_failure_leaves_no_file(tmp_path):
    path = tmp_path / "a.ninfer"
    with pytest.raises(ArtifactError, match="tensor w: unknown format 'q3'"):
        write_artifact(path, tensors={"v": ("fp32", torch.ones(3)), "w": ("q3", torch.ones(4, 4))})
    assert _left_over(tmp_path) == []

    def boom(done, total, name):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_artifact(path, tensors=_tensors(), progress=boom)
    assert _left_over(tmp_path) == []
    with pytest.raises(ArtifactError, match=r"packed p: 3 bytes but fp32 \[2\] needs 8"):
        write_artifact(path, packed={"p": ("fp32", (2,), b"abc")})
    with pytest.raises(ArtifactError, match="component text lists ghost"):
        write_artifact(path, tensors=_tensors(), components={"text": {"config": {}, "tensors": ["ghost"]}})
    assert _left_over(tmp_path) == []


def test_writer_failure_keeps_existing_file(tmp_path):
    path = tmp_path / "a.ninfer"
    _write_small(path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        write_artifact(path, tensors=_tensors(1), progress=lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    assert path.read_bytes() == before and _left_over(tmp_path) == ["a.ninfer"]


def test_packed_objects_are_copied_as_is(tmp_path):
    path = tmp_path / "a.ninfer"
    w = torch.randn(4, 70)
    buf = quant.pack(w, "q5_g64_fp16")
    write_artifact(path, packed={"w": ("q5_g64_fp16", (4, 70), buf), "b": ("bf16", (3,), bytes(6))},
                   artifact_id=bytes(range(16)))
    with Artifact.open(path) as art:
        assert torch.equal(art.raw("w"), buf) and art.artifact_id == bytes(range(16)).hex()
        assert torch.equal(art.tensor("b"), torch.zeros(3))


@pytest.mark.parametrize("fmt", ["fp32", "q4_g64_fp16"])
def test_writer_refuses_non_finite_weights(tmp_path, fmt):
    w = torch.randn(4, 64)
    w[2, 5] = float("nan")
    with pytest.raises(ArtifactError, match=r"tensor bad has 1 non-finite value"):
        write_artifact(tmp_path / "a.ninfer", tensors={"good": ("fp32", torch.ones(3)), "bad": (fmt, w)})
    assert _left_over(tmp_path) == []


def test_writer_errors_name_the_path_not_the_temporary_file(tmp_path):
    path = tmp_path / "no-such-folder" / "a.ninfer"
    with pytest.raises(OSError, match="cannot write .*no-such-folder/a.ninfer: ") as err:
        write_artifact(path, tensors={"v": ("fp32", torch.ones(3))})
    assert ".tmp-" not in str(err.value)


@pytest.mark.parametrize("edit, tensor", [
    ({"hidden_size": 80}, "tensor model.embed_tokens.weight has shape [300, 64], the config implies [300, 80]"),
    ({"intermediate_size": 100}, "tensor model.layers.0.mlp.gate_proj.weight has shape [96, 64]"),
    ({"vocab_size": 299}, "tensor model.embed_tokens.weight has shape [300, 64], the config implies [299, 64]"),
    ({"num_hidden_layers": 4}, "tensor model.layers.4.input_layernorm.weight is not part of the model"),
    ({"num_hidden_layers": 12}, "tensor model.layers.8.input_layernorm.weight is missing"),
])
def test_header_config_is_checked_against_the_tensors(tmp_path, tiny_artifact, edit, tensor):
    from ninfer_bench.engine.artifact.loader import load_artifact

    path = tmp_path / "edited.ninfer"
    path.write_bytes(tiny_artifact.read_bytes())

    def mutate(doc):
        cfg = doc["components"]["text"]["config"]
        cfg.update(edit)
        cfg["layer_types"] = [cfg["layer_types"][i % 8] for i in range(cfg["num_hidden_layers"])]

    _rewrite_doc(path, mutate)
    with pytest.raises(ValueError, match=re.escape(f"{path}: text component: {tensor}")):
        load_artifact(path)


@pytest.mark.parametrize("key, value, message", [
    ("rope_theta", "1e6", "rope_theta must be a positive number, got '1e6'"),
    ("rope_theta", None, "rope_theta must be a positive number, got None"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be a positive number, got -1e-06"),
    ("max_position_embeddings", "4096", "max_position_embeddings must be a positive integer, got '4096'"),
    ("partial_rotary_factor", "0.5", "partial_rotary_factor must be in (0, 1], got '0.5'"),
    ("tie_word_embeddings", "no", "tie_word_embeddings must be true or false, got 'no'"),
    ("eos_token_id", ["</s>"], "eos_token_id must be an integer or a list of integers, got ['</s>']"),
    ("linear_conv_kernel_dim", 1, "linear_conv_kernel_dim must be >= 2, got 1"),
])
def test_header_config_values_of_the_wrong_kind_are_named(tmp_path, tiny_artifact, key, value, message):
    """A config value that would only fail deep in the first forward (a TypeError, a shape error in the conv) is
    refused at load, naming the key and the value."""
    from ninfer_bench.engine.artifact.loader import load_artifact

    path = tmp_path / "edited.ninfer"
    path.write_bytes(tiny_artifact.read_bytes())
    _rewrite_doc(path, lambda doc: doc["components"]["text"]["config"].update({key: value}))
    with pytest.raises(ValueError, match=re.escape(f"{path}: text component: model config: {message}")):
        load_artifact(path)


def test_mtp_component_config_must_agree_with_the_text_config(tmp_path):
    from ninfer_bench.engine.model.config import preset
    from ninfer_bench.engine.artifact.convert import write_model
    from ninfer_bench.engine.artifact.loader import load_artifact
    from ninfer_bench.engine.artifact.synthetic import synthetic_raws

    cfg = preset("tiny")
    tensors = {n: r.dense() for n, r in synthetic_raws(cfg, "fp32", 0, "cpu").items()}
    path = tmp_path / "m.ninfer"
    write_model(path, cfg, tensors, policy="fp32")
    assert load_artifact(path).config.mtp_num_hidden_layers == cfg.mtp_num_hidden_layers > 0
    _rewrite_doc(path, lambda doc: doc["components"]["mtp"]["config"].update(num_hidden_layers=2))
    with pytest.raises(ValueError, match="mtp component: config num_hidden_layers is 2"):
        load_artifact(path)
    _rewrite_doc(path, lambda doc: doc["components"].update(mtp=None))  # a model without its MTP head still loads
    assert load_artifact(path).config.mtp_num_hidden_layers == 0


def test_bundled_model_passes_the_config_checks():
    from ninfer_bench.engine.artifact.loader import bundled_model_path, load_artifact

    path = bundled_model_path()
    if path is None:
        pytest.skip("this checkout ships no bundled model")
    model = load_artifact(path)
    assert model.config.mtp_num_hidden_layers > 0 and set(model.drafters) == {"dflash", "dflash2"}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q4_g64_fp16", "q8_g32_fp16"])
def test_nonfinite_stored_values_fail_verify(tmp_path, fmt):
    """NaN / inf bytes written with matching digests (packed as-is, so the writer's own check never sees them):
    verify names the object; a quantized weight is checked through its scales."""
    w = torch.randn(4, 64)
    buf = quant.pack(w, fmt).clone()
    if fmt in quant.QSPEC:
        quant.sections(buf, fmt, (4, 64))["scales"][2, 0] = float("inf")
    else:
        buf.view(torch.float32 if fmt == "fp32" else torch.bfloat16)[70] = float("nan")
    name = "model.layers.0.mlp.down_proj.weight"
    packed = {name: (fmt, (4, 64), buf), "model.norm.weight": ("fp32", (64,), quant.pack(torch.ones(64), "fp32"))}
    for version in (2, 3):
        path = tmp_path / f"nan{version}.ninfer"
        write_artifact(path, packed=packed, version=version)
        with Artifact.open(path) as art:
            results = {label: (ok, msg) for label, ok, msg in art.verify()}
            assert results[f"{art.info(name).id} ({name})"] == (False, "1 stored value(s) are NaN or inf")
            assert sum(not ok for ok, _ in results.values()) == 1
            with pytest.raises(ArtifactError, match=f"{name}.*NaN or inf"):
                art.verify(strict=True)


@pytest.mark.parametrize("key, value, message", [
    ("tie_word_embeddings", "no", "tie_word_embeddings must be true or false, got 'no'"),
    ("attention_bias", 1, "attention_bias must be true or false, got 1"),
])
def test_config_json_flags_that_are_not_booleans_are_named(key, value, message):
    """config.json's flags are read as given, not through bool() (which reads the string "no" as true)."""
    from ninfer_bench.engine.model.config import ModelConfig, preset

    hf = {**preset("tiny").to_hf(), key: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf({**hf, key: None}).to_dict()[key] is False  # null: the default


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_config_json_defaults_are_transformers(model_type):
    """What a config.json leaves out takes the value transformers' own config class gives it (head_dim 256 whatever
    the hidden size, the position limit, the rotary and conv settings, the layer pattern, the flags), so our model
    and transformers' read the same file as the same model."""
    transformers = pytest.importorskip("transformers")
    from ninfer_bench.engine.model.config import ModelConfig, preset

    given = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim")
    hf = {k: v for k, v in preset("tiny").to_hf().items() if k in given}
    ours = ModelConfig.from_hf({**hf, "model_type": model_type}).to_hf()
    cls = transformers.Qwen3_5TextConfig if model_type == "qwen3_5_text" else transformers.Qwen3NextConfig
    theirs = cls(**hf).to_dict()
    for key in ("head_dim", "max_position_embeddings", "rms_norm_eps", "linear_conv_kernel_dim", "layer_types",
                "tie_word_embeddings", "attention_bias", "hidden_act"):
        assert ours[key] == theirs[key], key
    for key in ("rope_theta", "partial_rotary_factor"):
        assert ours["rope_parameters"][key] == theirs["rope_parameters"][key], key
    assert ours["head_dim"] != hf["hidden_size"] // hf["num_attention_heads"]  # (the case that used to differ)
    with pytest.raises(ValueError, match="head_dim must be a positive integer, got 0"):  # given, not left out
        ModelConfig.from_hf({**hf, "model_type": model_type, "head_dim": 0})


def test_an_edited_header_is_refused_on_load_and_reported_by_verify(tmp_path):
    """A v3 header digest covers the configs, metadata and object table: an edit of one of them (a config value, an
    object's offset) is refused when the artifact opens, and verify - which opens without that check - names it."""
    from click.testing import CliRunner

    from ninfer_bench.cli import main

    for edit in (lambda d: d["metadata"].update(model_id="edited"), lambda d: d["objects"][0].update(offset=256)):
        path = tmp_path / "a.ninfer"
        _write_small(path, 3, metadata={"model_id": "small"})
        _rewrite_doc(path, edit, digest=False)
        with pytest.raises(ArtifactError, match="header digest mismatch"):
            Artifact.open(path)
        r = CliRunner().invoke(main, ["verify", str(path)])
        assert r.exit_code == 1 and "header" in r.output and "changed after writing" in r.output, r.output


def test_upgrade_gives_a_v3_artifact_without_a_header_digest_one(tmp_path, tiny_artifact):
    """Artifacts written before the header digest: verify says plainly it has none, and upgrade writes the same
    artifact (id, objects, bytes) with one."""
    import shutil

    from click.testing import CliRunner

    from ninfer_bench.cli import main

    old, new = tmp_path / "old.ninfer", tmp_path / "new.ninfer"
    shutil.copy(tiny_artifact, old)
    _rewrite_doc(old, lambda d: d["provenance"].pop("header_sha256"))
    with Artifact.open(old) as art:
        tensors = [n for n, t in art.bindings.items() if not isinstance(t, dict) and art.objects[t].kind == "weight"]
    r = CliRunner().invoke(main, ["verify", str(old)])
    assert r.exit_code == 0 and "no header digest" in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(main, ["upgrade", str(old), str(new)])
    assert r.exit_code == 0, r.output
    with Artifact.open(old) as a, Artifact.open(new) as b:
        assert b.provenance["header_sha256"] and a.artifact_id == b.artifact_id
        assert all(ok for _, ok, _ in b.verify())
        for name in tensors:
            assert torch.equal(a.raw(name), b.raw(name))
    with pytest.raises(ArtifactError, match="with a header digest; nothing to upgrade"):
        upgrade(new, tmp_path / "again.ninfer")


def test_the_bundled_artifact_carries_a_header_digest():
    path = bundled_model_path()
    if path is None:
        pytest.skip("no bundled model in this checkout")
    with Artifact.open(path) as art:
        assert art.provenance.get("header_sha256") and all(ok for _, ok, _ in art.check_header())

