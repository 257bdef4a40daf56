"""Weights bound to a device: dense or packed-quantized linears, embeddings, and the small fp32 vectors.

The model never looks at formats: it calls ``store.linear(name)(x)``, ``store.embed(ids)`` and
``store.vector(name)``. How a weight is held depends on the runtime:

- ``v3`` on CUDA: q4/q5/q8 projections stay packed and run through the fused dequantize-multiply kernel
  (``kernels.qlinear``); sibling projections that read the same input are concatenated row-wise into one
  launch (MLP gate+up, GDN qkv+z, GDN b+a, attention k+v), with bytes unchanged.
- ``v2`` (and every CPU run): each weight is dequantized once to the compute dtype and multiplied with
  ``F.linear``; a CPU speculative engine also packs the larger ones for its rounds' k + 1 rows (MKL's packed GEMM,
  ``WeightStore.pack_rows``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...kernels import quant
from .config import ModelConfig

# (fused name, member suffixes) per layer kind, tried in this order; members must share K and format to fuse, and
# a weight joins one fusion at most (q, k and v together when they can, else k and v).
FUSIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_attn.in_proj_qkvz": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
    "self_attn.kv_proj": ("self_attn.k_proj", "self_attn.v_proj"),
}


@dataclass(slots=True)
class RawWeight:
    """A weight as stored: its format, logical shape and packed bytes (flat uint8, any device)."""

    fmt: str
    shape: tuple[int, ...]
    buf: torch.Tensor

    @property
    def nbytes(self) -> int:
        return quant.nbytes(self.fmt, self.shape)

    def dense(self, dtype=torch.float32, device=None) -> torch.Tensor:
        buf = self.buf if device is None else self.buf.to(device)
        return quant.dequantize(buf, self.fmt, self.shape, dtype)


# A packed embedding table whose dense copy takes at most this many bytes is kept dense (the same values: the rows are
# dequantized as a lookup dequantizes them): a lookup is then one gather, where the packed table's costs four launches
# (the codes' and the scales' gathers, the product, the cast): about 8 against 1.5 us of the bundled model's 177 us
# decode step on an H100 (docs/perf/2026-12-06c-gdn-glue-chain-link-h100.md). Its table is 8 MB dense; the 27B's
# (2.5 GB) stays packed.
DENSE_EMBED_MAX = 64 << 20


# Dense projections of at most this many output rows may run through qmv's dense path on CUDA (when
# kernels/qmv_cuda.set_dense is on, EngineOptions.qmv_dense): the 27B GDN b+a projection (96 rows) took two cuBLAS
# kernels, 6.3 us a layer.
DENSE_QMV_MAX_ROWS = 1024


# On a CPU, a speculative engine's round multiplies its k + 1 rows a sequence (the verify pass, the drafters' passes
# over as many rows) by each projection of at least PACK_MIN_OUT rows through MKL's packed GEMM, the weight packed
# once for that row count (WeightStore.pack_rows): MKL's few-row product of the row-major weight ran 5-45% slower in
# the engine (22% for the MLP's 1024-row gate and up, 45% for the 8192-row head; docs/perf/2026-12-02e-cpu-dflash2-
# round.md); projections of fewer rows ran slower packed. The packed copies take about the weights' size again, made
# only while they fit in PACK_MEMORY_SHARE of the available memory.
PACK_MIN_OUT = 256
PACK_MEMORY_SHARE = 0.5


def mkl_packing() -> bool:
    """Whether torch has MKL's packed GEMM (``torch.ops.mkl._mkl_linear``: x86 builds with MKL)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


@dataclass(slots=True)
class RoundPacking:
    """A store's packed products (WeightStore.pack_rows): the row count they were packed for, and whether they are
    in use - only inside a speculative round (WeightStore.round_products), so a prompt chunk or a scoring pass that
    happens to have as many rows keeps ``F.linear``'s products, as the plain engine computes them."""

    rows: int = 0
    on: bool = False


