"""Vision input: preprocessing against transformers' processors, the tower and mRoPE against transformers'
``Qwen3_5ForConditionalGeneration`` on a tiny random checkpoint made here, the media cache and limits, the CLI and
the HTTP server with images and videos."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ninfer_bench.engine.media import decode as M
from ninfer_bench.engine.artifact.convert import convert
from ninfer_bench.engine.model.hybrid import DECODE
from ninfer_bench.engine.model.rotary import column_axes, mrope_cos_sin
from ninfer_bench.engine.media.prompt import placeholder
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.sampling import SamplingParams

from serveproc import ServeProcess
from tinyhf import TEXT_KW, _perturb

Image = pytest.importorskip("PIL.Image")

ROOT = Path(__file__).resolve().parent.parent
PARITY_RTOL = 1e-4
IMG, VID, VS, VE = 290, 291, 292, 293  # token ids inside the tiny vocabulary of 300
PRE = {"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.48, 0.46, 0.41],
       "image_std": [0.27, 0.26, 0.28], "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64 * 4}}
VIDEO_PRE = {"size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32 * 8}, "fps": 2, "min_frames": 4,
             "max_frames": 16}


def rel_rms(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def noise(h, w, c=3, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, c), dtype=np.uint8)


def png(arr) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def npy(frames, fps=None) -> bytes:
    buf = io.BytesIO()
    if fps is None:
        np.save(buf, frames)
    else:
        np.savez(buf, frames=frames, fps=np.float64(fps))
    return buf.getvalue()


def data_uri(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def write_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer.json whose specials sit at the ids the tiny config names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258, "<|image_pad|>": IMG,
                "<|video_pad|>": VID, "<|vision_start|>": VS, "<|vision_end|>": VE}
    tok = Tokenizer(models.BPE(vocab={**vocab, **specials}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    (folder / "tokenizer.json").write_text(tok.to_str())


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(transformers model, artifact path) of a tiny Qwen3_5ForConditionalGeneration: 2 ViT blocks, patch 8, a
    6 x 6 position table (resampled), 16-dim text rotary split [3, 3, 2] over t, h, w."""
    import transformers as tf

    folder = tmp_path_factory.mktemp("hf_vl")
    torch.manual_seed(5)
    text = {**TEXT_KW, "head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2]}}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                  num_position_embeddings=36)
    cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                           vision_start_token_id=VS, vision_end_token_id=VE)
    model = tf.Qwen3_5ForConditionalGeneration(cfg)
    _perturb(model, 5)
    model.eval()
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PRE))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PRE))
    write_tokenizer(folder)
    art = tmp_path_factory.mktemp("art_vl") / "vl.ninfer"
    convert(folder, art, policy="fp32")
    return model, art


@pytest.fixture(scope="module")
def eng(vl):
    return Engine.load(str(vl[1]), device="cpu", dtype="fp32", kv_dtype="fp32", max_context=1024, prefill_chunk=16)


def transformers_before_5_24() -> bool:
    """Parity here is measured against transformers 5.24 (CI's). 5.17 (the device machine's) composites an RGBA image
    otherwise (device run at f546deb, docs/perf/2026-12-01f-topk-ties-gdn-tile-h200.md; its fla-core problem on CPU
    tensors is suites.hf_peer.cpu_blocked)."""
    import transformers

    return tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2]) < (5, 24)


def hf_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PRE["patch_size"], merge_size=2, temporal_patch_size=2,
                                    image_mean=PRE["image_mean"], image_std=PRE["image_std"], size=PRE["size"])


# ---- preprocessing ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("h,w,mode", [(45, 71, "RGB"), (100, 37, "RGBA"), (9, 13, "RGB"), (300, 211, "L")],
                         ids=["odd", "alpha", "tiny-upscaled", "large-downscaled-grey"])
def test_image_preprocessing_equals_transformers(eng, h, w, mode):
    if mode == "RGBA" and transformers_before_5_24():
        pytest.skip("transformers < 5.24 composites transparency otherwise (ours follows 5.24)")
    arr = noise(h, w, {"RGB": 3, "RGBA": 4, "L": 1}[mode], seed=h)
    img = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    ours = eng.load_media("image", buf.getvalue())
    ref = hf_image_processor()(images=[img], return_tensors="pt")
    assert list(ours.grid) == ref["image_grid_thw"][0].tolist()
    assert torch.equal(ours.pixels, ref["pixel_values"])  # bit-exact: same resampler, same arithmetic


