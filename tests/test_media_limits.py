"""The per-request media budget: all of one request's items together decode to at most
``MediaLimits.max_request_bytes``, each charged from its header before its pixels are inflated."""

from __future__ import annotations

import io

import numpy as np
import pytest

from ninfer_bench.engine.media import decode as M

Image = pytest.importorskip("PIL.Image")

CFG = M.PreprocessConfig(patch_size=8, min_pixels=16 * 16, max_pixels=64 * 64, video_min_pixels=16 * 16,
                         video_max_pixels=32 * 32 * 8)


def png(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def npy(frames: int, h: int, w: int) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.zeros((frames, h, w, 3), np.uint8))
    return buf.getvalue()


def gif(frames: int, h: int, w: int) -> bytes:
    buf = io.BytesIO()
    imgs = [Image.fromarray(np.full((h, w, 3), 40 * i, np.uint8)) for i in range(frames)]
    imgs[0].save(buf, "GIF", save_all=True, append_images=imgs[1:], duration=500)
    return buf.getvalue()


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "8"])
def test_max_request_bytes_is_validated(value):
    with pytest.raises(ValueError, match="max_request_bytes must be a positive integer"):
        M.MediaLimits(max_request_bytes=value)


def test_default_total_takes_one_video_at_the_per_item_cap():
    limits = M.MediaLimits()
    assert limits.max_request_bytes >= limits.max_video_bytes


def test_items_of_one_request_share_the_total(monkeypatch):
    """Each 20x20 image (1,200 bytes decoded) is under every per-item limit; the third one of a request is over
    the request's total, and is refused before its pixels are read."""
    limits = M.MediaLimits(max_request_bytes=3000)
    budget = M.MediaBudget(limits)
    for _ in range(2):
        M.load_media("image", png(20, 20), CFG, limits, budget)
    assert budget.used == 2400

    def inflated(img):
        raise AssertionError("the image was decoded before the request total was checked")

    monkeypatch.setattr(M, "_rgb", inflated)
    with pytest.raises(ValueError, match=r"^image of 20x20: the request's media would decode to 3,600 bytes, "
                                         r"over the limit of 3,000 per request$"):
        M.load_media("image", png(20, 20), CFG, limits, budget)
    assert budget.used == 2400  # a refused item takes nothing
    monkeypatch.undo()
    M.load_media("image", png(20, 20), CFG, limits, M.MediaBudget(limits))  # the next request starts afresh
    M.load_media("image", png(20, 20), CFG, limits)  # without a budget an item is held to the total alone
    with pytest.raises(ValueError, match="over the limit of 1,000 per request"):
        M.load_media("image", png(20, 20), CFG, M.MediaLimits(max_request_bytes=1000))


def test_videos_are_charged_from_their_headers(monkeypatch):
    """An .npy video is charged from its header before np.load inflates it, an animated image's sampled frames
    before they are decoded; images and videos draw on the same total."""
    limits = M.MediaLimits(max_request_bytes=4 * 16 * 16 * 3 + 16 * 16 * 3)
    budget = M.MediaBudget(limits)
    M.load_media("video", npy(4, 16, 16), CFG, limits, budget)
    monkeypatch.setattr(M, "_read_array", lambda data: pytest.fail("np.load ran before the request total check"))
    with pytest.raises(ValueError, match=r"video frames of \[4, 16, 16, 3\]: the request's media would decode to "
                                         r"6,144 bytes, over the limit of 3,840 per request"):
        M.load_media("video", npy(4, 16, 16), CFG, limits, budget)
    monkeypatch.setattr(M, "_rgb", lambda img: pytest.fail("frames were decoded before the request total check"))
    with pytest.raises(ValueError, match=r"sampled video frames of \[4, 16, 16, 3\]: .* over the limit of "
                                         r"3,840 per request"):
        M.load_media("video", gif(4, 16, 16), CFG, limits, budget)
    with pytest.raises(ValueError, match=r"image of 20x20: .* 4,272 bytes, over the limit of 3,840"):
        M.load_media("image", png(20, 20), CFG, limits, budget)
    assert budget.used == 3072


def test_an_npz_is_charged_for_the_member_np_load_reads(monkeypatch):
    """An archive holding both ``frames`` and ``frames.npy`` (and ``fps`` / ``fps.npy``): np.load reads the member
    named without .npy, so that is the header checked and charged; a small ``frames.npy`` beside a large ``frames``
    used to pass the checks with np.load then inflating the large one."""
    import zipfile

    def archive(**members) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            for name, body in members.items():
                z.writestr(name.replace("_npy", ".npy"), body)
        return out.getvalue()

    small, large = npy(4, 16, 16), npy(64, 64, 64)
    limits = M.MediaLimits(max_video_bytes=10_000)
    monkeypatch.setattr(M, "_read_array", lambda data: pytest.fail("np.load ran before the size checks"))
    with pytest.raises(ValueError, match=r"video frames of \[64, 64, 64, 3\] decode to 786,432 bytes, over the limit "
                                         r"of 10,000"):
        M.load_media("video", archive(frames_npy=small, frames=large), CFG, limits)
    budget = M.MediaBudget(M.MediaLimits(max_request_bytes=10_000))
    with pytest.raises(ValueError, match=r"video frames of \[64, 64, 64, 3\]: the request's media would decode to "
                                         r"786,432 bytes"):
        M.load_media("video", archive(frames=large, frames_npy=small), CFG, budget.limits, budget)
    one, many = io.BytesIO(), io.BytesIO()
    np.save(one, np.float64(2))
    np.save(many, np.zeros(1000))
    with pytest.raises(ValueError, match=r"'fps' must be one number, got a float64 array of shape \[1000\]"):
        M.load_media("video", archive(frames=small, fps_npy=one.getvalue(), fps=many.getvalue()), CFG, limits)