class DenseLinear:
    """``y = x @ W^T`` with W held dense in the compute dtype."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self._qmv = None  # kernels.qmv_cuda.DenseWeight, made at the first CUDA call that can use it
        self._packed: tuple[RoundPacking, torch.Tensor] | None = None  # pack_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.out_features <= DENSE_QMV_MAX_ROWS:
            y = self._small_rows(x)
            if y is not None:
                return y
        packed = self._packed
        if packed is not None and packed[0].on and x.numel() == packed[0].rows * self.in_features \
                and not x.is_cuda and x.dtype == torch.float32:
            rows = packed[0].rows
            y = torch.ops.mkl._mkl_linear(x.reshape(rows, self.in_features).contiguous(), packed[1], self.weight,
                                          None, rows)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight)

    def pack_rows(self, packing: RoundPacking) -> bool:
        """Run products of exactly ``packing.rows`` input rows (fp32, on a CPU) through MKL's packed GEMM while
        ``packing.on``, the weight packed for that row count now (a copy of about its size); other products keep
        ``F.linear``. Another summation order than ``F.linear``'s: not its bits (as ``F.linear``'s few-row products
        are not its one-row bits either). Returns whether it packed (fp32 CPU weights, MKL there)."""
        if self.weight.is_cuda or self.weight.dtype != torch.float32 or not mkl_packing():
            return False
        self._packed = (packing, torch.ops.mkl._mkl_reorder_linear_weight(self.weight, packing.rows))
        return True

    def _small_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """Up to 64 rows of x through qmv's dense path (rows independent of the batch), when it is on."""
        from ...kernels import qmv_cuda
        from ...kernels.qlinear import MAX_KERNEL_ROWS

        rows = x.numel() // self.in_features
        if not qmv_cuda.dense_enabled() or rows > MAX_KERNEL_ROWS or x.dtype != self.weight.dtype \
                or x.dtype not in (torch.bfloat16, torch.float16) or self.in_features % 64 \
                or not qmv_cuda.available():
            return None
        if self._qmv is None:
            self._qmv = qmv_cuda.DenseWeight(self.weight.contiguous())
        x2 = x.reshape(rows, self.in_features).contiguous()
        if not qmv_cuda.supports(x2[:qmv_cuda.MAX_T], self._qmv):
            return None
        return qmv_cuda.qmv_rows(x2, self._qmv).reshape(*x.shape[:-1], self.out_features)


class Embedding:
    """Row lookup from a dense or packed table; quantized rows are dequantized on the fly."""

    def __init__(self, raw: RawWeight, dtype, device, dense: bool):
        self.dtype, self.fmt, self.shape = dtype, raw.fmt, raw.shape
        if dense or raw.fmt in quant.FLOAT_FORMATS:
            self.table = raw.dense(dtype, device)
            self.sec = None
        else:
            self.table = None
            self.buf = raw.buf.to(device)
            self.sec = quant.sections(self.buf, raw.fmt, raw.shape)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        flat = ids.reshape(-1)
        rows = {k: v[flat] for k, v in self.sec.items()}
        out = quant.dequantize_rows(rows, self.fmt, self.shape[-1], self.dtype)
        return out.reshape(*ids.shape, self.shape[-1])


# Prefill-width calls (T > the kernel's rows) multiply a dense copy of a packed weight. `auto` keeps the copies
# (2 bytes per weight more) up to this many packed bytes whatever the device, and beyond it while the packed
# weights and their copies take at most DENSE_AUTO_SHARE of the memory the device has free when the store is
# built (the rest is for the K/V cache, activations and CUDA graphs); otherwise each prefill call dequantizes on
# the fly, so quantization keeps saving memory. The 27B shape (15 GB packed, 54 GB dense) keeps them on a 141 GB
# H200 and dequantizes on an 80 GB card.
DENSE_CACHE_LIMIT = 4 << 30
DENSE_AUTO_SHARE = 0.6


def keep_dense_copies(packed_bytes: int, need: int, available: int | None) -> bool:
    """`--prefill-weights auto`: whether to keep a dense copy of each packed weight for prefill-width calls, when
    ``need`` bytes more must fit (``available``: free device bytes, None when unknown)."""
    if packed_bytes <= DENSE_CACHE_LIMIT:
        return True
    return available is not None and need <= DENSE_AUTO_SHARE * available


