"""Tensor parallelism (Megatron-style) of the hybrid decoder: which slice of each weight a rank holds, the rank's own
config, and the collectives between them.

Each of ``size`` ranks (one process each, ``torch.distributed`` initialised: gloo on CPUs, NCCL on GPUs) holds:

- column-parallel (rows of the weight, by head): attention q (query | gate per head), k, v and their norms' heads
  whole; GDN q / k / v sections of ``in_proj_qkv`` and the conv channels with them, ``in_proj_z``, ``in_proj_b`` /
  ``in_proj_a``, ``A_log`` and ``dt_bias`` by value head (and key head); the MLP's gate and up by intermediate rows;
  ``lm_head`` and the token embedding by vocabulary rows (the logits are gathered whole on every rank; a token's
  embedding comes from the rank that holds its row, the others adding zeros: ``WeightStore.embed``);
- row-parallel (columns of the weight: its share of the input): attention ``o_proj``, GDN ``out_proj``, the MLP's
  ``down_proj`` - each rank's product is a partial sum, all-reduced once per block half (:meth:`TPGroup.reduce`);
- everything else whole: norms, the GDN gated norm's weight (per head, shared).

On GPUs the collectives go through :mod:`kernels.ipc_collectives` where every rank can map the others' memory
(:meth:`TPGroup.use_ipc`): one kernel a call that a CUDA graph can capture, the sum in rank order; elsewhere (CPUs,
NINFER_BENCH_TP_IPC=0, or GPUs that cannot map each other) through torch.distributed, and an engine then runs its
kernels eagerly.

Heads are split in contiguous blocks, which keeps the grouped heads together (attention query head i reads key head
``i // (H / Hkv)``, GDN value head i key head ``i // (Hv / Hk)``). :func:`check_divisible` refuses a model whose head
counts (or intermediate size, or vocabulary) a size does not divide, naming each. Packed (quantized) weights are
sliced without re-quantizing: rows as they are, columns by whole quantization groups; a column slice that does not
fall on group boundaries is stored dequantized (fp32) instead. Greedy tokens equal one rank's; logits equal to fp32
rounding (the partial sums are added in another order).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from ...kernels import quant
from .config import ModelConfig

__all__ = ["TPGroup", "check_divisible", "local_config", "shard_raws", "take_cols"]


@dataclass(slots=True)
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, over ``group`` (a torch.distributed
    process group; None: the default group)."""

    rank: int
    size: int
    group: object = None
    ipc: object = None  # kernels.ipc_collectives.IpcCollectives, once use_ipc set it up

    @classmethod
    def current(cls, size: int) -> TPGroup:
        """The default process group as a tensor-parallel group of ``size`` ranks (it must be initialised, with
        exactly that many ranks)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"--tensor-parallel {size}: torch.distributed is not initialised (start the ranks with "
                             f"engine.runtime.parallel.launch, or torchrun)")
        if dist.get_world_size() != size:
            raise ValueError(f"--tensor-parallel {size}: the process group has {dist.get_world_size()} ranks")
        return cls(dist.get_rank(), size)

    def use_ipc(self, device: torch.device) -> str | None:
        """Route this group's GPU collectives through CUDA IPC (kernels/ipc_collectives.py); None when they now do,
        else why not (they stay torch.distributed's). NINFER_BENCH_TP_IPC=0 keeps torch.distributed's without
        trying. Collective: every rank calls it."""
        import os

        switch = os.environ.get("NINFER_BENCH_TP_IPC", "1").strip()
        if switch not in ("0", "1"):
            raise ValueError(f"NINFER_BENCH_TP_IPC: {switch!r}: expected 1 (the default) or 0")
        if switch == "0":
            return "NINFER_BENCH_TP_IPC=0"
        from ...kernels import ipc_collectives

        self.ipc, why = ipc_collectives.create(self.rank, self.size, device, self.group)
        return why

    def _staged(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through host memory: a CUDA tensor over gloo (ranks sharing fewer GPUs than there are
        ranks, engine/runtime/parallel.default_backend: a check of the split on one GPU, not a speed), since gloo's
        collectives are CPU ones."""
        import torch.distributed as dist

        return x.is_cuda and dist.get_backend(self.group) == "gloo"

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a row-parallel projection's partial products), in place."""
        import torch.distributed as dist

        if self.ipc is not None and self.ipc.supports(xc := x.contiguous()):
            return self.ipc.reduce_(xc) if xc is x else x.copy_(self.ipc.reduce_(xc))
        if self._staged(x):
            host = x.cpu()
            dist.all_reduce(host, group=self.group)
            return x.copy_(host)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension (vocabulary-parallel logits), rank order."""
        import torch.distributed as dist

        if self.ipc is not None and self.ipc.supports(xc := x.contiguous()):
            return self.ipc.gather_last(xc)
        staged = self._staged(x)
        mine = x.cpu() if staged else x.contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        out = torch.cat(parts, dim=-1)
        return out.to(x.device) if staged else out


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse (ValueError naming each) a model whose heads, intermediate size or vocabulary ``size`` does not
    divide."""
    if size < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {size}")
    counts = {"attention heads (num_attention_heads)": cfg.num_attention_heads,
              "key / value heads (num_key_value_heads)": cfg.num_key_value_heads,
              "GDN key heads (linear_num_key_heads)": cfg.linear_num_key_heads,
              "GDN value heads (linear_num_value_heads)": cfg.linear_num_value_heads,
              "MLP intermediate size": cfg.intermediate_size,
              "vocabulary": cfg.vocab_size}
    bad = [f"{name} {n}" for name, n in counts.items() if n % size]
    if bad:
        raise ValueError(f"--tensor-parallel {size}: this model cannot be split {size} ways - not a multiple of "
                         f"{size}: {', '.join(bad)}")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's share: heads and intermediate size divided (the vocabulary stays whole: the logits
    are gathered)."""
    check_divisible(cfg, size)
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // size, num_key_value_heads=cfg.num_key_value_heads // size,
        linear_num_key_heads=cfg.linear_num_key_heads // size,
        linear_num_value_heads=cfg.linear_num_value_heads // size, intermediate_size=cfg.intermediate_size // size)


def take_cols(raw, k0: int, k1: int):
    """``W[:, k0:k1]`` of a :class:`~engine.model.weights.RawWeight`: packed bytes unchanged when the slice falls on
    the format's groups (``k0`` a multiple of the group, ``k1`` too or the end), else dequantized to fp32."""
    from .weights import RawWeight

    n, k = raw.shape
    if raw.fmt in quant.QUANT_FORMATS:
        group = quant.QSPEC[raw.fmt][0]
        if k0 % group == 0 and (k1 % group == 0 or k1 == k):
            end = -(-k1 // group) * group
            per = {"codes": 1 if raw.fmt == "q8_g32_fp16" else 2, "high": 8, "scales": group}
            sec = quant.sections(raw.buf, raw.fmt, (n, k))
            part = {name: view[:, k0 // per[name]:end // per[name]] for name, view in sec.items()}
            return RawWeight(raw.fmt, (n, k1 - k0), quant.pack_sections(part, raw.fmt, k1 - k0))
    elif raw.fmt in quant.FLOAT_FORMATS:
        elt = 4 if raw.fmt == "fp32" else 2
        rows = raw.buf.reshape(n, k * elt)[:, k0 * elt:k1 * elt]
        return RawWeight(raw.fmt, (n, k1 - k0), rows.contiguous().reshape(-1))
    w = raw.dense(torch.float32)[:, k0:k1].contiguous()
    return RawWeight("fp32", (n, k1 - k0), w.view(torch.uint8).reshape(-1))


def _blocks(starts_sizes: list[tuple[int, int]], rank: int, size: int) -> torch.Tensor:
    """Row indices of rank ``rank``'s share of each (start, rows) section, the sections in order."""
    idx = []
    for start, rows in starts_sizes:
        share = rows // size
        idx.append(torch.arange(start + rank * share, start + (rank + 1) * share))
    return torch.cat(idx)


# layer-relative weight names (after ``...layers.N.``) -> how they are split
_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "linear_attn.in_proj_qkv",
           "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "linear_attn.out_proj", "mlp.down_proj")
_LAYER = re.compile(r"^((?:model|mtp)\.layers\.\d+)\.(.+)\.(weight|bias)$"
                    r"|^(model\.layers\.\d+)\.(linear_attn\.(A_log|dt_bias))$")


def _row_sections(name: str, cfg: ModelConfig) -> list[tuple[int, int]]:
    """(start, rows) sections of a column-parallel weight whose rows split by head, each section split alike."""
    if name == "linear_attn.in_proj_qkv":  # q | k | v, each by its heads
        return [(0, cfg.key_dim), (cfg.key_dim, cfg.key_dim), (2 * cfg.key_dim, cfg.value_dim)]
    rows = {"self_attn.q_proj": 2 * cfg.num_attention_heads * cfg.head_dim,
            "self_attn.k_proj": cfg.num_key_value_heads * cfg.head_dim,
            "self_attn.v_proj": cfg.num_key_value_heads * cfg.head_dim,
            "linear_attn.in_proj_z": cfg.value_dim, "linear_attn.in_proj_b": cfg.linear_num_value_heads,
            "linear_attn.in_proj_a": cfg.linear_num_value_heads, "mlp.gate_proj": cfg.intermediate_size,
            "mlp.up_proj": cfg.intermediate_size}[name]
    return [(0, rows)]


def shard_raws(raws: dict, cfg: ModelConfig, rank: int, size: int) -> dict:
    """Rank ``rank``'s share of the text model's stored weights (``{name: RawWeight}``), as the module docstring
    lays out; the MTP head's layers (``mtp.layers.*``) split as the model's, its ``fc`` and norms whole (a DFlash
    drafter's weights are held apart, whole on every rank)."""
    from .weights import RawWeight

    check_divisible(cfg, size)
    if size == 1:
        return dict(raws)
    raws = dict(raws)
    if "lm_head.weight" not in raws and cfg.tie_word_embeddings:  # the head's vocabulary rows from the embedding
        raws["lm_head.weight"] = raws["model.embed_tokens.weight"]
    out = {}
    for name, raw in raws.items():
        m = _LAYER.match(name)
        if name in ("lm_head.weight", "model.embed_tokens.weight"):  # vocabulary rows (WeightStore.embed looks up
            rows = _blocks([(0, cfg.vocab_size)], rank, size)  # its share and sums the ranks' rows)
            out[name] = RawWeight(raw.fmt, (len(rows), raw.shape[1]), quant.take_rows(raw.buf, raw.fmt,
                                                                                        tuple(raw.shape), rows))
        elif m and m.group(5):  # A_log, dt_bias [Hv]
            vec = raw.dense(torch.float32)
            share = vec.shape[0] // size
            out[name] = RawWeight("fp32", (share,), vec[rank * share:(rank + 1) * share].contiguous().view(
                torch.uint8).reshape(-1))
        elif m and m.group(2) in _COLUMN:
            rows = _blocks(_row_sections(m.group(2), cfg), rank, size)
            if m.group(3) == "bias":
                vec = raw.dense(torch.float32)
                out[name] = RawWeight("fp32", (len(rows),), vec[rows].contiguous().view(torch.uint8).reshape(-1))
            else:
                out[name] = RawWeight(raw.fmt, (len(rows), raw.shape[1]),
                                      quant.take_rows(raw.buf, raw.fmt, tuple(raw.shape), rows))
        elif m and m.group(2) == "linear_attn.conv1d":  # [conv_dim, 1, W]: channels as in_proj_qkv's rows
            rows = _blocks(_row_sections("linear_attn.in_proj_qkv", cfg), rank, size)
            w = raw.dense(torch.float32)[rows].contiguous()
            out[name] = RawWeight("fp32", tuple(w.shape), w.view(torch.uint8).reshape(-1))
        elif m and m.group(2) in _ROW:
            if m.group(3) == "bias":  # added once: on rank 0
                vec = raw.dense(torch.float32) * (rank == 0)
                out[name] = RawWeight("fp32", tuple(vec.shape), vec.contiguous().view(torch.uint8).reshape(-1))
            else:
                share = raw.shape[1] // size
                out[name] = take_cols(raw, rank * share, (rank + 1) * share)
        else:
            out[name] = raw
    return out
