"""Images and videos for the vision tower: reading (data URIs, local files, raw bytes), decoding, preprocessing
to patch rows, and the encoder-output cache keyed by SHA-256. Sources an HTTP client names are read through
:func:`.sources.request_source`: data URIs, and files only inside a folder the server's operator allowed.

Preprocessing follows transformers' processors for Qwen3.5 so the tower sees the same numbers:

- images: ``Qwen2VLImageProcessorPil`` - RGB (transparency composited on white), resized with PIL bicubic to
  the ``smart_resize`` grid (sides multiples of ``patch * merge``, pixel count within [min, max]),
  ``x / 255`` (float64, then float32), ``(x - mean) / std``, each image repeated as ``temporal_patch_size``
  identical frames. ``image_resample="torch"`` resizes like the torchvision-backed ``Qwen2VLImageProcessor``
  instead (torch's antialiased bicubic, a = -0.75, where PIL's kernel has a = -0.5; the two differ by a few
  grey levels).
- videos: ``Qwen3VLVideoProcessor`` - ``fps`` frames per second sampled uniformly (``min_frames`` ..
  ``max_frames``), resized with torch's antialiased uint8 bicubic (what torchvision runs on the CPU) to the
  video ``smart_resize`` grid, ``(x - 255 mean) / (255 std)`` in float32, the last frame repeated up to a
  multiple of ``temporal_patch_size``. Timestamps (seconds, averaged over each temporal patch) are written
  into the prompt as the processor does. A one-frame video, which transformers refuses, is padded instead.

Rows come out in spatial-merge-block order: ``[t, h/m, w/m, m, m]`` patches, each row ``[C, Tp, P, P]``.
Video decoding without FFmpeg: ``.npy`` ``[T, H, W, 3]`` uint8 arrays, ``.npz`` with ``frames`` (and ``fps``),
and animated GIF / PNG / WebP through PIL; other containers need PyAV.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

from .sources import MediaBudget, MediaLimits, declared_type, read_source

DEFAULT_VIDEO_FPS = 24.0  # what transformers assumes for frames without metadata


@dataclass(slots=True)
class PreprocessConfig:
    """The processor parameters of one model (the artifact's vision component keeps them)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    min_pixels: int = 65536
    max_pixels: int = 16777216
    video_min_pixels: int = 4096
    video_max_pixels: int = 25165824
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    image_resample: str = "pil"

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                     "video_min_pixels", "video_max_pixels", "min_frames", "max_frames"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"preprocess config: {name} must be a positive integer, got {value!r}")
        self.image_mean, self.image_std = tuple(map(float, self.image_mean)), tuple(map(float, self.image_std))
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(f"preprocess config: image_mean / image_std must be 3 values (std > 0), got "
                             f"{self.image_mean} / {self.image_std}")
        if self.min_pixels > self.max_pixels or self.video_min_pixels > self.video_max_pixels:
            raise ValueError("preprocess config: a min_pixels exceeds its max_pixels")
        if not self.fps > 0 or self.min_frames > self.max_frames:
            raise ValueError(f"preprocess config: fps must be > 0 and min_frames <= max_frames, got fps {self.fps}, "
                             f"frames {self.min_frames}..{self.max_frames}")
        if self.image_resample not in ("pil", "torch"):
            raise ValueError(f"preprocess config: image_resample must be 'pil' or 'torch', got {self.image_resample!r}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PreprocessConfig":
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"preprocess config: unknown field(s) {unknown}")
        return cls(**d)

    @classmethod
    def from_hf(cls, image: dict | None, video: dict | None) -> "PreprocessConfig":
        """From ``preprocessor_config.json`` and ``video_preprocessor_config.json`` (either may be missing)."""
        image, video, out = image or {}, video or {}, {}
        for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std"):
            if key in image:
                out[key] = image[key]
        size, vsize = image.get("size") or {}, video.get("size") or {}
        for key, value in (("min_pixels", size.get("shortest_edge", image.get("min_pixels"))),
                           ("max_pixels", size.get("longest_edge", image.get("max_pixels"))),
                           ("video_min_pixels", vsize.get("shortest_edge", video.get("min_pixels"))),
                           ("video_max_pixels", vsize.get("longest_edge", video.get("max_pixels"))),
                           ("fps", video.get("fps")), ("min_frames", video.get("min_frames")),
                           ("max_frames", video.get("max_frames"))):
            if value is not None:
                out[key] = value
        return cls(**out)