def _packed_linear(raw: RawWeight, device, cache_dense: bool, layout: str):
    from ...kernels.qlinear import PackedLinear  # needs triton only when it runs on CUDA

    return PackedLinear(raw.buf.to(device), raw.fmt, tuple(raw.shape), device, dense_fallback=cache_dense,
                        layout=layout)


GATE_UP_RUN = 8  # rows of gate, then of up, in an interleaved gate_up weight (half of qmv's 16-row tile)


def interleave_order(rows: int, device=None) -> torch.Tensor:
    """The stored row order of an interleaved gate_up weight of ``rows`` rows (gate rows, then as many up rows;
    ``rows`` a multiple of 2 * GATE_UP_RUN): GATE_UP_RUN gate rows, the same up rows, the next gate rows..."""
    runs = torch.arange(rows, device=device).view(2, rows // (2 * GATE_UP_RUN), GATE_UP_RUN)
    return runs.transpose(0, 1).reshape(-1)  # run j: gate rows, then up rows


class WeightStore:
    """All weights of one model on one device, by Hugging Face logical name."""

    def __init__(self, raws: dict[str, RawWeight], *, device="cpu", dtype=torch.float32, runtime="v3",
                 fuse: bool | None = None, apart: tuple[str, ...] = (), interleave: bool = False,
                 tied_embeddings: bool = False, qmv_layout: str = "lanes", prefill_weights: str = "auto",
                 tp=None):
        self.device, self.dtype, self.runtime = torch.device(device), dtype, runtime
        self.tp = tp  # tensor parallel (model/tensor_parallel.TPGroup): the embedding holds this rank's vocabulary rows
        # packed weights in a qmv layout only (no row-major copy): for 16-bit activations, which qmv takes; fp32
        # ones go through the Triton kernels, which read rows
        self.qmv_layout = qmv_layout if dtype in (torch.bfloat16, torch.float16) else "rows"
        self.packed = runtime == "v3" and self.device.type == "cuda"
        fuse = self.packed if fuse is None else fuse
        self.raws = raws
        self.linears: dict[str, object] = {}
        self.packing = RoundPacking()  # the packed products of a speculative round on a CPU (pack_rows)
        self.vectors: dict[str, torch.Tensor] = {}
        self.embeddings: dict[str, Embedding] = {}
        self.weight_bytes = sum(r.nbytes for r in raws.values())
        # prefill-width calls of packed weights: a dense copy of each kept, or dequantized on every call
        dense = sum(math.prod(r.shape) for r in raws.values()
                    if len(r.shape) == 2 and r.fmt in quant.QUANT_FORMATS) * dtype.itemsize
        if prefill_weights == "auto":
            from .memory import available_bytes

            free = available_bytes(self.device) if self.packed and self.weight_bytes > DENSE_CACHE_LIMIT else None
            self.cache_dense = keep_dense_copies(self.weight_bytes, self.weight_bytes + dense, free)
        else:
            self.cache_dense = prefill_weights == "dense"
        self.dense_bytes, self.auto_dense = dense, prefill_weights == "auto"
        if self.packed and prefill_weights == "dense":
            from .memory import check_fits_memory

            check_fits_memory(self.weight_bytes + dense, self.device,
                              "the packed weights and dense copies of them for prefill",
                              "use --prefill-weights packed (dequantized every prefill chunk) or auto")
        if not self.packed:  # each matrix becomes a dense copy in the compute dtype (v2, and every CPU run)
            from .memory import check_fits_memory

            dense = sum(math.prod(r.shape) for r in raws.values() if len(r.shape) == 2) * dtype.itemsize
            check_fits_memory(dense, self.device, f"dense {str(dtype).replace('torch.', '')} copies of the weights",
                              "on a GPU runtime v3 keeps them packed; or use a smaller model")
        if fuse:
            raws = self._fused(raws, apart)
        # fused gate_up weights whose gate and up rows alternate in runs of GATE_UP_RUN (see _interleaved)
        self.interleaved: set[str] = set()
        if fuse and interleave:
            raws, self.interleaved = self._interleaved(raws)
        for name, raw in raws.items():
            if name.endswith("embed_tokens.weight"):
                small = math.prod(raw.shape) * dtype.itemsize <= DENSE_EMBED_MAX
                self.embeddings[name] = Embedding(raw, dtype, self.device, dense=not self.packed or small)
            elif len(raw.shape) == 2 and not name.endswith("conv1d.weight"):
                self.linears[name] = self.linear_of(raw)
            else:  # norms, A_log, dt_bias, conv weights: fp32, small
                self.vectors[name] = raw.dense(torch.float32, self.device)
        if tied_embeddings and "lm_head.weight" not in self.linears:
            self.linears["lm_head.weight"] = self.linear_of(raws["model.embed_tokens.weight"])

    def settle_dense_copies(self) -> None:
        """`auto`, once the rest of the engine (its K/V cache) is allocated and before its first prefill: the dense
        copies (made at that prefill) are kept only if they still fit in DENSE_AUTO_SHARE of the free memory; else
        every prefill call dequantizes."""
        if not (self.auto_dense and self.cache_dense and self.packed and self.weight_bytes > DENSE_CACHE_LIMIT):
            return
        from .memory import available_bytes

        self.cache_dense = keep_dense_copies(self.weight_bytes, self.dense_bytes, available_bytes(self.device))
        for lin in self.linears.values():
            if hasattr(lin, "dense_fallback"):
                lin.dense_fallback = self.cache_dense

    @property
    def dequantizes_prefill(self) -> bool:
        """Whether some packed projection dequantizes on every prefill-width call (no dense copy kept)."""
        return any(getattr(lin, "dense_fallback", True) is False for lin in self.linears.values())

    @contextmanager
    def dense_scope(self, prefix: str):
        """Inside: the packed projections named under ``prefix`` (e.g. ``model.layers.3.``) that dequantize on every
        prefill-width call keep their dense copy, so that several prompt chunks through one layer (a layer-major
        prefill, HybridModel.prefill_layers) dequantize each weight once; the copies are dropped on exit."""
        held = [lin for name, lin in self.linears.items()
                if name.startswith(prefix) and getattr(lin, "dense_fallback", True) is False]
        for lin in held:
            lin.dense_fallback = True
        try:
            yield
        finally:
            for lin in held:
                lin.dense_fallback = False
                lin._dense.clear()

    def pack_rows(self, rows: int, prefixes: tuple[str, ...]) -> int:
        """Pack the dense projections named under ``prefixes`` with at least PACK_MIN_OUT rows for products of
        ``rows`` input rows, used inside :meth:`round_products` (DenseLinear.pack_rows: a CPU speculative engine's
        k + 1 rows a round), when MKL's packed GEMM is there and the copies fit in PACK_MEMORY_SHARE of the memory
        available. Returns how many were packed."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not mkl_packing():
            return 0
        todo = [lin for name, lin in self.linears.items() if name.startswith(prefixes)
                and isinstance(lin, DenseLinear) and lin.out_features >= PACK_MIN_OUT]
        from .memory import available_bytes

        have = available_bytes(self.device)
        if have is not None and sum(lin.weight.nbytes for lin in todo) > PACK_MEMORY_SHARE * have:
            return 0
        self.packing.rows = rows
        return sum(lin.pack_rows(self.packing) for lin in todo)

    @contextmanager
    def round_products(self):
        """Inside: products of the packed row count through the packed weights (:meth:`pack_rows`; a speculative
        round, engine/spec/loop.py); outside, every product is ``F.linear``'s."""
        was, self.packing.on = self.packing.on, True
        try:
            yield
        finally:
            self.packing.on = was

    def linear_of(self, raw: RawWeight):
        """A projection of ``raw`` held as this store holds its own: packed where the store keeps weights packed
        (v3 on CUDA) and ``raw`` is in a quantized format, else a dense copy in the compute dtype."""
        if self.packed and raw.fmt in quant.QUANT_FORMATS:
            return _packed_linear(raw, self.device, self.cache_dense, self.qmv_layout)
        return DenseLinear(raw.dense(self.dtype, self.device))

    @staticmethod
    def _interleaved(raws: dict[str, RawWeight]) -> tuple[dict[str, RawWeight], set[str]]:
        """Each fused ``mlp.gate_up_proj`` with its rows reordered: GATE_UP_RUN gate rows, the same up rows, the
        next gate rows... - so a 16-row tile of qmv holds matching gate and up rows and can store ``silu(g) * u``
        (``PackedLinear.silu_mul``). Only where the intermediate size is a multiple of the run."""
        out, names = dict(raws), set()
        for name, raw in raws.items():
            if not name.endswith("mlp.gate_up_proj.weight") or raw.shape[0] % (2 * GATE_UP_RUN):
                continue
            order = interleave_order(raw.shape[0], raw.buf.device)
            out[name] = RawWeight(raw.fmt, raw.shape, quant.take_rows(raw.buf, raw.fmt, tuple(raw.shape), order))
            names.add(name)
        return out, names

    @staticmethod
    def _fused(raws: dict[str, RawWeight], apart: tuple[str, ...] = ()) -> dict[str, RawWeight]:
        """Sibling projections concatenated (FUSIONS), except the fusions named in ``apart``."""
        out = dict(raws)
        prefixes = {n.rsplit(".", 3)[0] for n in raws if ".layers." in n}
        for prefix in sorted(prefixes):
            for fused, members in FUSIONS.items():
                if fused in apart:
                    continue
                names = [f"{prefix}.{m}.weight" for m in members]
                parts = [out.get(n) for n in names]
                if any(p is None for p in parts) or len({p.fmt for p in parts}) != 1 \
                        or len({p.shape[-1] for p in parts}) != 1:
                    continue
                biases = [out.get(f"{prefix}.{m}.bias") for m in members]
                if any(b is not None for b in biases) and any(b is None for b in biases):
                    continue  # (a bias on some members only: kept apart)
                shapes = [tuple(p.shape) for p in parts]
                buf = quant.concat_rows([p.buf.reshape(-1) for p in parts], parts[0].fmt, shapes)
                out[f"{prefix}.{fused}.weight"] = RawWeight(parts[0].fmt, (sum(s[0] for s in shapes),
                                                                          shapes[0][1]), buf)
                if biases[0] is not None:  # the members' biases, concatenated as their rows are
                    dense = torch.cat([b.dense(torch.float32) for b in biases])
                    out[f"{prefix}.{fused}.bias"] = RawWeight("fp32", (dense.numel(),), dense.view(torch.uint8))
                for n in names + [f"{prefix}.{m}.bias" for m in members]:
                    out.pop(n, None)
        return out

    def linear(self, name: str):
        return self.linears[name]

    def has(self, name: str) -> bool:
        return name in self.linears or name in self.vectors or name in self.embeddings

    def vector(self, name: str) -> torch.Tensor:
        return self.vectors[name]

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The projection ``{name}.weight`` of x, plus ``{name}.bias`` where the model has one."""
        y = self.linears[f"{name}.weight"](x)
        bias = self.vectors.get(f"{name}.bias")
        return y if bias is None else y + bias.to(y.dtype)

    def dense_table(self, name: str = "model.embed_tokens.weight") -> torch.Tensor | None:
        """The embedding table ``[V, H]`` in the compute dtype when it is held dense and whole (no tensor
        parallelism): :meth:`embed` is then a row lookup in it; else None."""
        return self.embeddings[name].table if self.tp is None else None

    def embed(self, ids: torch.Tensor, name: str = "model.embed_tokens.weight") -> torch.Tensor:
        emb = self.embeddings[name]
        if self.tp is None:
            return emb(ids)
        rows = emb.shape[0]  # tensor parallel: this rank's vocabulary rows; a token held elsewhere adds zeros here
        local = ids - self.tp.rank * rows
        inside = (local >= 0) & (local < rows)
        return self.tp.reduce(emb(local.clamp(0, rows - 1)) * inside[..., None].to(self.dtype))


def product_fp32(lin, x: torch.Tensor) -> torch.Tensor:
    """``lin(x).float()``, through the projection's own fp32 store where it has one (PackedLinear.fp32: qmv writes the
    rounded values widened, with no copy kernel after it); the same values either way."""
    wide = getattr(lin, "fp32", None)
    return wide(x) if wide is not None else lin(x).float()


def split_fused(y: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Split the output of a fused linear back into its members."""
    return list(torch.split(y, sizes, dim=-1))


