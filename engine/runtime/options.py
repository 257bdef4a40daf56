"""Engine options: the capacities and choices an Engine is bound to, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

SPECS = ("none", "mtp", "dflash", "dflash2")
DEFAULT_DRAFT = {"none": 0, "mtp": 3, "dflash": 7, "dflash2": 7}
MAX_DRAFT_TOKENS = 32  # -k at most (a round verifies K + 1 positions past a sequence's length)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_cpu_threads(hidden_size: int, requested: int | None = None) -> None:
    """Set torch's intra-op threads for CPU work on a model of ``hidden_size``: ``requested``, or 1 for small
    models, whose matmuls are too small to split (extra OpenMP threads only wait on each other, and stall badly
    when another process shares the cores). Both engines of a comparison use this rule."""
    threads = requested or (1 if hidden_size <= 1024 else None)
    if threads:
        torch.set_num_threads(threads)


@dataclass(frozen=True, slots=True)
class Switch:
    """An on / off engine switch that changes only runs on CUDA (graphs, fused kernels; ``cpu``: on a CPU too) and that
    a decode grid can compare: its flag, the label suffix of a run with it off (``on_label``: with it on, for a switch
    off by default), the runs it applies to (``spec``: a drafter; ``block``: a DFlash / DFlash2 drafter; ``v3``: the v3
    runtime) and its default."""

    flag: str
    off_label: str
    applies: str
    help: str
    default: bool = True
    on_label: str = ""
    cpu: bool = False

    def applies_to(self, runtime: str, spec: str) -> bool:
        return {"spec": spec != "none", "block": spec in ("dflash", "dflash2"), "v3": runtime == "v3"}[self.applies]

    def label(self, on: bool) -> str:
        """The label suffix of a run with the switch ``on`` or off: empty at its default."""
        return "" if on == self.default else (self.on_label if on else self.off_label)


def _switch(flag: str, off_label: str, applies: str, help: str, *, default: bool = True, on_label: str = "",
            cpu: bool = False):
    if not default and not on_label:
        raise ValueError(f"{flag}: a switch off by default needs the label of a run with it on")
    return field(default=default, metadata={"switch": Switch(flag, off_label, applies, help, default, on_label, cpu)})


DEFAULT_CONTEXT = 8192  # --max-context when none is given (or the model's limit when smaller)
PREFILL_CHUNK = {"cuda": 8192, "cpu": 2048}  # --prefill-chunk when none is given, by device type: measured fastest
#   (27B on an H100, two calls: 8,192-token chunks prefilled 2,991 tokens in 0.90x / 0.98x and 65,000 in 0.97x the
#   time of 2,048-token ones; the bundled model on a 2-core CPU: 8,192 tokens in 1.10x;
#   docs/perf/2026-12-07c-prefill-chunk-default.md)


@dataclass(slots=True)
class EngineOptions:
    """What an Engine is bound to. ``kv_capacity`` is the total number of K/V tokens, split evenly over
    ``max_concurrency`` slots (as llama.cpp splits ``-c`` over ``-np``); it defaults to
    ``max_context * max_concurrency``. Measured effects of the switches: ``docs/perf/README.md``."""

    device: str = "auto"
    dtype: str = "auto"
    kv_dtype: str = "int8"
    max_context: int | None = None  # None: DEFAULT_CONTEXT, or the model's limit when smaller
    kv_capacity: int | None = None
    max_concurrency: int = 1
    prefill_chunk: int | None = None  # prompt tokens a forward, and a scheduler iteration's prefill budget across
    #                                   requests (None: PREFILL_CHUNK for the device)
    interleave_chunk: int | None = 512  # the budget (prompt tokens of all admitting requests) of an iteration while
    #                                     others decode (None: prefill_chunk): smaller trades newcomers' TTFT for the
    #                                     others' ITL
    pack_prefill: bool = False  # the prompt chunks a scheduler iteration prefills (several admitting requests') in
    #                             one eager forward, padded to the longest (Engine.prefill_steps); off: one forward
    #                             each, a lone first chunk from its captured graph. Off by default: on the H200 the
    #                             27B's packed rows decoded other tokens than each request alone from 4 rows up, and an
    #                             eager 27B prefill costs more than two captured ones (docs/perf/README.md)
    runtime: str = "v3"
    spec: str = "none"
    draft_tokens: int | None = None
    rollback: str = "recompute"
    lm_head_draft: int = 0
    replay_acceptance: str | None = None  # seed, a probability or a .json file: drafts replaced by the plain
    #                                       continuation at that acceptance (engine/spec/replay.py; greedy only)
    cuda_graphs: bool = True
    draft_graphs: bool = _switch(
        "--draft-graphs", "-eagerdraft", "spec",
        "Greedy drafting (MTP, DFlash, DFlash2) and each drafter's pass over the verified block replayed from CUDA "
        "graphs (v3 on CUDA; off: eager drafting).")
    draft_attention: bool = _switch(
        "--draft-attention", "-sdpadraft", "block",
        "A DFlash / DFlash2 block's attention through kernels/draft_attention.py (CUDA, Triton): the drafter's cached "
        "context read in place, the mask from the rows' positions in registers, two launches a layer (off: the rows "
        "gathered into a copy, a mask tensor, matmuls and a softmax).")
    lookahead: bool = _switch(
        "--lookahead", "-sync", "v3",
        "Greedy decode of one sequence on CUDA graphs, plain or speculative: queue step (round) n + 1 before reading "
        "token(s) n; a speculative round is then three captured graphs with acceptance and rollback on the device "
        "(a finished sequence's extra step or round writes the scratch slot; off: read each token or round first).")
    pdl: bool = _switch(
        "--pdl", "-nopdl", "v3",
        "Decoding's kernels (qmv and the fused Triton glue) launch with programmatic dependent launch in the CUDA "
        "graphs of one sequence: its decode step, and its speculative drafting and verify (sm_90+, ignored on older "
        "GPUs; process-wide: kernels/_triton.set_pdl; batched steps measured faster without it).")
    side_stream: bool = _switch(
        "--side-stream", "-noside", "v3",
        "Captured decode steps run a GDN layer's b / a and z projections on CUDA-graph branches beside the main "
        "chain (z then keeps a weight of its own, apart from qkv's).")
    prefill_graphs: bool = _switch(
        "--prefill-graphs", "-eagerprefill", "v3",
        "A prompt's first chunk (from position 0, no media, no prompt scores) replayed from a CUDA graph captured "
        "for its length bucket (16-128 by powers of two, then multiples of 128 up to --prefill-chunk), padded past "
        "its real tokens (inert: nothing written to the recurrent state, never attended): no per-op host launches "
        "(v3 on CUDA; off: eager).")
    flash_prefill: bool = _switch(
        "--flash-prefill", "-sdpaprefill", "v3",
        "A prompt chunk's full attention through the fused prologue and a flash-style Triton kernel "
        "(kernels/attention_prefill.py) over one bf16 copy of the chunk's keys (int8 dequantized in one pass): no "
        "mask tensor, no repeated K/V heads, the output gate applied as it is stored (v3 on CUDA; off: torch SDPA "
        "over a gathered, dequantized, head-repeated copy with an explicit mask).")
    cudnn_prefill: bool = _switch(
        "--cudnn-prefill", "-nocudnnpast", "v3",
        "With --flash-prefill, a long prompt chunk's attention split in two: its past keys (at least 2,048 before "
        "the chunk, dequantized once) through cuDNN's fused attention (torch's aten op, native GQA, no mask), the "
        "chunk's own causal block through the Triton kernel, which folds cuDNN's rows in by their log-sum-exp "
        "(CUDA, one row, head size 256: the Qwen3.5 / 3.8 family's; in fp16 where the queries and the cache's values "
        "fit its range, else in the model's 16-bit dtype; where cuDNN refuses, the Triton kernel over every key). "
        "At the 27B shape it took 2.0-3.9 % off a 65,000-token prefill in four runs (H100 and H200) and kept all 44 "
        "bundled NIAH oracle cases in fp16; at the bundled model's head size 64 it was slower, so it does not apply "
        "there (NINFER_BENCH_CUDNN_MIN_HEAD_DIM=8 makes it). cuDNN builds a plan for each new shape, 40-46 ms on an "
        "H100 (the shapes bucketed: query rows padded to a multiple of 512, past keys cut to a multiple of 2,048), so "
        "a process's first long prompt pays about one a chunk; where a layer's weights do not bound its values within "
        "fp16's range it reads back to the host once a chunk and layer.")
    silu_epilogue: bool = _switch(
        "--silu-epilogue", "-nosilu", "v3",
        "The MLP's gate / up weight interleaved in runs of 8 rows so that the projection kernel stores "
        "silu(gate) * up itself (CUDA, cupy).")
    fused_prefill: bool = _switch(
        "--fused-prefill", "-unfusedprefill", "v3",
        "A prompt chunk (no media, no rope positions of its own) through the fused path: the GDN layers' glue "
        "(causal conv from the slot's window, SiLU, q/k L2 norms, gated norm: kernels/gdn_prefill.py) and the norms "
        "between layers in Triton kernels instead of eager torch ops (v3 on CUDA; off: eager glue).")
    layer_prefill: bool = _switch(
        "--layer-prefill", "-chunkmajor", "v3",
        "A lone request's prompt of several chunks, when its packed weights are dequantized for prefill rather than "
        "kept as dense copies (a model that fills the GPU), prefilled layer by layer: every chunk through one layer "
        "before the next, each weight dequantized once a prompt instead of once a chunk; the same operations per "
        "chunk, the same tokens (v3 on CUDA with --fused-prefill; off: chunk by chunk).")
    last_rows: bool = _switch(
        "--last-rows", "-allrows", "v3",
        "A prompt chunk whose final hidden states are read at its last token alone (no prompt scores, no drafter that "
        "reads every row, as MTP does) runs its last decoder layer past the token mixing (which writes the cache) for "
        "that row only, as llama.cpp does for the rows it outputs: a long prompt's earlier chunks skip the rest of "
        "that layer. The first token's logits come from that row's own computation with or without a drafter, so "
        "speculative tokens stay plain decoding's (v3, on CUDA and on a CPU; off: every row, then the last picked).",
        cpu=True)
    qmv_dense: bool = True  # small dense bf16/fp16 projections (<= 1024 rows, <= 64 x rows) through qmv's dense
    #                         path instead of cuBLAS (process-wide: kernels/qmv_cuda.set_dense)
    prefill_weights: str = "auto"  # prefill-width projections of packed weights (v3 on CUDA): "dense" keeps a dense
    #                                copy of each (2 bytes a weight more; refused when the GPU cannot hold them),
    #                                "packed" dequantizes it on every chunk, "auto" keeps copies while they and the
    #                                packed weights take <= 60% of the free GPU memory (weights.keep_dense_copies)
    qmv_layout: str = "lanes"  # packed weights of bf16/fp16 models on CUDA: "lanes" (qmv's tile-contiguous layout
    #                            with one load a lane and no x shuffles), "tiled" (tile-contiguous) or "rows" (the
    #                            row-major buffers)
    gdn_impl: str = "auto"
    kernels: str = "auto"  # decode/verify kernels: auto (fused Triton for v3 on CUDA), torch, or triton
    cpu_threads: int | None = None  # torch intra-op threads on a CPU; None: 1 for small models, else torch's
    inject_delay_us: float = 0.0  # testing only: every decode step (a speculative round) made this much longer - a
    #                               known slowdown (runtime/delay.py: CPU time spun; on CUDA a sleep kernel + host spin)
    tensor_parallel: int = 1  # ranks the model is split over (engine/model/tensor_parallel.py); > 1: this process is
    #                           one rank of an initialised torch.distributed group (engine/runtime/parallel.py)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available on this machine")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise ValueError(f"tensor parallel size must be a positive integer, got {self.tensor_parallel!r}")
        if self.tensor_parallel > 1 and self.lm_head_draft:
            raise ValueError(f"--tensor-parallel {self.tensor_parallel}: --lm-head-draft (a drafter head over some "
                             "vocabulary rows) is not split over ranks yet")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto, fp32, bf16 or fp16, got {self.dtype!r}")
        if self.kv_dtype not in ("fp32", "bf16", "fp16", "int8"):
            raise ValueError(f"kv dtype must be fp32, bf16, fp16 or int8, got {self.kv_dtype!r}")
        if self.prefill_chunk is None:
            self.prefill_chunk = PREFILL_CHUNK[self.torch_device.type]
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
        elif not isinstance(self.draft_tokens, int) or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft-tokens must be an integer in 1..{MAX_DRAFT_TOKENS} with --spec {self.spec}, "
                             f"got {self.draft_tokens!r}")
        if self.rollback not in ("recompute", "snapshot"):
            raise ValueError(f"rollback must be recompute or snapshot, got {self.rollback!r}")
        if self.replay_acceptance is not None:
            if self.spec == "none":
                raise ValueError("--replay-acceptance replays a drafter's acceptance: give it with --spec mtp, "
                                 "dflash or dflash2")
            from ..spec.replay import check_value

            check_value(str(self.replay_acceptance))
        if not isinstance(self.lm_head_draft, int) or self.lm_head_draft < 0:
            raise ValueError(f"lm-head-draft must be a non-negative integer, got {self.lm_head_draft!r}")
        if self.interleave_chunk is not None and (not isinstance(self.interleave_chunk, int)
                                                  or self.interleave_chunk < 1):
            raise ValueError(f"interleave-chunk must be a positive integer, got {self.interleave_chunk!r}")
        if not isinstance(self.pack_prefill, bool):
            raise ValueError(f"pack-prefill must be true or false, got {self.pack_prefill!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"cpu-threads must be a positive integer, got {self.cpu_threads!r}")
        if isinstance(self.inject_delay_us, bool) or not isinstance(self.inject_delay_us, (int, float)) \
                or not 0 <= self.inject_delay_us < 1e7:
            raise ValueError(f"inject-delay-us must be a number of microseconds in [0, 1e7), got {self.inject_delay_us!r}")
        if self.prefill_weights not in ("auto", "dense", "packed"):
            raise ValueError(f"prefill weights must be auto, dense or packed, got {self.prefill_weights!r}")
        if self.prefill_weights != "auto" and (self.runtime != "v3" or self.torch_device.type != "cuda"):
            raise ValueError(f"--prefill-weights {self.prefill_weights} chooses how runtime v3 on CUDA keeps packed "
                             f"weights; here every weight is a dense copy already (the same run under another "
                             f"setting)")
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
            self.max_context = min(DEFAULT_CONTEXT, model_max_positions)
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


SWITCHES: dict[str, Switch] = {f.name: f.metadata["switch"] for f in fields(EngineOptions) if "switch" in f.metadata}


def resolve_device(name: str) -> torch.device:
    """``auto`` / ``cpu`` / ``cuda`` as a device: auto takes the GPU when one is visible; cuda without one is refused."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here (use --device cpu)")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def switch_labels(eo: EngineOptions) -> str:
    """The label suffixes of ``eo``'s switches away from their defaults, of those that apply to its runtime and
    drafter (e.g. ``-nopdl-nocudnnpast``): what the suites' default labels carry."""
    return "".join(s.label(getattr(eo, name)) for name, s in SWITCHES.items() if s.applies_to(eo.runtime, eo.spec))


def refuse_cuda_switches(device: str, switches: dict[str, tuple[bool, ...]]) -> None:
    """Refuse, before any work, a switch of :data:`SWITCHES` asked away from its default (``{name: values}``) for a
    run that is not on CUDA: the same run would come out under another label, which a gate takes for another
    experiment."""
    if EngineOptions(device=device).torch_device.type == "cuda":
        return
    moved = [f"{SWITCHES[name].flag} {'on' if not SWITCHES[name].default else 'off'}"
             for name, values in switches.items() if (not SWITCHES[name].default) in values and not SWITCHES[name].cpu]
    if moved:
        raise ValueError(f"{', '.join(moved)}: {'these switches change' if len(moved) > 1 else 'this switch changes'} "
                         f"only a run on CUDA (its graphs and fused kernels); on a CPU every run would take the "
                         f"same path under another label")