def test_video_preprocessing_equals_transformers_pieces(eng):
    """transformers' video processor needs torchvision, which this environment lacks. Its pieces are compared
    one by one: frame sampling, the resize grid, the patch layout and the timestamps are transformers' own
    functions run here; the resize itself is torch's antialiased uint8 bicubic, which is exactly what torchvision
    runs for uint8 tensors on the CPU (resize_image: native uint8 path, no float round trip); the normalisation
    is transformers' fused ``(x - 255 mean) / (255 std)`` in float32. With torchvision present the whole
    processor is compared too."""
    import importlib

    # the full module path: the package's lazy attribute is a stand-in that demands torchvision
    V = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    frames = np.random.default_rng(1).integers(0, 256, (23, 37, 53, 3), dtype=np.uint8)
    item = eng.load_media("video", npy(frames, fps=6.0))
    cfg = eng.preprocess
    meta = VideoMetadata(total_num_frames=23, fps=6.0)
    hf_self = SimpleNamespace(fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames)
    idx = V.Qwen3VLVideoProcessor.sample_frames(hf_self, meta).tolist()
    assert idx == M.sample_frames(23, 6.0, cfg)
    rh, rw = V.smart_resize(len(idx), 37, 53, temporal_factor=2, factor=16, min_pixels=cfg.video_min_pixels,
                            max_pixels=cfg.video_max_pixels)
    x = torch.from_numpy(frames[idx]).permute(0, 3, 1, 2).contiguous()
    x = torch.nn.functional.interpolate(x, size=(rh, rw), mode="bicubic", align_corners=False, antialias=True)
    mean = torch.tensor(cfg.image_mean) * (1.0 / (1 / 255))
    std = torch.tensor(cfg.image_std) * (1.0 / (1 / 255))
    x = (x.float() - mean[:, None, None]) / std[:, None, None]
    patches, gt, gh, gw = V.Qwen3VLVideoProcessor.patchify(None, x[None], patch_size=8, merge_size=2,
                                                           temporal_patch_size=2)
    assert item.grid == (gt, gh, gw)
    assert torch.equal(item.pixels, patches[0])
    ts = Qwen3VLProcessor._calculate_timestamps(None, np.array(idx), 6.0, 2)
    assert item.timestamps == pytest.approx(ts)
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return
    proc = V.Qwen3VLVideoProcessor(patch_size=8, size=VIDEO_PRE["size"], image_mean=list(cfg.image_mean),
                                   image_std=list(cfg.image_std), min_frames=4, max_frames=16)
    ref = proc(videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], video_metadata=[meta], return_tensors="pt",
               cap_pixels_per_frame=False)
    assert torch.equal(item.pixels, ref["pixel_values_videos"])


def test_video_prompt_layout(eng):
    """Per temporal patch: ``<t seconds><|vision_start|>pads<|vision_end|>`` inside the template's start/end."""
    frames = noise(40, 24, seed=3)[None].repeat(5, axis=0)
    item = eng.load_media("video", npy(frames))
    ids = eng.tokenizer.encode("a" + placeholder("video") + "b")
    full, mp = eng.media_prompt(ids, [item])
    gt, gh, gw = item.grid
    want = eng.tokenizer.encode("a<|vision_start|>")
    for t in item.timestamps:
        want += eng.tokenizer.encode(f"<{t:.1f} seconds><|vision_start|>") + [VID] * (gh * gw // 4) + [VE]
    want += eng.tokenizer.encode("<|vision_end|>b")
    assert full == want and len(item.timestamps) == gt
    assert int(mp.mask.sum()) == item.tokens(2)


# ---- the tower and mRoPE against transformers ------------------------------------------------------------------

def hf_logits(model, ids, **vis):
    t = torch.tensor([ids])
    mm = torch.zeros_like(t, dtype=torch.int32)
    mm[t == IMG], mm[t == VID] = 1, 2
    with torch.no_grad():
        return model(input_ids=t, mm_token_type_ids=mm, **vis).logits[0].float()


def hf_inputs(items):
    """pixel_values / grids for transformers from our preprocessed items (their equality to the processor's is
    tested above)."""
    out = {}
    for kind, key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                ("video", "pixel_values_videos", "video_grid_thw")):
        sel = [it for it in items if it.kind == kind]
        if sel:
            out[key] = torch.cat([it.pixels for it in sel])
            out[grid_key] = torch.tensor([list(it.grid) for it in sel])
    return out