def text_weight_names(cfg: ModelConfig, *, mtp: bool = True) -> list[str]:
    """Every weight name a text model of ``cfg`` needs (Hugging Face Qwen3_5ForCausalLM naming)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i, kind in enumerate(cfg.layer_types):
        names += _layer_names(f"model.layers.{i}", kind, cfg.attention_bias)
    if mtp and cfg.mtp_num_hidden_layers:
        names += ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                  "mtp.norm.weight"]
        for i in range(cfg.mtp_num_hidden_layers):
            names += _layer_names(f"mtp.layers.{i}", "full_attention", cfg.attention_bias)
    return names


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # with biases when the config's attention_bias


def _layer_names(p: str, kind: str, attention_bias: bool = False) -> list[str]:
    names = [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight",
             f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight", f"{p}.mlp.down_proj.weight"]
    if kind == "linear_attention":
        a = f"{p}.linear_attn"
        names += [f"{a}.in_proj_qkv.weight", f"{a}.in_proj_z.weight", f"{a}.in_proj_b.weight",
                  f"{a}.in_proj_a.weight", f"{a}.conv1d.weight", f"{a}.A_log", f"{a}.dt_bias",
                  f"{a}.norm.weight", f"{a}.out_proj.weight"]
    else:
        a = f"{p}.self_attn"
        names += [f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight", f"{a}.o_proj.weight",
                  f"{a}.q_norm.weight", f"{a}.k_norm.weight"]
        if attention_bias:
            names += [f"{a}.{m}.bias" for m in ATTENTION_PROJECTIONS]
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every text/MTP weight of ``cfg``."""
    h, hd = cfg.hidden_size, cfg.head_dim
    full = {
        "self_attn.q_proj.weight": (cfg.num_attention_heads * hd * 2, h),
        "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, h),
        "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, h),
        "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
    }
    if cfg.attention_bias:
        full.update({f"self_attn.{m}.bias": full[f"self_attn.{m}.weight"][:1] for m in ATTENTION_PROJECTIONS})
    lin = {
        "linear_attn.in_proj_qkv.weight": (cfg.conv_dim, h),
        "linear_attn.in_proj_z.weight": (cfg.value_dim, h),
        "linear_attn.in_proj_b.weight": (cfg.linear_num_value_heads, h),
        "linear_attn.in_proj_a.weight": (cfg.linear_num_value_heads, h),
        "linear_attn.conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        "linear_attn.A_log": (cfg.linear_num_value_heads,),
        "linear_attn.dt_bias": (cfg.linear_num_value_heads,),
        "linear_attn.norm.weight": (cfg.linear_value_head_dim,),
        "linear_attn.out_proj.weight": (h, cfg.value_dim),
    }
    common = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (cfg.intermediate_size, h), "mlp.up_proj.weight": (cfg.intermediate_size, h),
        "mlp.down_proj.weight": (h, cfg.intermediate_size),
    }
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h), "mtp.fc.weight": (h, 2 * h),
              "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
              "mtp.norm.weight": (h,)}
    layers = [(f"model.layers.{i}", k) for i, k in enumerate(cfg.layer_types)]
    layers += [(f"mtp.layers.{i}", "full_attention") for i in range(cfg.mtp_num_hidden_layers)]
    for p, kind in layers:
        for suffix, shape in {**common, **(lin if kind == "linear_attention" else full)}.items():
            shapes[f"{p}.{suffix}"] = shape
    return shapes


def check_text_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Raise ValueError naming the first text / MTP tensor that ``cfg`` needs and is missing, that it does not
    describe, or whose shape differs from the one it implies (a header config edited apart from the weights)."""
    want = expected_shapes(cfg)
    missing = [n for n in text_weight_names(cfg) if n not in shapes]
    if missing:
        raise ValueError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    for name, shape in shapes.items():
        if name not in want:
            raise ValueError(f"{where}: tensor {name} is not part of the model the text config describes")
        if tuple(shape) != want[name]:
            raise ValueError(f"{where}: tensor {name} has shape {list(shape)}, the config implies "
                             f"{list(want[name])}")
