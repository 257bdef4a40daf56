"""Engine options: the capacities and choices an Engine is bound to, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPECS = ("none", "mtp", "dflash", "dflash2")
DEFAULT_DRAFT = {"none": 0, "mtp": 3, "dflash": 7, "dflash2": 7}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_cpu_threads(hidden_size: int, requested: int | None = None) -> None:
    """Set torch's intra-op threads for CPU work on a model of ``hidden_size``: ``requested``, or 1 for small
    models, whose matmuls are too small to split (extra OpenMP threads only wait on each other, and stall badly
    when another process shares the cores). Both engines of a comparison use this rule."""
    threads = requested or (1 if hidden_size <= 1024 else None)
    if threads:
        torch.set_num_threads(threads)


@dataclass(slots=True)
class EngineOptions:
    """What an Engine is bound to. ``kv_capacity`` is the total number of K/V tokens, split evenly over
    ``max_concurrency`` slots (as llama.cpp splits ``-c`` over ``-np``); it defaults to
    ``max_context * max_concurrency``."""

    device: str = "auto"
    dtype: str = "auto"
    kv_dtype: str = "int8"
    max_context: int | None = None  # None: 8192, or the model's limit when smaller
    kv_capacity: int | None = None
    max_concurrency: int = 1
    prefill_chunk: int = 2048  # prompt tokens a forward (each chunk dequantizes every packed weight once on CUDA:
    #                            H200 27B 818-token prefill 275 ms in two chunks of 512, 148 ms in one)
    interleave_chunk: int | None = 512  # prompt tokens a scheduler iteration prefills while others decode (None:
    #                                     prefill_chunk): smaller trades a newcomer's TTFT for the others' ITL
    runtime: str = "v3"
    spec: str = "none"
    draft_tokens: int | None = None
    rollback: str = "recompute"
    lm_head_draft: int = 0
    cuda_graphs: bool = True
    draft_graphs: bool = True  # greedy drafting replayed from CUDA graphs (v3 on CUDA): MTP's draft steps and its
    #                            pass over each verified block, DFlash / DFlash2 block drafting and their context K/V
    #                            of each verified block; the eager drafts' tokens. H200 27B a round: MTP3 14.0 ->
    #                            11.5 ms (commit captured too), DFlash2 K=7 22.9 -> 13.6 ms; bundled DFlash2 K=7
    #                            2.22 -> 1.34 ms with its context commit captured
    lookahead: bool = True  # greedy single-sequence decode on CUDA graphs: launch step n + 1 before reading
    #                         token n (a finished sequence's extra step writes the scratch slot)
    pdl: bool = True  # the decode step's kernels (qmv and the fused Triton glue) launch with programmatic dependent
    #                   launch in CUDA graphs (sm_90+, ignored elsewhere; process-wide: kernels/_triton.set_pdl): each
    #                   may launch while the one before finishes. H200 27B step 6.08 -> 5.82 ms. (The MTP runs that
    #                   once made it an opt-in differed with it off too: verify passes were not token-invariant,
    #                   docs/perf/2026-11-30-token-invariance-h200.md)
    side_stream: bool = True  # captured decode steps run each GDN layer's b / a and z projections on side streams,
    #                           graph branches beside the main chain (engine/model/fused_forward.py; z then keeps a weight of its
    #                           own, apart from qkv's). H200 27B step 5.62 -> 5.35 ms; branch launches take K in one
    #                           pass (kernels/_triton.single_pass): split-K launches there once shared the device's
    #                           split-K scratch with the main chain's and the bundled model's tokens changed from run
    #                           to run (docs/perf/2026-11-30-side-streams-fixed-h200.md)
    silu_epilogue: bool = True  # fused kernels: the MLP gate / up weight interleaved in runs of 8 rows so that qmv
    #                             stores silu(gate) * up itself (one launch less a layer; H200 27B step 5.41 -> 5.36 ms,
    #                             the same tokens: docs/perf/2026-11-30-silu-epilogue-h200.md)
    qmv_dense: bool = True  # small dense bf16/fp16 projections (<= 1024 rows, <= 64 x rows) through qmv's dense
    #                         path instead of cuBLAS (process-wide: kernels/qmv_cuda.set_dense; H200 27B step 8.01 ->
    #                         7.90 ms)
    qmv_layout: str = "lanes"  # packed weights of bf16/fp16 models on CUDA: "lanes" (qmv's tile-contiguous layout
    #                            with one load a lane and no x shuffles; H200 27B step 6.43 -> 6.08 ms GPU busy),
    #                            "tiled" (tile-contiguous; 1.1-1.3x faster projections than rows) or "rows" (the
    #                            row-major buffers)
    gdn_impl: str = "auto"
    kernels: str = "auto"  # decode/verify kernels: auto (fused Triton for v3 on CUDA), torch, or triton
    cpu_threads: int | None = None  # torch intra-op threads on a CPU; None: 1 for small models, else torch's

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available on this machine")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto, fp32, bf16 or fp16, got {self.dtype!r}")
        if self.kv_dtype not in ("fp32", "bf16", "fp16", "int8"):
            raise ValueError(f"kv dtype must be fp32, bf16, fp16 or int8, got {self.kv_dtype!r}")
        for name in ("max_context", "max_concurrency", "prefill_chunk"):
            value = getattr(self, name)
            if value is None and name == "max_context":
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.kv_capacity is not None and (not isinstance(self.kv_capacity, int)
                                             or self.kv_capacity < self.max_concurrency):
            raise ValueError(f"kv-capacity must be an integer >= max-concurrency ({self.max_concurrency}), "
                             f"got {self.kv_capacity!r}")
        if self.runtime not in ("v2", "v3"):
            raise ValueError(f"runtime must be v2 or v3, got {self.runtime!r}")
        if self.spec not in SPECS:
            raise ValueError(f"spec must be one of {', '.join(SPECS)}, got {self.spec!r}")
        if self.spec == "none":
            if self.draft_tokens not in (None, 0):
                raise ValueError(f"draft-tokens (-k {self.draft_tokens}) is speculative decoding's drafts per round: "
                                 f"give it with --spec mtp, dflash or dflash2, not --spec none")
            self.draft_tokens = 0
        elif self.draft_tokens is None:
            self.draft_tokens = DEFAULT_DRAFT[self.spec]
        elif not isinstance(self.draft_tokens, int) or not 1 <= self.draft_tokens <= 32:
            raise ValueError(f"draft-tokens must be an integer in 1..32 with --spec {self.spec}, "
                             f"got {self.draft_tokens!r}")
        if self.rollback not in ("recompute", "snapshot"):
            raise ValueError(f"rollback must be recompute or snapshot, got {self.rollback!r}")
        if not isinstance(self.lm_head_draft, int) or self.lm_head_draft < 0:
            raise ValueError(f"lm-head-draft must be a non-negative integer, got {self.lm_head_draft!r}")
        if self.interleave_chunk is not None and (not isinstance(self.interleave_chunk, int)
                                                  or self.interleave_chunk < 1):
            raise ValueError(f"interleave-chunk must be a positive integer, got {self.interleave_chunk!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"cpu-threads must be a positive integer, got {self.cpu_threads!r}")
        if self.qmv_layout not in ("tiled", "lanes", "rows"):
            raise ValueError(f"qmv layout must be tiled, lanes or rows, got {self.qmv_layout!r}")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be auto, torch or triton, got {self.kernels!r}")
        if self.kernels == "triton" and self.runtime == "v2":
            raise ValueError("runtime v2 runs the plain torch kernels: --kernels triton needs runtime v3")
        if self.gdn_impl not in ("auto", "ref", "chunked", "fla", "step"):
            raise ValueError(f"gdn impl must be auto, ref, chunked, fla or step, got {self.gdn_impl!r}")

    def bind(self, model_max_positions: int) -> None:
        """Resolve the defaults that depend on the model, and check max-context against it."""
        if self.max_context is None:
            self.max_context = min(8192, model_max_positions)
        if self.max_context > model_max_positions:
            raise ValueError(f"max-context {self.max_context} exceeds the model's max_position_embeddings "
                             f"{model_max_positions}")
        if self.kv_capacity is None:
            self.kv_capacity = self.max_context * self.max_concurrency

    def fused_kernels(self) -> bool:
        """Whether decode/verify run through the fused Triton kernels."""
        if self.runtime == "v2" or self.kernels == "torch":
            return False
        from ..model.fused_forward import available

        if self.kv_dtype == "fp32":  # the fused attention reads bf16 / fp16 / int8 K/V
            if self.kernels == "triton":
                raise ValueError("--kernels triton needs --kv-dtype bf16, fp16 or int8 (the fused attention does not "
                                 "read fp32 K/V)")
            return False
        if self.kernels == "triton":
            if not available():
                raise ValueError("--kernels triton: triton does not import here")
            return True
        return self.torch_device.type == "cuda" and available()

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    @property
    def slot_capacity(self) -> int:
        """K/V tokens one sequence may hold."""
        return self.kv_capacity // self.max_concurrency