@dataclass(slots=True)
class MediaInput:
    """One preprocessed image or video: patch rows ``[t*h*w, C*Tp*P*P]`` fp32, its grid, and its digest."""

    kind: str  # "image" | "video"
    sha256: str
    pixels: torch.Tensor
    grid: tuple[int, int, int]
    timestamps: list[float] = field(default_factory=list)  # video: seconds per temporal patch

    def tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // (merge * merge)


# ---- decoding ---------------------------------------------------------------------------------------------------

UNREADABLE = {"image": "cannot decode the image: not a format PIL reads (PNG, JPEG, WebP, GIF, ...)",
              "video": "cannot decode the video: this build reads .npy / .npz frame arrays and animated GIF / PNG / "
                       "WebP (other containers need FFmpeg, which is not used here)"}


def _open_pil(data: bytes, limits: MediaLimits, kind: str = "image"):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))  # reads the header only: the size is checked before any decoding
    except Image.DecompressionBombError as e:  # past PIL's own cap (~179 M pixels), an Exception, not a ValueError
        raise ValueError(f"image exceeds the limit of {limits.max_pixels:,} pixels ({e})") from None
    except UnidentifiedImageError:
        raise ValueError(UNREADABLE[kind]) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot decode the {kind} ({type(e).__name__}: {e})") from None
    w, h = img.size
    what = "image" if kind == "image" else "video frame"
    if w * h > limits.max_pixels:
        raise ValueError(f"{what} of {w}x{h} = {w * h:,} pixels exceeds the limit of {limits.max_pixels:,}")
    if w < 1 or h < 1:
        raise ValueError(f"{what} of {w}x{h} pixels is empty")
    return img


def _rgb(img) -> np.ndarray:
    """``[H, W, 3]`` uint8; transparency composited onto white (transformers' convert_to_rgb)."""
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        img = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), img)
    return np.asarray(img.convert("RGB"))


def decode_image(data: bytes, limits: MediaLimits, budget: MediaBudget | None = None) -> np.ndarray:
    """An encoded image (PNG, JPEG, WebP, ...) as ``[H, W, 3]`` uint8, turned upright by its EXIF orientation
    (as transformers' ``load_image`` does: a phone photo stored sideways is seen the way it is shown). Its
    decoded size is charged to ``budget`` (the request's) from the header, before any pixel is read."""
    from PIL import ImageOps

    img = _open_pil(data, limits)
    if budget is not None:
        budget.charge(img.size[0] * img.size[1] * 3, f"image of {img.size[0]}x{img.size[1]}")
    try:
        img = ImageOps.exif_transpose(img)
    except Exception:  # unreadable EXIF (struct / key errors, not just ValueError): the image as it is stored
        pass
    try:
        return _rgb(img)
    except (OSError, ValueError) as e:  # a truncated or corrupt body fails only when pixels are read
        raise ValueError(f"cannot decode the image ({type(e).__name__}: {e})") from None


def video_fps(value) -> float:
    """A ``.npz`` video's ``fps`` as a float: a finite positive scalar, since frame sampling divides by it and the
    timestamps written into the prompt are frame index / fps."""
    arr = np.asarray(value)
    if arr.shape != () or arr.dtype.kind not in "iuf":
        raise ValueError(f"a .npz video's 'fps' must be one number, got a {arr.dtype} array of shape {list(arr.shape)}")
    fps = float(arr)
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"a .npz video's 'fps' must be a finite positive number, got {fps}")
    return fps


def _npy_header(stream, what: str) -> tuple[tuple[int, ...], np.dtype]:
    try:
        version = np.lib.format.read_magic(stream)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(stream)
    except Exception as e:  # zip / zlib / header errors alike
        raise ValueError(f"cannot read the video array ({what}: not a readable .npy header: {e})") from None
    return tuple(shape), dtype


