"""The kernels suite's projection family: every weight projection of a decode step at a model config's shapes, in
its stored format (an artifact's own with --model; else engine.artifact.convert.weight_format under the --quant policy;
mixed, a preset's default: attention q5, MLP / GDN q4, GDN b / a bf16, lm_head q8): attention q+gate, k, v, o; GDN
qkv, z, b, a, out; MLP gate, up, down; lm_head; the row-concatenations v3 launches as one (attention q+gate+k+v when
their formats match, else k+v; GDN qkv+z and b+a, MLP gate+up); and the MLP's gate / up through to
``silu(gate) * up``. The other families are in
``suites/kernel_ops.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..engine.model.weights import GATE_UP_RUN, interleave_order
from ..engine.runtime.options import EngineOptions
from ..kernels import qmv_cuda, quant
from ..kernels.qlinear import MAX_KERNEL_ROWS, PackedLinear
from ..kernels.qlinear import triton_available as qlinear_triton_available
from .kernel_cases import Case, Impl, KernelContext, register, v3_impl

F32 = torch.float32


def projection_bytes(fmt: str, n: int, k: int, t: int, elt: int) -> int:
    """Weight bytes as stored (``quant.nbytes``) + activations in ([t, k]) and out ([t, n]) of ``elt`` bytes."""
    return quant.nbytes(fmt, (n, k)) + t * k * elt + t * n * elt


@dataclass(slots=True)
class _Weight:
    ref: torch.Tensor  # [N, K] fp32, the stored weight dequantized exactly
    dense: torch.Tensor  # [N, K] in the compute dtype: what v2 (and every CPU run) multiplies with
    packed: PackedLinear | None  # v3 on CUDA, for the quantized formats
    buf: torch.Tensor | None = None  # the packed bytes (row-major sections) the packed weight was made from


def _layout(ctx: KernelContext) -> str:
    """The engine's layout of a packed weight: qmv's when the compute dtype is 16-bit (EngineOptions.qmv_layout)."""
    return EngineOptions().qmv_layout if ctx.dtype in (torch.bfloat16, torch.float16) else "rows"


def _weight(ctx: KernelContext, name: str, fmt: str, n: int, k: int) -> _Weight:
    buf = quant.pack(ctx.randn(n, k, gen=ctx.generator(name, "w"), dtype=F32, scale=k ** -0.5), fmt)
    ref = quant.dequantize(buf, fmt, (n, k), F32)
    if fmt not in quant.QUANT_FORMATS:
        return _Weight(ref, ref.to(ctx.dtype), None)
    return _Weight(ref, ref.to(ctx.dtype), PackedLinear(buf, fmt, (n, k), ctx.device, layout=_layout(ctx)), buf)


def _chain(ctx: KernelContext, key: str, first: PackedLinear, buf, fmt: str, shape: tuple[int, int], launch):
    """Case.chain for a packed weight: ``first`` and n - 1 copies of its bytes (``buf()``: row-major sections, cloned
    so that no two launches read the same memory), each launched by ``launch(lin)``. The copies are made once per n
    and op (freed with the op's other weights)."""
    def copies(n: int) -> list[PackedLinear]:
        raw = buf()
        return [first] + [PackedLinear(raw.clone(), fmt, shape, ctx.device, layout=_layout(ctx)) for _ in range(n - 1)]

    def chain(n: int):
        lins = ctx.memo((key, n), lambda: copies(n))
        return lambda: [launch(lin) for lin in lins]
    return chain


def _hd(c):
    return c.num_attention_heads * c.head_dim


def _kv(c):
    return c.num_key_value_heads * c.head_dim


_A, _G, _M = "model.layers.3.self_attn.", "model.layers.0.linear_attn.", "model.layers.0.mlp."
# op -> (the stored weight whose format applies, (N, K) of the config)
PROJECTIONS = {
    "attn.q_gate": (_A + "q_proj.weight", lambda c: (2 * _hd(c), c.hidden_size)),
    "attn.k": (_A + "k_proj.weight", lambda c: (_kv(c), c.hidden_size)),
    "attn.v": (_A + "v_proj.weight", lambda c: (_kv(c), c.hidden_size)),
    "attn.kv": (_A + "k_proj.weight", lambda c: (2 * _kv(c), c.hidden_size)),
    "attn.qkv": (_A + "q_proj.weight", lambda c: (2 * _hd(c) + 2 * _kv(c), c.hidden_size)),
    "attn.o": (_A + "o_proj.weight", lambda c: (c.hidden_size, _hd(c))),
    "gdn.qkv": (_G + "in_proj_qkv.weight", lambda c: (c.conv_dim, c.hidden_size)),
    "gdn.z": (_G + "in_proj_z.weight", lambda c: (c.value_dim, c.hidden_size)),
    "gdn.qkvz": (_G + "in_proj_qkv.weight", lambda c: (c.conv_dim + c.value_dim, c.hidden_size)),
    "gdn.b": (_G + "in_proj_b.weight", lambda c: (c.linear_num_value_heads, c.hidden_size)),
    "gdn.a": (_G + "in_proj_a.weight", lambda c: (c.linear_num_value_heads, c.hidden_size)),
    "gdn.ba": (_G + "in_proj_b.weight", lambda c: (2 * c.linear_num_value_heads, c.hidden_size)),
    "gdn.out": (_G + "out_proj.weight", lambda c: (c.hidden_size, c.value_dim)),
    "mlp.gate": (_M + "gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    "mlp.up": (_M + "up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    "mlp.gate_up": (_M + "gate_proj.weight", lambda c: (2 * c.intermediate_size, c.hidden_size)),
    "mlp.down": (_M + "down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),
    "lm_head": ("lm_head.weight", lambda c: (c.vocab_size, c.hidden_size)),
}


def _projection(name: str, dims, ctx: KernelContext, t: int, _param) -> Case:
    n, k = dims(ctx.cfg)
    fmt = ctx.weight_format(name, (n, k))
    w = ctx.memo("weight", lambda: _weight(ctx, name, fmt, n, k))
    x = ctx.randn(t, k, gen=ctx.generator(name, "x", t))  # [T, K]
    dt = str(ctx.dtype).replace("torch.", "")
    v2 = Impl(lambda: F.linear(x, w.dense), f"dense {dt} weight, F.linear")
    if w.packed is None:
        v3 = Impl(v2.run, f"{fmt} weight: dense F.linear, as v2")
    else:
        path = "tensor-core qmv (CuPy)" if qmv_cuda.supports(x, w.packed) else "Triton qlinear"
        v3 = v3_impl(ctx, Impl(lambda: w.packed(x), f"packed {fmt}, {path}"),
                 Impl(lambda: w.packed(x), f"dense {dt} F.linear on the dequantized {fmt} weight"),
                 qlinear_triton_available() and t <= MAX_KERNEL_ROWS)
    chain = _chain(ctx, "chain", w.packed, lambda: w.buf, fmt, (n, k), lambda lin: lin(x)) \
        if w.packed is not None and ctx.cuda and qmv_cuda.supports(x, w.packed) else None
    return Case([n, k], projection_bytes(fmt, n, k, t, ctx.elt), lambda: x.float() @ w.ref.T,
                {"v2": v2, "v3": v3}, {"fmt": fmt}, chain)


for _op, (_name, _dims) in PROJECTIONS.items():
    register(op=_op, family="projection", tolerance=(1e-4, 6e-3))(
        lambda ctx, t, param, _name=_name, _dims=_dims: _projection(_name, _dims, ctx, t, param))


@register(op="mlp.gate_up_silu", family="projection", tolerance=(1e-4, 1e-2))
def _gate_up_silu(ctx: KernelContext, t: int, _param) -> Case:
    """The MLP's gate / up projection through to ``silu(gate) * up``, as each runtime runs it: v2 the dense product
    and the eager activation; v3 on CUDA qmv's epilogue on the interleaved weight (EngineOptions.silu_epilogue),
    elsewhere the packed product and the activation."""
    inter, k = ctx.cfg.intermediate_size, ctx.cfg.hidden_size
    name = _M + "gate_proj.weight"
    fmt = ctx.weight_format(name, (2 * inter, k))
    w = ctx.memo("weight", lambda: _weight(ctx, name, fmt, 2 * inter, k))  # rows: gate, then up
    x = ctx.randn(t, k, gen=ctx.generator(name, "x", t))

    def act(gu):
        return F.silu(gu[:, :inter]) * gu[:, inter:]

    ref = lambda: act(x.float() @ w.ref.T)  # noqa: E731
    v2 = Impl(lambda: act(F.linear(x, w.dense)), "dense F.linear, then F.silu(gate) * up")
    mixed = ctx.memo("interleaved", lambda: _interleaved(ctx, w, fmt, inter, k))
    chain = None
    if w.packed is None:
        v3 = Impl(v2.run, f"{fmt} weight: as v2")
    elif mixed is not None and mixed.silu_mul(x) is not None:
        v3 = Impl(lambda: mixed.silu_mul(x), f"packed {fmt}, rows interleaved: qmv storing silu(gate) * up")
        chain = _chain(ctx, "chain-interleaved", mixed, lambda: mixed.row_major().buf, fmt, (2 * inter, k),
                       lambda lin: lin.silu_mul(x))
    else:
        v3 = v3_impl(ctx, Impl(lambda: act(w.packed(x)), f"packed {fmt}, Triton qlinear, then F.silu(gate) * up"),
                     Impl(lambda: act(w.packed(x)), f"dense F.linear on the dequantized {fmt} weight, then the "
                          "activation"), qlinear_triton_available() and t <= MAX_KERNEL_ROWS)
    return Case([2 * inter, k], projection_bytes(fmt, 2 * inter, k, t, ctx.elt) - t * inter * ctx.elt, ref,
                {"v2": v2, "v3": v3}, {"fmt": fmt}, chain)


def _interleaved(ctx: KernelContext, w: _Weight, fmt: str, inter: int, k: int) -> PackedLinear | None:
    """The packed gate_up weight with its rows interleaved as the engine stores it, or None where the engine keeps
    none (a dense format, an intermediate size that is no multiple of the run, or no qmv to read it)."""
    if w.packed is None or inter % GATE_UP_RUN or ctx.device.type != "cuda" or not qmv_cuda.available():
        return None
    buf = quant.take_rows(w.packed.row_major().buf.cpu(), fmt, (2 * inter, k), interleave_order(2 * inter))
    return PackedLinear(buf, fmt, (2 * inter, k), ctx.device, layout=_layout(ctx))