CASES = {
    "image": lambda e: [e.load_media("image", png(noise(45, 71, seed=7)))],
    "video": lambda e: [e.load_media("video", npy(np.random.default_rng(2).integers(0, 256, (9, 30, 50, 3),
                                                                                  dtype=np.uint8), fps=4.0))],
    "image+video+image": lambda e: [e.load_media("image", png(noise(64, 33, seed=8))),
                                    e.load_media("video", npy(np.stack([noise(24, 40, seed=s) for s in range(3)]))),
                                    e.load_media("image", png(noise(17, 90, seed=9)))],
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(vl, eng, case):
    """[text, media, text] prefill (chunks of 16 cut through the vision tokens), then 12 greedy decode steps whose
    rotary positions continue at index + delta, against transformers on the whole sequence."""
    from ninfer_bench.suites.hf_peer import cpu_blocked

    if cpu_blocked():
        pytest.skip(f"transformers cannot run Qwen3.5 on the CPU here: {cpu_blocked()}")
    model, _ = vl
    items = CASES[case](eng)
    text = "Look" + "".join(placeholder(it.kind) + f" and {i} " for i, it in enumerate(items)) + "describe it."
    ids, mp = eng.media_prompt(eng.tokenizer.encode(text), items)
    assert mp.delta < 0 and int(mp.mask.sum()) == sum(it.tokens(2) for it in items)
    vis = hf_inputs(items)
    ref = hf_logits(model, ids, **vis)
    ours = eng.logits(ids, mp)
    err = rel_rms(ours, ref)
    print(f"{case}: prefill logits relative RMS {err:.2e} over {len(ids)} tokens")
    assert err <= PARITY_RTOL

    seq = eng.acquire(ids, SamplingParams(max_new_tokens=13), mp)
    eng.start(seq)
    steps = []
    for _ in range(12):
        _, logits = eng.decode_step([seq], torch.tensor([[seq.last]]), DECODE)
        seq.length += 1
        steps.append(logits[0, -1])
        seq.tokens.append(int(logits[0, -1].argmax()))
    eng.release(seq)
    full = hf_logits(model, ids + seq.tokens[:-1], **vis)[len(ids):]
    err = rel_rms(torch.stack(steps), full)
    print(f"{case}: decode logits relative RMS {err:.2e}")
    assert err <= PARITY_RTOL
    assert torch.equal(torch.stack(steps).argmax(-1), full.argmax(-1))


def test_tower_equals_transformers_per_item(vl, eng):
    model, _ = vl
    items = CASES["image+video+image"](eng)
    vis = hf_inputs(items)
    with torch.no_grad():
        ref = torch.cat(model.model.get_image_features(vis["pixel_values"], vis["image_grid_thw"]).pooler_output)
    ours = eng.vision.encode(torch.cat([items[0].pixels, items[2].pixels]), [items[0].grid, items[2].grid])
    assert rel_rms(ours, ref) <= 1e-5


def test_equal_streams_are_1d_rope_bit_for_bit(eng):
    """Text-only positions through the mRoPE gather give the 1-D tables' rows exactly."""
    m = eng.model
    pos = torch.arange(40).view(2, 20)
    cos, sin = mrope_cos_sin(m.cos, m.sin, pos[None].expand(3, -1, -1), m.mrope_axes)
    assert torch.equal(cos, m.cos[pos]) and torch.equal(sin, m.sin[pos])
    axes = column_axes(16, (3, 3, 2)).tolist()
    assert axes[:8] == [0, 1, 2, 0, 1, 2, 0, 1] and axes[8:] == axes[:8]


def test_image_changes_the_answer_and_cache_encodes_once(eng):
    a, b = png(noise(45, 71, seed=11)), png(noise(45, 71, seed=12))
    ids = eng.tokenizer.encode(placeholder("image") + "what is it?")
    logits = []
    for data in (a, b, a):
        full, mp = eng.media_prompt(ids, [eng.load_media("image", data)])
        logits.append(eng.logits(full, mp))
    assert not torch.allclose(logits[0], logits[1])
    assert torch.equal(logits[0], logits[2])
    assert mp.stats["cached"] == 1 and eng.media_cache.hits >= 1


def test_generate_with_image_reports_vision(eng):
    full, mp = eng.media_prompt(eng.tokenizer.encode(placeholder("image") + "hi"),
                                [eng.load_media("image", png(noise(50, 50, seed=4)))])
    eng.media_cache.clear()
    res = eng.generate(full, max_new_tokens=5, media=mp, ignore_eos=True)
    assert res.completion_tokens == 5
    assert res.vision["tokens"] == int(mp.mask.sum()) and res.vision["encode_ms"] > 0 and res.vision["cached"] == 0
    text_only = eng.generate(eng.tokenizer.encode("hi"), max_new_tokens=3)
    assert text_only.vision == {}


def tiny_with_vision(spec: str) -> Engine:
    """The ``tiny`` preset (MTP head, DFlash drafters) given a seeded random vision tower."""
    from ninfer_bench.engine.artifact.loader import load_source
    from ninfer_bench.engine.runtime.options import EngineOptions
    from ninfer_bench.engine.model.vision import VisionConfig, vision_weight_shapes
    from ninfer_bench.engine.model.weights import RawWeight

    vcfg = VisionConfig(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=96, patch_size=8,
                        num_position_embeddings=16, image_token_id=300, video_token_id=301,
                        vision_start_token_id=302, vision_end_token_id=303)
    g = torch.Generator().manual_seed(0)
    raws = {n: RawWeight("fp32", shape, (0.3 * torch.randn(shape, generator=g)).reshape(-1).view(torch.uint8))
            for n, shape in vision_weight_shapes(vcfg).items()}
    loaded = load_source("tiny")
    loaded.vision = (vcfg, M.PreprocessConfig(patch_size=8, min_pixels=256), raws)
    return Engine(loaded, EngineOptions(device="cpu", kv_dtype="fp32", spec=spec, max_context=512, prefill_chunk=32))


def test_speculative_greedy_with_media_equals_plain():
    """Verify rounds (and the MTP head) rotate generated rows at index + delta: MTP, DFlash2 and a drafter rigged
    to agree for a random prefix all give plain greedy's tokens for a prompt with an image."""
    from spec_rigs import RiggedDrafter, random_prefix

    image = png(noise(40, 56, seed=13))
    outs = {}
    for spec in ("none", "mtp", "dflash2", "rigged"):
        e = tiny_with_vision("mtp" if spec == "rigged" else spec)
        ids, mp = e.media_prompt([72, 105, 302, 300, 303, 32, 119, 104, 97, 116, 63], [e.load_media("image", image)])
        assert mp.delta < 0
        if spec == "rigged":
            e.drafter = RiggedDrafter(e, outs["none"], random_prefix(3, seed=1), e.config.vocab_size)
        res = e.generate(ids, max_new_tokens=24, media=mp, ignore_eos=True)
        outs[spec] = res.tokens
        if spec == "rigged":
            assert res.spec["accepted_tokens"] > 0
    assert outs["mtp"] == outs["none"] and outs["dflash2"] == outs["none"] and outs["rigged"] == outs["none"]


# ---- bad input -------------------------------------------------------------------------------------------------

def test_bad_media_is_a_clear_error(eng, tmp_path):
    cases = [
        ("image", "https://example.com/cat.png", "no network"),
        ("image", "data:image/png;base64,@@@", "not valid base64"),
        ("image", "data:image/png,abc", "malformed data URI"),
        ("image", b"not an image at all", "cannot decode"),
        ("image", png(noise(8, 8))[:40], "cannot decode"),
        ("image", str(tmp_path / "missing.png"), "not found"),
        ("video", b"GIF89a-but-not-really", "cannot decode the video"),
        ("video", npy(np.zeros((3, 8, 8), np.uint8)), "uint8 [frames, height, width, 3]"),
        ("audio", b"x", "image' or 'video'"),
    ]
    for kind, src, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            eng.load_media(kind, src)
    limits, eng.media_limits = eng.media_limits, M.MediaLimits(max_bytes=1000, max_pixels=100 * 100, max_items=2)
    try:
        with pytest.raises(ValueError, match="exceeds the limit of 10,000"):
            eng.load_media("image", png(np.zeros((101, 100, 3), np.uint8)))
        with pytest.raises(ValueError, match="exceeds the limit of 1,000 bytes"):
            eng.load_media("image", png(noise(40, 40)))
        item = eng.load_media("image", png(np.zeros((30, 30, 3), np.uint8)))
        with pytest.raises(ValueError, match="3 media inputs exceed the limit of 2"):
            eng.media_prompt(eng.tokenizer.encode(placeholder("image") * 3), [item] * 3)
        # one request's items share a decoded-bytes budget: two 30 x 30 images fit 5,400 bytes, a third does not
        eng.media_limits = M.MediaLimits(max_request_bytes=2 * 30 * 30 * 3)
        budget = eng.media_budget()
        for _ in range(2):
            eng.load_media("image", png(np.zeros((30, 30, 3), np.uint8)), budget)
        with pytest.raises(ValueError, match="decode to 8,100 bytes, over the limit of 5,400 per request"):
            eng.load_media("image", png(np.zeros((30, 30, 3), np.uint8)), budget)
        eng.load_media("image", png(np.zeros((30, 30, 3), np.uint8)))  # another request: a budget of its own
    finally:
        eng.media_limits = limits
    with pytest.raises(ValueError, match="1 media placeholder"):
        eng.media_prompt(eng.tokenizer.encode(placeholder("image")), [item, item])


def test_exif_orientation_is_applied_like_transformers(eng):
    """A JPEG stored sideways with EXIF orientation 6 (rotate 90 degrees clockwise to show) reaches the tower
    upright, as transformers' load_image turns it: a 32 x 64 stored frame is a 64 x 32 picture."""
    from transformers.image_utils import load_image

    stored = np.zeros((32, 64, 3), np.uint8)
    stored[:, :8] = 255  # a white band on the stored left edge: on top once turned
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(stored).save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    ours = M.decode_image(buf.getvalue(), M.MediaLimits())
    ref = np.asarray(load_image(Image.open(io.BytesIO(buf.getvalue()))))
    assert ours.shape == (64, 32, 3) and np.array_equal(ours, ref)
    assert ours[:8].mean() > 200 and ours[16:].mean() < 50
    assert eng.load_media("image", buf.getvalue()).grid == eng.load_media("image", png(ref)).grid


# a 16 x 32 JPEG whose EXIF block has flipped bytes: Pillow's exif_transpose raises struct.error on it
BAD_EXIF_JPEG = (
    "/9j/4AAQSkZJRgABAQAAAQABAAD/4QBgRXhpZgAATU0AKgAAAAgAAwFOAAIAAAAEY2FtAAESAAMAAAABAAYAAIdpAAQAAAABAAAA"
    "MgAAAAAAAZADAAIAAAAUAAAARAAAAAAyMDIwOjAxOjAxIDAwOjAwOjAwAP/bAEMACAYGBwYFCAcHBwkJCAoMFA0MCwsMGRITDxQd"
    "Gh8eHRocHCAkLicgIiwjHBwoNyksMDE0NDQfJzk9ODI8LjM0Mv/bAEMBCQkJDAsMGA0NGDIhHCEyMjIyMjIyMjIyMjIyMjIyMjIy"
    "MjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMv/AABEIABAAIAMBIgACEQEDEQH/xAAfAAABBQEBAQEBAQAAAAAAAAAAAQID"
    "BAUGBwgJCgv/xAC1EAACAQMDAgQDBQUEBAAAAX0BAgMABBEFEiExQQYTUWEHInEUMoGRoQgjQrHBFVLR8CQzYnKCCQoWFxgZGiUm"
    "JygpKjQ1Njc4OTpDREVGR0hJSlNUVVZXWFlaY2RlZmdoaWpzdHV2d3h5eoOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3"
    "uLm6wsPExcbHyMnK0tPU1dbX2Nna4eLj5OXm5+jp6vHy8/T19vf4+fr/xAAfAQADAQEBAQEBAQEBAAAAAAAAAQIDBAUGBwgJCgv/"
    "xAC1EQACAQIEBAMEBwUEBAABAncAAQIDEQQFITEGEkFRB2FxEyIygQgUQpGhscEJIzNS8BVictEKFiQ04SXxFxgZGiYnKCkqNTY3"
    "ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqCg4SFhoeIiYqSk5SVlpeYmZqio6Slpqeoqaqys7S1tre4ubrCw8TF"
    "xsfIycrS09TV1tfY2dri4+Tl5ufo6ery8/T19vf4+fr/2gAMAwEAAhEDEQA/APEaKKK2MgooooA//9k="
)


def test_an_image_with_unreadable_exif_is_read_as_stored():
    """EXIF that Pillow cannot parse (it raises struct.error, not a ValueError) leaves the image as it is stored,
    as before orientation was applied; it used to escape as an internal error."""
    import base64

    data = base64.b64decode(BAD_EXIF_JPEG)
    assert M.decode_image(data, M.MediaLimits()).shape == (16, 32, 3)


def test_unreadable_and_oversized_files_are_one_line_errors_naming_the_file(eng, tmp_path):
    """Past PIL's own decompression-bomb cap, a corrupt .npz, an unknown format, a truncated animated GIF: each a
    ValueError (the CLI's one-line error) that names the file, no PIL / zipfile exception type escaping."""
    huge = io.BytesIO()
    Image.new("1", (14000, 14000)).save(huge, "PNG")  # 196 M pixels: PIL refuses before our own limit is read
    gif = io.BytesIO()
    frames = [Image.fromarray(noise(20, 30, seed=s)) for s in range(6)]
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:], duration=100)
    files = {"huge.png": ("image", huge.getvalue(), "exceeds the limit of"),
             "huge-as-video.png": ("video", huge.getvalue(), "exceeds the limit of"),
             "bad.npz": ("video", b"PK\x03\x04 not a zip", "cannot read the video array"),
             "bad.png": ("image", b"garbage bytes", "cannot decode the image"),
             "cut.gif": ("video", gif.getvalue()[:len(gif.getvalue()) // 2], "cannot decode the video")}
    for name, (kind, data, message) in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError) as e:
            eng.load_media(kind, str(tmp_path / name))
        text = str(e.value)
        assert text.startswith(f"{kind} {tmp_path / name}: ") and message in text and "\n" not in text, text
        assert "BytesIO" not in text, text
    with pytest.raises(ValueError, match=r"^cannot read the video array"):  # bytes: nothing to name
        eng.load_media("video", b"PK\x03\x04 not a zip")


def small_npy() -> bytes:
    out = io.BytesIO()
    np.save(out, np.zeros((2, 8, 8, 3), np.uint8))
    return out.getvalue()


def big_fps() -> bytes:
    """An ``fps`` member whose header declares 10 GB (its body is never read)."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "<f8", "fortran_order": False, "shape": (1250000000,)})
    return out.getvalue()


def test_video_decode_size_is_checked_before_anything_is_inflated(eng, monkeypatch):
    """A video's decoded size comes from its header: a .npz whose ``frames`` header declares 100 GB is refused
    before np.load would inflate it (a few compressed MB can decode to that), as are .npy arrays and the sampled
    frames of an animated image past ``max_video_bytes``."""
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False,
                                                 "shape": (100000, 1000, 1000, 3)})
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w") as z:
        z.writestr("frames.npy", header.getvalue())  # the header alone: np.load would fail on the data, later
    with pytest.raises(ValueError, match=r"video frames of \[100000, 1000, 1000, 3\] decode to 300,000,000,000 bytes"):
        eng.load_media("video", bomb.getvalue())
    for members in ({"frames": header.getvalue()},  # numpy also finds a member named without .npy
                    {"frames.npy": small_npy(), "fps.npy": big_fps()}):
        archive = io.BytesIO()
        with zipfile.ZipFile(archive, "w") as z:
            for name, body in members.items():
                z.writestr(name, body)
        with pytest.raises(ValueError, match="decode to 300,000,000,000 bytes|'fps' must be one number"):
            eng.load_media("video", archive.getvalue())
    small = io.BytesIO()
    np.save(small, np.zeros((4, 16, 16, 3), np.uint8))
    gif = io.BytesIO()
    frames = [Image.fromarray(noise(16, 16, seed=s)) for s in range(4)]
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:], duration=500)
    assert eng.load_media("video", small.getvalue()).kind == "video"
    monkeypatch.setattr(eng.media_limits, "max_video_bytes", 1000)  # 4 x 16 x 16 x 3 = 3,072 bytes now too many
    with pytest.raises(ValueError, match="video frames of .* over the limit of 1,000"):
        eng.load_media("video", small.getvalue())
    with pytest.raises(ValueError, match="sampled video frames of .* over the limit of 1,000"):
        eng.load_media("video", gif.getvalue())


def test_model_without_vision_refuses_media(tiny_artifact):
    plain = Engine.load(str(tiny_artifact), device="cpu", kv_dtype="fp32", max_context=128)
    with pytest.raises(ValueError, match="no vision component"):
        plain.load_media("image", png(noise(20, 20)))


def test_artifact_vision_component_is_checked(vl, tmp_path):
    from ninfer_bench.engine.artifact.reader import Artifact
    from ninfer_bench.engine.artifact.writer import write_artifact
    from ninfer_bench.engine.artifact.loader import load_artifact

    _, art = vl
    with Artifact.open(art) as a:
        comp = a.components["vision"]
        assert comp["config"]["depth"] == 2 and comp["preprocess"]["patch_size"] == 8
        assert all(a.info(n).format == "fp32" for n in comp["tensors"])
        tensors = {n: ("fp32", a.tensor(n)) for n in a.names()}
        components = dict(a.components)
    bad = tmp_path / "bad.ninfer"
    components["vision"] = {**components["vision"], "config": {**components["vision"]["config"], "hidden_size": 48,
                                                               "num_heads": 3}}
    write_artifact(bad, tensors=tensors, components=components)
    with pytest.raises(ValueError, match="vision tensor vision.patch_embed.proj.weight has shape"):
        load_artifact(bad)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "nb.py"), "verify", str(bad)], capture_output=True,
                         text=True, env={**os.environ, "NO_COLOR": "1"})
    assert out.returncode == 1 and "vision component" in out.stderr


def test_vision_weights_are_never_quantized():
    from ninfer_bench.engine.artifact.convert import vision_format

    assert vision_format((32, 32), "q4") == "bf16" and vision_format((32,), "mixed") == "fp32"
    assert vision_format((32, 32), "fp32") == "fp32"


# ---- CLI and server ----------------------------------------------------------------------------------------------

def cli(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "nb.py"), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_cli_generate_and_decode_with_image(vl, tmp_path):
    _, art = vl
    (tmp_path / "cat.png").write_bytes(png(noise(45, 71, seed=21)))
    np.save(tmp_path / "clip.npy", np.random.default_rng(3).integers(0, 256, (6, 30, 40, 3), dtype=np.uint8))
    out = cli("generate", str(art), "-p", "Describe.", "--image", str(tmp_path / "cat.png"), "--video",
              str(tmp_path / "clip.npy"), "-n", "4", "--device", "cpu", "--chat")
    assert out.returncode == 0, out.stderr
    assert re.search(r"vision: \d+ tokens encoded in", out.stderr)
    doc = tmp_path / "decode.json"
    out = cli("decode", "--model", str(art), "--image", str(tmp_path / "cat.png"), "-n", "4", "--repeats", "2",
              "--warmup", "0", "--device", "cpu", "--json", str(doc))
    assert out.returncode == 0, out.stderr
    s = json.loads(doc.read_text())["summary"]
    assert s["vision_tokens"] == 12 and s["vision_encode_ms"] > 0
    assert len(s["samples"]["vision_encode_ms"]) == 2


@pytest.fixture(scope="module")
def vl_server(vl, tmp_path_factory):
    """``serve`` of the tiny VL artifact without --media-dir."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    server = ServeProcess(vl[1], tmp_path_factory.mktemp("vl_serve") / "server.log", max_context=2048)
    yield server
    server.stop()


def vl_chat(server, parts, **kw):
    return server.post("/v1/chat/completions", {"model": server.model, "max_tokens": 4, "temperature": 0,
                                                "messages": [{"role": "user", "content": parts}], **kw})


def test_server_openai_and_anthropic_with_media(vl_server, eng):
    server = vl_server
    image = png(noise(45, 71, seed=31))
    n_vis = eng.load_media("image", image).tokens(2)
    chat = lambda parts, **kw: vl_chat(server, parts, **kw)  # noqa: E731
    ok = chat([{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": data_uri(image)}}], return_token_ids=True)
    assert ok.status_code == 200, ok.text
    body = ok.json()
    assert body["prompt_token_ids"].count(IMG) == n_vis
    assert body["usage"]["completion_tokens"] == 4
    video = chat([{"type": "video_url", "video_url": {"url": data_uri(npy(np.stack([noise(24, 40, seed=s)
                                                                                     for s in range(4)])),
                                                                      "application/octet-stream")}},
                  {"type": "text", "text": "and this?"}])
    assert video.status_code == 200, video.text

    msg = {"model": server.model, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
           "messages": [{"role": "user", "content": [
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(image).decode()}},
               {"type": "text", "text": "What is this?"}]}]}
    r = server.post("/v1/messages", msg)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"].count(IMG) == n_vis and len(r.json()["token_ids"]) == 4
    count = server.post("/v1/messages/count_tokens", {k: msg[k] for k in ("model", "messages")})
    assert count.json()["input_tokens"] == len(r.json()["prompt_token_ids"])

    big = io.BytesIO()  # 9000 x 9000 grey: ~80 KB of PNG, 81 M pixels > the 67 M limit
    Image.new("L", (9000, 9000)).save(big, "PNG")
    bad = [
        (chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]), "base64"),
        (chat([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]), "no network"),
        (chat([{"type": "image_url", "image_url": {"url": data_uri(b"garbage")}}]), "cannot decode"),
        (chat([{"type": "image_url", "image_url": {"url": data_uri(big.getvalue())}}]), "exceeds the limit"),
        (chat([{"type": "image_url", "image_url": {}}]), "expected a data URI"),
        (server.post("/v1/messages", {**msg, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}), "no network"),
    ]
    for resp, text in bad:
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert text in err["message"], err
    after = chat([{"type": "text", "text": "still there?"}])
    assert after.status_code == 200
    assert server.health()["status"] == "ok"


def test_server_reads_no_local_file_without_media_dir(vl_server, tmp_path):
    """Without --media-dir a path or file:// URL is a 400 whose message is the same whether the file exists or not
    (a readable image included), for images and videos; nothing is read."""
    real = tmp_path / "cat.png"
    real.write_bytes(png(noise(45, 71, seed=31)))
    np.save(tmp_path / "clip.npy", np.zeros((4, 16, 16, 3), np.uint8))
    messages = set()
    for kind, path in [("image", str(real)), ("image", str(tmp_path / "missing.png")), ("image", "/etc/passwd"),
                       ("image", "/etc/nonexistent"), ("image", f"file://{real}"), ("image", "file:///etc/passwd"),
                       ("video", str(tmp_path / "clip.npy")), ("video", "../../etc/passwd")]:
        part = f"{kind}_url"
        r = vl_chat(vl_server, [{"type": part, part: {"url": path}}, {"type": "text", "text": "what?"}])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "data URI" in err["message"] and "--media-dir" in err["message"], err
        messages.add(re.sub(r"'[^']*'(\.\.\.)?", "PATH", err["message"], count=1))
    assert len(messages) == 1, messages
    assert vl_server.health()["status"] == "ok"


def test_server_media_dir_confines_paths(vl, tmp_path):
    """With --media-dir DIR: a relative path, an absolute one and a file:// URL inside DIR give the data URI's
    answer; a path that leaves DIR (absolute, "..", a symlink to a file outside, another host) is a 400 that is the
    same for an existing and a missing target."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    folder, outside = tmp_path / "media", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    image = png(noise(45, 71, seed=31))
    (folder / "cat.png").write_bytes(image)
    (outside / "secret.png").write_bytes(image)
    (folder / "link.png").symlink_to(outside / "secret.png")
    (folder / "up").symlink_to(outside)
    server = ServeProcess(vl[1], tmp_path / "server.log", "--media-dir", str(folder), max_context=2048)
    try:
        def ask(url):
            return vl_chat(server, [{"type": "image_url", "image_url": {"url": url}}], return_token_ids=True)

        want = ask(data_uri(image))
        assert want.status_code == 200, want.text
        for url in ["cat.png", str(folder / "cat.png"), f"file://{folder / 'cat.png'}", "./sub/../cat.png"]:
            r = ask(url)
            assert r.status_code == 200, (url, r.text)
            assert r.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
        messages = set()
        for url in [str(outside / "secret.png"), str(outside / "missing.png"), "../outside/secret.png",
                    "../outside/missing.png", "link.png", "up/secret.png", "up/missing.png", "/etc/passwd",
                    "/etc/nonexistent", f"file://{outside / 'secret.png'}", "file:///etc/passwd"]:
            r = ask(url)
            assert r.status_code == 400, (url, r.text)
            messages.add(re.sub(r"'[^']*'(\.\.\.)?", "PATH", r.json()["error"]["message"], count=1))
        assert messages == {"media PATH: not a path inside the server's media folder"}
        missing = ask("missing.png")  # inside the folder the operator opened: that it is missing may be said
        assert missing.status_code == 400 and "not found in the server's media folder" in missing.text
        assert "a local path" in ask(f"file://otherhost{folder / 'cat.png'}").json()["error"]["message"]
    finally:
        server.stop()
    from ninfer_bench.engine.serve.app import ServerOptions

    with pytest.raises(ValueError, match="media-dir .* is not a folder"):
        ServerOptions(port=0, media_dir=str(folder / "cat.png"))


def test_request_source_is_confined(tmp_path):
    """The reading rule itself: data URIs pass untouched; no file without a folder; inside the folder only regular
    files (a FIFO is refused without blocking); a symlink loop or NUL byte is refused like any outside path."""
    from ninfer_bench.engine.media.sources import request_source

    limits = M.MediaLimits(max_bytes=100)
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "big.bin").write_bytes(b"x" * 101)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    os.mkfifo(tmp_path / "fifo")
    assert request_source("data:image/png;base64,AAAA", None, limits) == "data:image/png;base64,AAAA"
    assert request_source("a.bin", str(tmp_path), limits) == b"x" * 10
    for source, folder, message in [
        (str(tmp_path / "a.bin"), None, "reads no local files"), (b"bytes", str(tmp_path), "must be a data URI"),
        ("ftp://host/a.png", str(tmp_path), "unsupported media URL scheme"),
        ("big.bin", str(tmp_path), "exceeds the limit of 100 bytes"), ("fifo", str(tmp_path), "is not a file"),
        (".", str(tmp_path), "is not a file"), ("loop", str(tmp_path), "not a path inside"),
        ("a\0.bin", str(tmp_path), "not a path inside"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            request_source(source, folder, limits)


# ---- fps of .npz videos, placeholders without media (CLI and server) ---------------------------------------------

BAD_FPS = {"zero": np.float64(0), "negative": np.float64(-3), "nan": np.float64("nan"), "inf": np.float64("inf"),
           "array": np.array([1.0, 2.0]), "text": np.array("fast")}


def npz_fps(fps) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, frames=np.random.default_rng(3).integers(0, 256, (6, 30, 40, 3), dtype=np.uint8), fps=fps)
    return buf.getvalue()


@pytest.mark.parametrize("name", list(BAD_FPS))
def test_npz_fps_must_be_finite_positive(eng, name):
    with pytest.raises(ValueError, match=r"^a \.npz video's 'fps' must be"):
        eng.load_media("video", npz_fps(BAD_FPS[name]))


def test_npz_fps_accepted_and_tiny_fps_does_not_overflow(eng):
    # 4 of 6 frames at 3 fps: frames 0, 2, 3, 5; the first temporal patch spans 0 and 2/3 s
    assert eng.load_media("video", npz_fps(np.int64(3))).timestamps[0] == pytest.approx(1 / 3)
    assert M.sample_frames(6, 5e-324, eng.preprocess) == [0, 1, 2, 3, 4, 5]  # 6 / fps is infinite


def test_placeholders_without_media_are_refused(eng):
    for text, found in [("<|image_pad|> what", "['image']"), ("a <|video_pad|> b <|image_pad|>", "['video', 'image']"),
                        (placeholder("image") + " what", "['image']")]:
        with pytest.raises(ValueError, match=re.escape(f"placeholder(s) {found} for 0 media input(s)")):
            eng.media_prompt(eng.tokenizer.encode(text), [])
    ids = eng.tokenizer.encode("<|vision_start|> plain text")  # start / end markers take no vision features
    assert eng.media_prompt(ids, []) == (ids, None)


def test_cli_bad_fps_and_placeholders_are_one_line_errors(vl, tmp_path):
    _, art = vl
    for name in ("zero", "array"):
        (tmp_path / f"{name}.npz").write_bytes(npz_fps(BAD_FPS[name]))
        out = cli("generate", str(art), "--video", str(tmp_path / f"{name}.npz"), "-p", "hi", "-n", "2", "--device",
                  "cpu")
        want = f"error: video {tmp_path / name}.npz: a .npz video's 'fps' must be"
        assert out.returncode == 1 and out.stderr.startswith(want), out.stderr
        assert out.stderr.count("\n") == 1, out.stderr
    out = cli("generate", str(art), "-p", "<|image_pad|> what", "-n", "2", "--device", "cpu")
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: the prompt has 1 media placeholder(s) ['image'] for 0 media input(s)")


def test_server_bad_fps_is_a_400(vl_server):
    for name, fps in BAD_FPS.items():
        r = vl_chat(vl_server, [{"type": "video_url", "video_url": {"url": data_uri(npz_fps(fps), "x/npz")}},
                                {"type": "text", "text": "and this?"}])
        assert r.status_code == 400, (name, r.text)
        assert "'fps' must be" in r.json()["error"]["message"], (name, r.text)
    assert vl_server.health()["status"] == "ok"


def test_server_refuses_placeholders_without_media(vl_server):
    """Typed into the text with no media, in every route that takes a prompt; a 400 naming the field."""
    s, typed = vl_server, "<|image_pad|> what"
    base = {"model": s.model, "max_tokens": 2}
    replies = [
        (s.post("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": typed}]}), "messages"),
        (vl_chat(s, [{"type": "text", "text": typed}]), "messages"),
        (s.post("/v1/completions", {**base, "prompt": typed}), "prompt"),
        (s.post("/v1/completions", {**base, "prompt": [72, IMG, 105]}), "prompt"),
        (s.post("/v1/messages", {**base, "messages": [{"role": "user", "content": typed}]}), None),
        (s.post("/v1/messages/count_tokens", {"model": s.model, "messages": [{"role": "user", "content": typed}]}),
         None),
    ]
    for r, param in replies:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "1 media placeholder(s) ['image'] for 0 media input(s)" in err["message"], err
        assert param is None or err["param"] == param, err
    ok = s.post("/v1/completions", {**base, "prompt": "what"})
    assert ok.status_code == 200, ok.text


def test_patch_geometry_without_a_preprocessor_config_is_the_towers(tmp_path):
    """A folder without preprocessor_config.json cuts patches as its tower embeds them (8 pixels here, not the
    processor's default 16, which failed at the first image: "pixels must be [.., 384] ... got [.., 1536]"); a
    preprocessor_config.json that disagrees with the tower is refused by convert, and an artifact that holds such a
    pair by load, not at the first image."""
    import transformers as tf

    from ninfer_bench.engine.artifact.reader import Artifact
    from ninfer_bench.engine.artifact.writer import write_artifact
    from ninfer_bench.engine.artifact.loader import load_artifact

    folder = tmp_path / "hf"
    torch.manual_seed(7)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                  num_position_embeddings=36)
    cfg = tf.Qwen3_5Config(text_config={**TEXT_KW, "num_hidden_layers": 4}, vision_config=vision, image_token_id=IMG,
                           video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    tf.Qwen3_5ForConditionalGeneration(cfg).eval().save_pretrained(folder)
    write_tokenizer(folder)
    art = tmp_path / "vl.ninfer"
    convert(folder, art, policy="fp32")
    eng = Engine.load(str(art), device="cpu", dtype="fp32", kv_dtype="fp32", max_context=1024)
    assert eng.preprocess.patch_size == 8
    item = eng.load_media("image", png(noise(37, 53, seed=4)), eng.media_budget())
    ids, media = eng.media_prompt(eng.tokenizer.encode(placeholder("image") + "What?"), [item])
    assert eng.generate(ids, max_new_tokens=2, media=media).vision["tokens"] > 0

    (folder / "preprocessor_config.json").write_text(json.dumps({**PRE, "patch_size": 16}))
    with pytest.raises(ValueError, match="preprocessor's patch_size 16 differs from the vision tower's patch_size 8"):
        convert(folder, tmp_path / "bad.ninfer", policy="fp32")
    with Artifact.open(art) as a:
        tensors = {n: ("fp32", a.tensor(n)) for n in a.names()}
        components = dict(a.components)
    components["vision"] = {**components["vision"], "preprocess": {**components["vision"]["preprocess"],
                                                                   "patch_size": 16}}
    write_artifact(tmp_path / "bad.ninfer", tensors=tensors, components=components)
    with pytest.raises(ValueError, match="vision component: the preprocessor's patch_size 16"):
        load_artifact(tmp_path / "bad.ninfer")


@pytest.mark.parametrize("edit, message", [
    (lambda hf: hf.update(vision_config="none"), "vision_config must be an object, got 'none'"),
    (lambda hf: hf["text_config"]["rope_parameters"].update(mrope_section=["x", 3, 2]),
     "mrope_section must be 3 non-negative integers, got \\('x', 3, 2\\)"),
    (lambda hf: hf["text_config"]["rope_parameters"].update(mrope_section=[3, 3]), "mrope_section must be 3"),
])
def test_vision_config_values_of_the_wrong_kind_are_named(edit, message):
    """A vision_config that is not an object is an error, not a text-only model (its tower's weights would be
    dropped); an mrope_section that is not three integers is named."""
    from ninfer_bench.engine.model.vision import VisionConfig

    hf = {"model_type": "qwen3_5", "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2,
                                                     "intermediate_size": 64, "out_hidden_size": 48,
                                                     "num_position_embeddings": 16, "patch_size": 8},
          "text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}},
          "image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 7, "vision_end_token_id": 8}
    assert VisionConfig.from_hf(hf).mrope_section == (3, 3, 2)
    edit(hf)
    with pytest.raises(ValueError, match=message):
        VisionConfig.from_hf(hf)