def _declared_arrays(data: bytes) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The shape and dtype each array of a ``.npy`` (``frames``) or ``.npz`` (``frames``, ``fps``: members named
    with or without ``.npy``, as numpy finds them) declares in its header, read without inflating any data. An
    archive that does not open is left to the full read, which names what is wrong."""
    import zipfile

    if data[:6] == b"\x93NUMPY":
        return {"frames": _npy_header(io.BytesIO(data), "frames")}
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = set(archive.namelist())
    except Exception:
        return {}
    out = {}
    for key in ("frames", "fps"):
        # the member np.load reads for the key: one named without .npy wins over one with it (NpzFile's lookup)
        member = next((m for m in (key, f"{key}.npy") if m in names), None)
        if member is not None:
            try:
                stream = archive.open(member)
            except Exception as e:
                raise ValueError(f"cannot read the video array ({member}: {e})") from None
            out[key] = _npy_header(stream, member)
    return out


def _check_video_bytes(shape, itemsize: int, limits: MediaLimits, what: str, budget: MediaBudget | None) -> None:
    """Refuse frames of ``shape`` past the per-video limit, then charge them to the request's ``budget``."""
    n = math.prod(shape) * itemsize
    if n > limits.max_video_bytes:
        raise ValueError(f"{what} of {list(shape)} decode to {n:,} bytes, over the limit of "
                         f"{limits.max_video_bytes:,}")
    if budget is not None:
        budget.charge(n, f"{what} of {list(shape)}")


def _read_array(data: bytes) -> tuple[np.ndarray, float]:
    """(frames, fps) of a ``.npy`` array or a ``.npz`` with ``frames`` (and ``fps``). A ``.npz`` member is read
    only when indexed, so a corrupt archive (zipfile / zlib errors, not ValueErrors) can fail there too."""
    import zipfile
    import zlib

    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
        if not isinstance(arr, np.lib.npyio.NpzFile):
            return arr, DEFAULT_VIDEO_FPS
        members = {k: arr[k] for k in ("frames", "fps") if k in arr.files}
    except (ValueError, zipfile.BadZipFile, zlib.error, OSError, EOFError, KeyError) as e:
        raise ValueError(f"cannot read the video array ({e})") from None
    if "frames" not in members:
        raise ValueError("a .npz video needs a 'frames' array (and optionally 'fps')")
    fps = video_fps(members["fps"]) if "fps" in members else DEFAULT_VIDEO_FPS
    return members["frames"], fps


def decode_video(data: bytes, cfg: PreprocessConfig, limits: MediaLimits,
                 budget: MediaBudget | None = None) -> tuple[np.ndarray, float, list[int]]:
    """(sampled frames ``[T, H, W, 3]`` uint8, the video's fps, the sampled frame indices). The frames' decoded
    size is checked and charged to ``budget`` (the request's) from headers, before they are inflated."""
    if data[:6] == b"\x93NUMPY" or data[:4] == b"PK\x03\x04":
        declared = _declared_arrays(data)  # checked before np.load inflates anything
        if "frames" in declared:
            shape, dtype = declared["frames"]
            _check_video_bytes(shape, dtype.itemsize, limits, "video frames", budget)
        if "fps" in declared and math.prod(declared["fps"][0]) * declared["fps"][1].itemsize > 16:
            shape, dtype = declared["fps"]
            raise ValueError(f"a .npz video's 'fps' must be one number, got a {dtype} array of shape {list(shape)}")
        arr, fps = _read_array(data)
        if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3 or 0 in arr.shape:
            raise ValueError(f"a video array must be uint8 [frames, height, width, 3], got {arr.dtype} "
                             f"{list(arr.shape)}")
        if arr.shape[1] * arr.shape[2] > limits.max_pixels:
            raise ValueError(f"video frames of {arr.shape[2]}x{arr.shape[1]} exceed the limit of "
                             f"{limits.max_pixels:,} pixels")
        idx = sample_frames(arr.shape[0], fps, cfg)
        return arr[idx], fps, idx
    img = _open_pil(data, limits, "video")  # an oversized frame says so; an unknown container names what is read
    try:  # a truncated or corrupt body fails only when frames are read
        total = getattr(img, "n_frames", 1)
        durations = []
        for i in range(min(total, 64)):  # the mean frame duration of the first frames gives the fps
            img.seek(i)
            durations.append(img.info.get("duration") or 0)
        mean_ms = sum(durations) / len(durations)
        fps = 1000.0 / mean_ms if mean_ms > 0 else DEFAULT_VIDEO_FPS
        idx = sample_frames(total, fps, cfg)
    except (OSError, EOFError, ValueError) as e:
        raise ValueError(f"cannot decode the video ({type(e).__name__}: {e})") from None
    _check_video_bytes((len(idx), img.size[1], img.size[0], 3), 1, limits, "sampled video frames", budget)
    try:
        frames = []
        for i in idx:
            img.seek(i)
            frames.append(_rgb(img))
    except (OSError, EOFError, ValueError) as e:
        raise ValueError(f"cannot decode the video ({type(e).__name__}: {e})") from None
    return np.stack(frames), fps, idx


