"""kernels/l2_prefetch off the GPU: which tensors a projection's prefetch covers, and that nothing happens outside
a CUDA-graph capture (the GPU side is in tests/test_cuda_engine.py::test_l2_prefetch_changes_no_token)."""

from __future__ import annotations

import torch

from ninfer_bench.engine import quant
from ninfer_bench.engine.weights import DenseLinear
from ninfer_bench.kernels import l2_prefetch
from ninfer_bench.kernels import qlinear as ql


def test_weight_tensors():
    dense = DenseLinear(torch.zeros(8, 16))
    assert [t is dense.weight for t in l2_prefetch.weight_tensors(dense)] == [True]
    packed = ql.PackedLinear(quant.pack(torch.randn(32, 128), "q5_g64_fp16"), "q5_g64_fp16", (32, 128), "cpu")
    assert l2_prefetch.weight_tensors(packed) == []  # no qmv tiles on the CPU: nothing a decode kernel streams
    assert l2_prefetch.weight_tensors(object()) == []


def test_nothing_happens_outside_a_capture():
    launches = l2_prefetch._STATE["launches"]
    try:
        l2_prefetch.set_enabled(True, torch.device("cpu"))
        l2_prefetch.prefetch([torch.zeros(1024)])
        l2_prefetch.join(torch.device("cpu"))
    finally:
        l2_prefetch.set_enabled(False)
    assert l2_prefetch._STATE["launches"] == launches and not l2_prefetch._STATE["forked"]
