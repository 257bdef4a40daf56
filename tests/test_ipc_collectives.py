"""kernels/ipc_collectives.py: the tensor-parallel ranks' all-reduce and all-gather over CUDA IPC, on GPUs (two ranks
on one GPU where there is only one: a check of the code, its spin-waits taking turns with the other process), and the
engine's collectives through it, captured in its CUDA graphs. The parts that need no GPU: the switch and the refusals."""

from __future__ import annotations

import pytest
import torch

from ninfer_bench.kernels import ipc_collectives as ic

needs_ipc = pytest.mark.skipif(ic._cupy.import_error("IPC collectives") is not None,
                               reason=f"no CUDA / cupy here: {ic._cupy.import_error('IPC collectives')}")


def test_the_switch_is_checked_and_zero_keeps_torch_distributed(monkeypatch):
    from ninfer_bench.engine.model.tensor_parallel import TPGroup

    group = TPGroup(0, 2)
    monkeypatch.setenv("NINFER_BENCH_TP_IPC", "0")
    assert group.use_ipc(torch.device("cuda")) == "NINFER_BENCH_TP_IPC=0" and group.ipc is None
    monkeypatch.setenv("NINFER_BENCH_TP_IPC", "yes")
    with pytest.raises(ValueError, match="NINFER_BENCH_TP_IPC"):
        group.use_ipc(torch.device("cuda"))


def test_cpu_ranks_keep_torch_distributed():
    """Two gloo ranks on CPUs: create says why not, on every rank, and nothing is allocated."""
    from ninfer_bench.engine.runtime.parallel import launch
    from tp_ranks import _ipc_on_cpu

    whys = launch(2, _ipc_on_cpu, backend="gloo")
    assert whys == ["rank 0: not on a GPU; rank 1: not on a GPU"] * 2


def test_every_build_compiles_for_sm90_without_spills():
    """With the [offline] extra (NVRTC's wheel, Triton's ptxas): each (ranks, dtype, vectors) build for sm_90a."""
    from test_ptxas_report import _load, _offline_ready

    pr = _load()
    if not _offline_ready(pr):
        pytest.skip("no NVRTC wheel / ptxas (pip install -e '.[offline]')")
    nvrtc, ptxas = pr._nvrtc(), pr._ptxas()
    source = ic._SOURCE.read_bytes()
    for ranks in (2, 4, 8):
        for dt in (0, 1, 2):
            for vec in (False, True):
                r = pr.assemble(ptxas, pr.compile_ptx(nvrtc, source, ic.kernel_options(ranks, dt, vec, 1 << 20)))
                assert r["spill_stores"] == 0 and 0 < r["registers"] <= 64, (ranks, dt, vec, r)


@needs_ipc
def test_two_ranks_reduce_and_gather_exactly():
    from ninfer_bench.engine.runtime.parallel import launch
    from tp_ranks import _ipc_collectives

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    for r in launch(2, _ipc_collectives, 2, backend=backend, timeout_s=240):
        assert r["why"] is None, r["why"]
        assert r["reduce"] and all(r["reduce"]), r["reduce"]
        assert r["gather"] and all(r["gather"]), r["gather"]
        assert r["graph"] and all(r["graph"]), r["graph"]


@needs_ipc
def test_engine_collectives_through_ipc_are_captured_and_keep_the_tokens():
    """The tiny preset split over two ranks: with IPC its collectives are captured in the engine's CUDA graphs, and
    its greedy tokens (plain, MTP3) equal those of the eager run through torch.distributed's collectives (rank-order
    sums of two bf16 values round alike), on every rank."""
    from ninfer_bench.engine.runtime.parallel import launch
    from tp_ranks import _ipc_engine

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    ipc = launch(2, _ipc_engine, 2, True, backend=backend, timeout_s=400)
    eager = launch(2, _ipc_engine, 2, False, backend=backend, timeout_s=400)
    for a, b in zip(ipc, eager):
        assert a["why"] is None and a["graphs"], a["why"]
        assert b["why"] == "NINFER_BENCH_TP_IPC=0" and not b["graphs"]
        assert a["none"] == b["none"] and a["mtp"] == b["mtp"]
    assert ipc[0]["mtp"] == ipc[0]["none"]