# ---- preprocessing ---------------------------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 frames: int = 1, temporal: int = 1) -> tuple[int, int]:
    """Sides that are multiples of ``factor``, near the aspect ratio, with ``t * h * w`` in the pixel bounds
    (images: frames = temporal = 1; videos: the sampled frame count rounded to the temporal patch)."""
    if frames > 1 or temporal > 1:  # the video variant first scales tiny frames up to one factor
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal if temporal > 1 else 1
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(frames: torch.Tensor, cfg: PreprocessConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``frames [T, C, H, W]`` (T a multiple of Tp) as rows ``[t*h*w, C*Tp*P*P]`` in merge-block order."""
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    t, c, h, w = frames.shape
    gt, gh, gw = t // tp, h // p, w // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, Tp, P, P]
    return x.reshape(gt * gh * gw, c * tp * p * p).contiguous(), (gt, gh, gw)


def _resize_torch(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``[T, C, H, W]`` resized with torch's antialiased bicubic (torchvision's CPU path for uint8)."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    return torch.nn.functional.interpolate(frames, size=size, mode="bicubic", align_corners=False, antialias=True)


def image_patches(img: np.ndarray, cfg: PreprocessConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An ``[H, W, 3]`` uint8 image as patch rows and its grid ``(1, h, w)``."""
    h, w = smart_resize(img.shape[0], img.shape[1], cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if cfg.image_resample == "pil":
        from PIL import Image

        resized = np.asarray(Image.fromarray(img).resize((w, h), Image.BICUBIC)) if (h, w) != img.shape[:2] else img
        x = resized.transpose(2, 0, 1)
    else:
        x = _resize_torch(torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))[None], (h, w))[0].numpy()
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)  # transformers' rescale: float64, then float32
    mean, std = (np.asarray(v, np.float32)[:, None, None] for v in (cfg.image_mean, cfg.image_std))
    x = (x - mean) / std
    frames = torch.from_numpy(np.ascontiguousarray(x))[None].expand(cfg.temporal_patch_size, -1, -1, -1)
    return patchify(frames, cfg)


