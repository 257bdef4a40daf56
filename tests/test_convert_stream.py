"""Conversion streams: row blocks pack to the whole tensor's bytes, FP8 rows dequantize as the whole does, a
checkpoint converts in memory bounded by its largest tensor (not its size), and the GPU packs the CPU's bytes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ninfer_bench.engine.artifact import fp8
from ninfer_bench.engine.artifact.format import ArtifactError
from ninfer_bench.engine.artifact.reader import Artifact
from ninfer_bench.engine.artifact.source import TensorSource, row_blocks
from ninfer_bench.engine.artifact.writer import write_artifact
from ninfer_bench.engine.model.config import ModelConfig
from ninfer_bench.engine.model.weights import expected_shapes, text_weight_names
from ninfer_bench.kernels import quant

FORMATS = ("fp32", "bf16", "q8_g32_fp16", "q5_g64_fp16", "q4_g64_fp16")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(1, 33), (7, 64), (130, 100), (5, 3, 70)])
@pytest.mark.parametrize("rows", [1, 3, 64, 1000])
def test_pack_blocks_is_pack(fmt, shape, rows):
    gen = torch.Generator().manual_seed(hash((fmt, shape, rows)) % 2**31)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])
    w[0, ..., 0] = 0.0
    whole = quant.pack(w, fmt)
    streamed = torch.cat([c.reshape(-1) for c in quant.pack_blocks(row_blocks(w, rows), fmt, shape)])
    assert torch.equal(streamed, whole)


def test_pack_blocks_refuses_missing_rows():
    w = torch.randn(10, 64)
    with pytest.raises(ValueError, match="blocks gave 4 rows"):
        list(quant.pack_blocks(row_blocks(w[:4], 2), "q4_g64_fp16", (10, 64)))


@pytest.mark.parametrize("block", [(128, 128), (3, 16), None])
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_rows_dequantize_as_the_whole(block, per_row):
    if per_row and block is not None:
        pytest.skip("per-row scales have no block")
    n, k = 300, 200
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) if block else \
        torch.rand(n, 1, generator=gen) if per_row else torch.rand(1, generator=gen)
    whole = fp8.dequantize(w, scale, block, "w")
    for r0, r1 in ((0, 1), (5, 130), (127, 129), (250, 300), (0, 300)):
        part = fp8.dequantize(w[r0:r1], scale, block, "w", row0=r0, rows=n)
        assert torch.equal(part, whole[r0:r1]), (r0, r1)


def test_source_blocks_and_whole_sources():
    t = torch.arange(70.0).reshape(10, 7)
    reads = []

    def read(r0, r1):
        reads.append((r0, r1))
        return t[r0:r1]

    assert torch.equal(torch.cat(list(TensorSource((10, 7), read).blocks(4))), t)
    assert reads == [(0, 4), (4, 8), (8, 10)]
    reads.clear()
    assert [b.shape[0] for b in TensorSource((10, 7), read, whole=True).blocks(4)] == [4, 4, 2]
    assert reads == [(0, 10)]  # read once, then sliced


def test_nonfinite_values_counted_through_every_block(tmp_path):
    w = torch.randn(64, 32)
    w[1, 3], w[60, 0] = float("nan"), float("inf")
    src = TensorSource((64, 32), lambda r0, r1: w[r0:r1])
    with pytest.raises(ArtifactError, match="tensor w has 2 non-finite value"):
        write_artifact(tmp_path / "a.ninfer", tensors={"w": ("q4_g64_fp16", src)}, block_bytes=256)
    assert not (tmp_path / "a.ninfer").exists()


# A checkpoint of 82 MiB (bf16), its largest tensors 16 MiB. Converting it whole grew memory by 190 MiB (measured
# with the converter before streaming); streamed it grows by about 47 MiB, one block's work and the allocator's slack.
_CFG = dict(vocab_size=32768, hidden_size=256, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=128, linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False)


def _checkpoint(folder):
    cfg = ModelConfig(**_CFG)
    shapes = expected_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16) for n in text_weight_names(cfg)}
    folder.mkdir()
    half = len(tensors) // 2
    names = list(tensors)
    index = {}
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: tensors[n] for n in part}, str(folder / f"model-{i}.safetensors"))
        index.update({n: f"model-{i}.safetensors" for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf()))
    total = sum(t.numel() * 2 for t in tensors.values())
    largest = max(t.numel() * 2 for t in tensors.values())
    return total, largest


_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[3])
    import _bootstrap  # a plain checkout (the GPU machine) has no installed package
    _bootstrap.ensure_package()
    from ninfer_bench.engine.artifact.convert import convert
    from ninfer_bench.engine.artifact.hf_checkpoint import HFCheckpoint
    HFCheckpoint(sys.argv[1])  # imports and one header read before the baseline
    def status(key):
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
    # VmHWM is this process's own peak (ru_maxrss would carry the forking parent's across exec); reset it to the
    # present where the kernel lets us, else it keeps the imports' peak and the growth measured is an upper bound
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = status("VmRSS")
    convert(sys.argv[1], sys.argv[2], policy="mixed", block_bytes=4 << 20)
    print(json.dumps({"base": base, "peak": status("VmHWM")}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc (Linux)")
def test_convert_memory_is_bounded_by_a_block_not_the_checkpoint(tmp_path):
    total, largest = _checkpoint(tmp_path / "hf")
    scripts = Path(__file__).resolve().parent.parent / "scripts"
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "hf"), str(tmp_path / "a.ninfer"), str(scripts)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grew = m["peak"] - m["base"]
    # the bound is 1 GB + 2 x the largest tensor (bf16) at the real scale; here, beyond what the import holds, 2 x the
    # largest + 48 MiB (80 MiB): a converter that holds the model fails it, one block's work passes
    assert grew < 2 * largest + (48 << 20), f"convert grew by {grew / 2**20:.0f} MiB on a {total / 2**20:.0f} MiB " \
                                            f"checkpoint (largest tensor {largest / 2**20:.0f} MiB)"
    with Artifact.open(tmp_path / "a.ninfer") as art:
        assert all(ok for _, ok, _ in art.verify())
        assert art.info("model.embed_tokens.weight").format == "q8_g32_fp16"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packs_the_cpu_bytes():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(513, 4160, generator=gen) * torch.logspace(-4, 3, 4160)
    # values whose group amax sits where x / qmax and x * (1 / qmax) round apart
    w[:, :64] = torch.linspace(1, 2, 64 * 513).reshape(513, 64)
    for fmt in FORMATS:
        assert torch.equal(quant.pack(w.cuda(), fmt).cpu(), quant.pack(w, fmt)), fmt


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_convert_on_the_gpu_writes_the_cpu_artifact(tmp_path):
    from ninfer_bench.engine.artifact.convert import convert

    _checkpoint(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "cpu.ninfer", device="cpu")
    convert(tmp_path / "hf", tmp_path / "gpu.ninfer", device="cuda")
    with Artifact.open(tmp_path / "cpu.ninfer") as a, Artifact.open(tmp_path / "gpu.ninfer") as b:
        assert [o.sha256 for o in a.objects.values()] == [o.sha256 for o in b.objects.values()]