def sample_frames(total: int, fps: float, cfg: PreprocessConfig) -> list[int]:
    """Indices of the frames kept: ``cfg.fps`` per second of video, within min/max frames (transformers' rule)."""
    n = int(min(total / fps * cfg.fps, total))  # capped before int(): a tiny fps makes the quotient infinite
    n = min(max(n, cfg.min_frames), cfg.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def frame_timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame times (the processor's rule)."""
    idx = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    secs = [i / fps for i in idx]
    return [(secs[i] + secs[i + temporal - 1]) / 2 for i in range(0, len(secs), temporal)]


def video_patches(frames: np.ndarray, cfg: PreprocessConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Sampled ``[T, H, W, 3]`` uint8 frames as patch rows and their grid ``(t, h, w)``."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [T, C, H, W]
    if x.shape[0] < cfg.temporal_patch_size:  # transformers refuses this; one frame is a still clip
        x = torch.cat([x, x[-1:].expand(cfg.temporal_patch_size - x.shape[0], -1, -1, -1)])
    h, w = smart_resize(x.shape[2], x.shape[3], cfg.factor, cfg.video_min_pixels, cfg.video_max_pixels,
                        frames=x.shape[0], temporal=cfg.temporal_patch_size)
    x = _resize_torch(x.contiguous(), (h, w)).float()
    # transformers fuses rescale into normalize: (x - mean / (1/255)) / (std / (1/255)) in float32
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32) * (1.0 / (1 / 255))
    std = torch.tensor(cfg.image_std, dtype=torch.float32) * (1.0 / (1 / 255))
    x = (x - mean[:, None, None]) / std[:, None, None]
    if pad := -x.shape[0] % cfg.temporal_patch_size:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    return patchify(x, cfg)


def load_media(kind: str, source, cfg: PreprocessConfig, limits: MediaLimits,
               budget: MediaBudget | None = None) -> MediaInput:
    """Read, decode and preprocess one image or video (ValueError with a message for people on bad input).
    ``budget``: the request's :class:`MediaBudget`, shared by all its items so that together they decode to at
    most ``limits.max_request_bytes``; without one the item is held to that total alone."""
    if kind not in ("image", "video"):
        raise ValueError(f"media kind must be 'image' or 'video', got {kind!r}")
    budget = MediaBudget(limits) if budget is None else budget
    data = read_source(source, limits)
    check_declared_type(declared_type(source), data, kind)
    digest = hashlib.sha256(kind.encode() + b"\0" + data).hexdigest()
    try:
        if kind == "image":
            pixels, grid = image_patches(decode_image(data, limits, budget), cfg)
            return MediaInput("image", digest, pixels, grid)
        frames, fps, idx = decode_video(data, cfg, limits, budget)
        pixels, grid = video_patches(frames, cfg)
        return MediaInput("video", digest, pixels, grid, frame_timestamps(idx, fps, cfg.temporal_patch_size))
    except ValueError as e:
        if (name := _file_name(source)) is None:
            raise
        raise ValueError(f"{kind} {name}: {e}") from None  # several --image / --video: which one it was


# what a data URI may declare for the bytes PIL finds (its format name); npy / npz frames declare these or none
PIL_TYPES = {"PNG": {"image/png", "image/apng", "video/apng"}, "JPEG": {"image/jpeg", "image/jpg", "image/pjpeg"},
             "WEBP": {"image/webp", "video/webp"}, "GIF": {"image/gif", "video/gif"}, "BMP": {"image/bmp"},
             "TIFF": {"image/tiff"}, "ICO": {"image/x-icon", "image/vnd.microsoft.icon"},
             "PPM": {"image/x-portable-pixmap"}}
ARRAY_TYPES = {"application/octet-stream", "application/x-npy", "application/x-npz", "application/zip",
               "application/x-numpy", "application/npy"}
GENERIC = {"image/*", "video/*", "application/octet-stream"}


def check_declared_type(declared: str | None, data: bytes, kind: str) -> None:
    """ValueError when a data URI's declared media type disagrees with what its bytes are (``image/png`` over JPEG
    bytes, a PDF declared as an image): a client's label is not taken on trust. No declared type, or a generic one,
    checks nothing here (the decoder still refuses what it cannot read)."""
    if declared is None or declared in GENERIC:
        return
    if data[:6] == b"\x93NUMPY" or data[:4] == b"PK\x03\x04":  # .npy / .npz frames (videos)
        if declared not in ARRAY_TYPES and not any(k in declared for k in ("npy", "npz", "numpy")):
            raise ValueError(f"the data URI declares {declared}, but its bytes are a numpy array file")
        return
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:  # the header only
            fmt = img.format
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return  # not an image PIL knows: the decoder says what is wrong with it
    if declared not in PIL_TYPES.get(fmt, {f"image/{str(fmt).lower()}"}):
        raise ValueError(f"the data URI declares {declared}, but its bytes are a {fmt} {kind if fmt else 'file'}")


def _file_name(source) -> str | None:
    """The path a local-file source names (what an error should show), None for bytes and data URIs."""
    if isinstance(source, (str, os.PathLike)) and not os.fspath(source)[:5].lower() == "data:":
        return os.fspath(source)
    return None


class MediaCache:
    """Vision-tower outputs by the SHA-256 of the media bytes, least recently used dropped past ``max_bytes``."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = self.hits = self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        out = self.items.get(key)
        if out is None:
            self.misses += 1
            return None
        self.items.move_to_end(key)
        self.hits += 1
        return out

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes or key in self.items:
            return
        self.items[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        self.items.clear()
        self.bytes = 0
