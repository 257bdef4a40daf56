"""The bound Engine: one model, one device, fixed capacities; prefill, decode and generation.

Runtime ``v3`` is the current generation (packed-quantized fused kernels and CUDA-graph decode on CUDA);
``v2`` is the previous one kept as a fallback (eager, dense dequantized weights, plain torch kernels).
On a CPU both run eagerly through torch.
"""

from __future__ import annotations

import time

import torch

from ..artifact.loader import LoadedModel, load_source
from ..media.decode import MediaBudget, MediaCache, MediaInput, MediaLimits, load_media
from ..media.prompt import MediaPrompt, media_prompt
from ..model.cache import HybridCache
from ..model.config import ModelConfig
from ..model.hybrid import DECODE, PREFILL, HybridModel, Step
from ..model.rotary import column_axes
from ..model.vision import encode_items
from ..model.weights import WeightStore
from ..sampling import RowSampling, SamplingParams, make_generator, sample_rows
from ..spec import chain as spec_chain
from ..spec.loop import speculative_round
from .chain import chainable, decode_chained
from .delay import step_delay
from .options import MAX_DRAFT_TOKENS, EngineOptions, apply_cpu_threads
from .scoring import PromptScores
from .sequence import GenerationResult, Sequence, keep_logprobs
from .stops import StopRule


class CapacityError(ValueError):
    """A request that cannot fit the engine's capacities; refused before any work."""


class ContextOverflow(CapacityError):
    """A request whose tokens exceed the context: ``prompt_tokens`` + ``new_tokens`` (None: as many as fit, so at
    least one) > ``context`` (:attr:`Engine.context_limit`). The message names the engine's flags; a server words
    it in its API's terms from the fields."""

    def __init__(self, message: str, prompt_tokens: int, new_tokens: int | None, context: int):
        super().__init__(message)
        self.prompt_tokens, self.new_tokens, self.context = prompt_tokens, new_tokens, context


def _match(have, want, path: str) -> None:
    """ValueError at the first place where a saved nested state differs from the template (dtype, shape) pairs."""
    if isinstance(want, dict):
        if not isinstance(have, dict) or set(have) != set(want):
            raise ValueError(f"{path}: expected the entries {sorted(want)}, got "
                             f"{sorted(have) if isinstance(have, dict) else type(have).__name__}")
        for key in want:
            _match(have[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        if not isinstance(have, (list, tuple)) or len(have) != len(want):
            raise ValueError(f"{path}: expected {len(want)} entries")
        for i, (h, w) in enumerate(zip(have, want)):
            _match(h, w, f"{path}[{i}]")
    elif want is None:
        if have is not None:
            raise ValueError(f"{path}: expected nothing there")
    else:
        dtype, shape = want
        if not isinstance(have, torch.Tensor) or have.dtype != dtype or tuple(have.shape) != tuple(shape):
            got = f"{str(have.dtype).replace('torch.', '')} {list(have.shape)}" if isinstance(have, torch.Tensor) \
                else type(have).__name__
            raise ValueError(f"{path}: expected {str(dtype).replace('torch.', '')} {list(shape)}, got {got}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# A layer-major prefill (Engine.layer_prefill) holds every chunk's activations across the layers: at most this share
# of the free device memory (the 27B's 65K prompt: 1.3 GB, plain decoding).
LAYER_PREFILL_SHARE = 0.25


class Engine:
    """An inference engine bound to one model, one device and fixed capacities (docs/DESIGN.md, "Engine and
    runtime")."""

    def __init__(self, loaded: LoadedModel, options: EngineOptions):
        self.options = opts = options
        self.loaded = loaded
        self.config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.stops = StopRule(self.tokenizer)  # end / stop ids, stop strings in the text (control ids left out)
        self.device, self.dtype = opts.torch_device, opts.torch_dtype
        opts.bind(self.config.max_position_embeddings)
        if self.device.type == "cpu":
            apply_cpu_threads(self.config.hidden_size, opts.cpu_threads)
        # captured on side streams, the GDN z projection runs beside the layer's token mixing: a weight of its own
        side = opts.side_stream and self.device.type == "cuda" and opts.fused_kernels()
        interleave = opts.silu_epilogue and opts.fused_kernels()  # the gate_up fusion, interleaved (any device)
        # tensor parallel: this rank's slices of the weights, and a config of its share of the heads
        self.tp, self.model_config, raws = None, self.config, loaded.raws
        self.tp_ipc_off = None  # why a tensor-parallel engine on GPUs keeps torch.distributed's collectives
        if opts.tensor_parallel > 1:
            from ..model import tensor_parallel as tpm

            self.model_config = tpm.local_config(self.config, opts.tensor_parallel)  # (refuses what does not divide)
            self.tp = tpm.TPGroup.current(opts.tensor_parallel)
            if loaded.tp_shard != (self.tp.rank, self.tp.size):
                # the share replaces the whole model in ``loaded`` (which a grid's runs share): a rank holds its
                # share only, and its step's bytes (weight_bytes_per_step) are its own
                if loaded.tp_shard is not None:
                    raise ValueError(f"--tensor-parallel {self.tp.size}: these weights are already rank "
                                     f"{loaded.tp_shard[0]} of {loaded.tp_shard[1]}'s share")
                loaded.raws = tpm.shard_raws(loaded.raws, self.config, self.tp.rank, self.tp.size)
                loaded.tp_shard = (self.tp.rank, self.tp.size)
            raws = loaded.raws
            if self.device.type == "cuda":  # the collectives through CUDA IPC, which CUDA graphs capture
                self.tp_ipc_off = self.tp.use_ipc(self.device)
                if self.tp_ipc_off is not None and opts.cuda_graphs:
                    import warnings

                    warnings.warn(f"--tensor-parallel {opts.tensor_parallel}: the collectives stay torch.distributed's "
                                  f"({self.tp_ipc_off}), which are not captured: CUDA graphs off", stacklevel=2)
                    opts.cuda_graphs = False
        self.weights = WeightStore(raws, device=self.device, dtype=self.dtype, runtime=opts.runtime,
                                   apart=("linear_attn.in_proj_qkvz",) if side else (),
                                   interleave=interleave, fuse=True if interleave else None,
                                   tied_embeddings=self.config.tie_word_embeddings, qmv_layout=opts.qmv_layout,
                                   prefill_weights=opts.prefill_weights, tp=self.tp)
        # spec verification writes up to K + 1 positions past a sequence's length: room per slot for the most any
        # mode writes, in every mode, so that engines of one slot capacity have one cache capacity whatever their
        # spec: decode attention's split plan is a function of it (kernels/attn_cuda.plan), and another plan rounds
        # differently, so a speculative engine's greedy tokens would not be a plain one's
        self.slack = MAX_DRAFT_TOKENS + 1
        self.capacity = opts.slot_capacity + self.slack
        self.model = HybridModel(self.model_config, self.weights, max_positions=self.capacity,
                                 gdn_impl=opts.gdn_impl if opts.runtime == "v3" else "chunked",
                                 fused_kernels=opts.fused_kernels(), side_stream=side,
                                 flash_prefill=opts.flash_prefill, fused_prefill=opts.fused_prefill,
                                 cudnn_prefill=opts.cudnn_prefill, tp=self.tp)
        # one extra slot serves logits() and other scratch work without touching requests
        self.cache = HybridCache(self.model_config, slots=opts.max_concurrency + 1, capacity=self.capacity,
                                 kv_dtype=opts.kv_dtype, dtype=self.dtype, device=self.device,
                                 mtp_layers=self.config.mtp_num_hidden_layers if opts.spec == "mtp" else 0,
                                 rollback=opts.rollback)
        self.weights.settle_dense_copies()  # auto: dense prefill copies only if they fit beside the cache
        self.scratch_slot = opts.max_concurrency
        self.vision, self.preprocess = None, None  # the vision tower, when the artifact has a vision component
        if loaded.vision is not None:
            from ..model.vision import VisionTower

            vcfg, self.preprocess, vraws = loaded.vision
            self.vision = VisionTower(vcfg, vraws, device=self.device, dtype=self.dtype)
            self.model.mrope_axes = column_axes(self.config.rotary_dim, vcfg.mrope_section).to(self.device)
        self.media_cache, self.media_limits = MediaCache(), MediaLimits()
        self.free_slots = list(range(opts.max_concurrency))
        self.step_delay = step_delay(opts.inject_delay_us, self.device)  # testing only: a known slowdown a step
        self.drafter = self._make_drafter(opts.spec)
        self.replay = None  # replayed acceptance (spec/replay.py): drafts replaced at a chosen acceptance
        if opts.replay_acceptance is not None:
            from ..spec.replay import Replay, profile

            self.replay = Replay(profile(str(opts.replay_acceptance), opts.spec, opts.draft_tokens),
                                 self.config.vocab_size, self.device)
        self.graphs = None
        self.chain_used = False  # whether the last run() decoded through a graph chain (chain.py, spec/chain.py)
        self.spec_times = None  # the last speculative round's timing events, read one round late (spec/loop.py)
        self.spec_chain = None  # the captured speculative round of chained greedy decoding (spec/chain.py)
        if self.device.type == "cuda":
            from ...kernels import _triton, qmv_cuda

            # qmv's and the Triton glue kernels' one switch, plain and speculative (the graphs of one sequence:
            # model/graphs.PDL_MAX_SEQS)
            _triton.set_pdl(opts.pdl)
            qmv_cuda.set_dense(opts.qmv_dense)
        if self.device.type == "cuda" and opts.runtime == "v3" and opts.cuda_graphs:
            from ..model.graphs import GraphRunner

            self.graphs = GraphRunner(self)

    def _make_drafter(self, spec: str):
        if spec == "none":
            return None
        from ..spec.drafters import BlockDraftRunner, MTPDrafter

        return MTPDrafter(self) if spec == "mtp" else BlockDraftRunner(self, spec)

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def load(cls, source: str | None = None, *, synthetic: bool = False, quant: str = "mixed", seed: int = 0,
             **options) -> "Engine":
        """Load an artifact path or preset and bind it (keyword options: see :class:`EngineOptions`)."""
        opts = EngineOptions(**options)
        loaded = load_source(source, synthetic=synthetic, quant=quant, seed=seed, device=opts.torch_device)
        return cls(loaded, opts)

    @property
    def model_info(self) -> dict:
        """What a result document records of the model."""
        cfg = self.config
        return {**self.loaded.info, "model_type": cfg.model_type, "layers": cfg.num_hidden_layers,
                "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                "weight_bytes": self.weights.weight_bytes, "drafters": sorted(self.loaded.drafters)}

    @property
    def recorded(self) -> dict:
        """Settings as this engine applies them, which a result document records over the options asked for:
        ``cudnn_prefill`` only where the split can apply to this model on this device (CUDA, its head size: the
        bundled model's 64 never takes it), so a run records what it ran."""
        from ...kernels.attention_prefill import cudnn_split_applies

        return {"cudnn_prefill": bool(self.model.cudnn_prefill
                                      and cudnn_split_applies(self.model_config.head_dim, self.device))}

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads: every text-layer weight plus lm_head and one embedding row (under
        tensor parallelism this rank's share: what its GPU reads)."""
        total = 0
        for name, raw in self.loaded.raws.items():
            if name.startswith("mtp."):
                continue
            if name.endswith("embed_tokens.weight"):
                total += raw.nbytes // raw.shape[0]
                if self.config.tie_word_embeddings:
                    total += raw.nbytes
                continue
            total += raw.nbytes
        return total

    # ---- slots -----------------------------------------------------------------------------------
    @property
    def context_limit(self) -> int:
        """Prompt plus generated tokens a request may hold: --max-context, or a slot's K/V capacity when smaller."""
        return min(self.options.max_context, self.options.slot_capacity)

    def check_fits(self, prompt_len: int, max_new_tokens: int | None) -> None:
        """Refuse, before any work, a request that cannot fit the capacities (:class:`ContextOverflow` when its
        tokens exceed :attr:`context_limit`). ``max_new_tokens`` None: as many as fit, so at least one."""
        opts = self.options
        if prompt_len < 1:
            raise CapacityError("empty prompt: at least one token is needed")
        new = 1 if max_new_tokens is None else max_new_tokens
        need = prompt_len + new
        asked = f"max_new_tokens ({new})" if max_new_tokens is not None else "a generated token"
        if need > opts.max_context:
            raise ContextOverflow(f"prompt ({prompt_len} tokens) + {asked} = {need} exceeds --max-context "
                                  f"{opts.max_context}", prompt_len, max_new_tokens, self.context_limit)
        if need > opts.slot_capacity:
            raise ContextOverflow(f"request needs {need} K/V tokens but each of the {opts.max_concurrency} slots "
                                  f"holds {opts.slot_capacity} (--kv-capacity {opts.kv_capacity})", prompt_len,
                                  max_new_tokens, self.context_limit)

    def check_ids(self, ids) -> None:
        """Refuse token ids outside the vocabulary (the embedding lookup would fail with an IndexError)."""
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")

    def acquire(self, prompt: list[int], params: SamplingParams, media: MediaPrompt | None = None) -> Sequence:
        """A slot for ``prompt`` (CapacityError when none is free). With a drafter, log-probabilities come only from
        the target's own prefill: the prompt's (``prompt_logprobs``) and the first generated token's (``logprobs``
        with ``max_new_tokens`` <= 1); speculative rounds keep none."""
        self.check_fits(len(prompt), params.max_new_tokens)
        if media is not None and len(media.mask) != len(prompt):
            raise ValueError(f"media prompt covers {len(media.mask)} tokens, the prompt has {len(prompt)}")
        self.check_ids(prompt)
        if params.keeps_logprobs and self.drafter is not None and params.max_new_tokens > 1:
            raise ValueError("logprobs past the first generated token are kept for plain decoding only (spec none)")
        if self.replay is not None and not params.greedy:
            raise ValueError("replayed acceptance replays greedy decoding: temperature 0 only")
        if not self.free_slots:
            raise CapacityError(f"no free capacity: all {self.options.max_concurrency} slots are busy")
        gen = None if params.greedy else make_generator(params.seed, self.device)
        slot = self.free_slots.pop(0)
        self.cache.reset(slot)
        seed = params.seed if params.seed is not None else gen.initial_seed() if gen is not None else 0
        return Sequence(slot=slot, prompt=list(prompt), params=params, generator=gen, sample_seed=seed, media=media)

    # ---- media -------------------------------------------------------------------------------------
    def load_media(self, kind: str, source, budget: MediaBudget | None = None) -> MediaInput:
        """Read and preprocess an image or video (bytes, data URI or path) for this model's vision tower.
        ``budget``: the request's (:meth:`media_budget`), shared by all its items; without one the item is held to
        the per-request total alone."""
        if self.vision is None:
            raise ValueError(f"this model has no vision component: it cannot take {kind} input")
        return load_media(kind, source, self.preprocess, self.media_limits, budget)

    def media_budget(self) -> MediaBudget:
        """A fresh decoded-bytes budget for one request's media items (``MediaLimits.max_request_bytes``)."""
        return MediaBudget(self.media_limits)

    def media_prompt(self, ids: list[int], items: list[MediaInput]) -> tuple[list[int], MediaPrompt | None]:
        """``ids`` with one placeholder per item (:func:`..media.prompt.placeholder`) widened to the item's vision
        tokens, and where those go; (ids, None) without media. ValueError when the placeholders and the items
        disagree, no items included: a placeholder typed into the text would take the pad embedding with no image."""
        if not items:
            if self.vision is not None:
                from ..media.prompt import expand

                expand(ids, [], self.vision.cfg, self.tokenizer.encode)
            return list(ids), None
        if self.vision is None:
            raise ValueError("this model has no vision component: it cannot take image or video input")
        if len(items) > self.media_limits.max_items:
            raise ValueError(f"{len(items)} media inputs exceed the limit of {self.media_limits.max_items}")
        return media_prompt(ids, items, self.vision.cfg, self.tokenizer.encode)

    def encode_media(self, media: MediaPrompt) -> None:
        """Run the vision tower over the items not in the media cache; fills ``media.embeds`` and its stats."""
        if media.embeds is None:
            media.embeds, media.stats = encode_items(self.vision, self.media_cache, media.items, self.device)

    def _media_rows(self, media: MediaPrompt | None, start: int, end: int) -> dict:
        """The Step fields of prompt positions ``start:end`` (none for a text prompt)."""
        if media is None:
            return {}
        self.encode_media(media)
        embeds, mask, rope = media.chunk(start, end)
        return {"embeds": embeds, "embed_mask": mask.to(self.device), "rope_pos": rope.to(self.device)}

    def rope_shift(self, seqs: list[Sequence], pos: torch.Tensor) -> torch.Tensor | None:
        """Rotary positions of generated rows ``pos [B, T]``: shifted by each sequence's media delta; None when
        no sequence has one (the plain path)."""
        if not any(s.media is not None and s.media.delta for s in seqs):
            return None
        return pos + self.device_ids([s.media.delta if s.media is not None else 0 for s in seqs])[:, None]

    # ---- persistent state ----------------------------------------------------------------------------
    def export_state(self, seq: Sequence) -> dict:
        """Everything needed to continue ``seq`` later in another slot: the token ids its cache covers, the
        K/V and recurrent state of its slot, and the drafter's state (on the CPU)."""
        ids = (seq.prompt + seq.tokens)[: seq.length]
        state = {"ids": ids, "cache": self.cache.export_slot(seq.slot, seq.length), "spec": self.options.spec,
                 "kv_dtype": self.options.kv_dtype}
        if self.drafter is not None:
            state["drafter"] = self.drafter.export_slot(seq.slot)
        return state

    def check_state(self, state: dict) -> None:
        """ValueError naming the first thing of a saved state (:meth:`export_state`, from a file) that this engine's
        slots cannot take: its structure, a tensor's dtype or shape, a length past a slot's capacity."""
        if not isinstance(state, dict) or not isinstance(state.get("ids"), list) \
                or not isinstance(state.get("cache"), dict):
            raise ValueError("not an engine state (ids and cache missing)")
        length = state["cache"].get("length")
        if not isinstance(length, int) or length != len(state["ids"]) or not 0 <= length <= self.capacity:
            raise ValueError(f"its length {length!r} is not its {len(state['ids'])} tokens within a slot's "
                             f"{self.capacity}")
        want = {"cache": self.cache.slot_shapes(length)}
        have = {"cache": {k: state["cache"].get(k) for k in ("kv", "conv", "ssm")}}
        if self.drafter is not None and state.get("spec") == self.options.spec and "drafter" in state:
            want["drafter"], have["drafter"] = self.drafter.slot_shapes(), state["drafter"]
        _match(have, want, "state")

    def reusable(self, state: dict, prompt: list[int], media: MediaPrompt | None = None) -> int:
        """How many tokens of ``prompt`` a saved state (:meth:`export_state`) covers: all of its ids when they
        prefix the prompt (and leave a token to prefill) under this engine's options, else 0."""
        ids = state["ids"]
        if media is not None:  # pad tokens do not say which image they were: never reuse a cached prefix
            return 0
        if (len(ids) != state["cache"]["length"] or len(ids) >= len(prompt) or prompt[: len(ids)] != ids
                or state.get("spec") != self.options.spec or state.get("kv_dtype") != self.options.kv_dtype):
            return 0
        return len(ids)

    def import_state(self, seq: Sequence, state: dict) -> int:
        """Load a state from :meth:`export_state` into ``seq``'s slot when its ids prefix ``seq.prompt``;
        returns how many prompt tokens it covers (0 when it does not fit and nothing was loaded)."""
        if not self.reusable(state, seq.prompt, seq.media):
            return 0
        n = self.cache.import_slot(seq.slot, state["cache"])
        if self.drafter is not None and "drafter" in state:
            self.drafter.import_slot(seq.slot, state["drafter"])
        seq.length = n
        return n

    # ---- forward passes --------------------------------------------------------------------------
    def device_ids(self, ids) -> torch.Tensor:
        """Host ints as a device tensor. On CUDA through pinned memory without blocking: a pageable copy makes
        torch synchronise the stream, which stalled eager rounds (speculative drafting) at every call."""
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return torch.as_tensor(ids, dtype=torch.long, device=self.device)
        return torch.tensor(ids, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def prefill(self, slot: int, ids: list[int], start: int = 0, *, all_logits: bool = False,
                taps: tuple[int, ...] = (), media: MediaPrompt | None = None):
        """Run ``ids`` through the model into ``slot`` from position ``start`` in ``--prefill-chunk`` pieces.

        Returns (logits of the last position [V] or of every position [T, V], final hidden [T, H] of the
        last chunk... every chunk when ``all_logits``, tap outputs per chunk concatenated)."""
        chunk = self.options.prefill_chunk
        logits, hiddens, tap_out = [], [], []
        slots = self.device_ids([slot])
        for c0 in range(0, len(ids), chunk):
            piece = ids[c0:c0 + chunk]
            pos = torch.arange(start + c0, start + c0 + len(piece), device=self.device)[None]
            rows = self._media_rows(media, c0, c0 + len(piece))
            step = Step(self.device_ids([piece]), pos, slots, kv_len=start + c0 + len(piece), mode=PREFILL, taps=taps,
                        start=start + c0, **rows)
            hidden, tp = self.model.forward(step, self.cache)
            if all_logits:
                logits.append(self.model.logits(hidden[0]))
            hiddens.append(hidden[0])
            tap_out.append(tp)
        if not all_logits:
            logits = [self.model.logits(hiddens[-1][-1:])]
        taps_cat = [torch.cat([t[j][0] for t in tap_out]) for j in range(len(taps))]
        return torch.cat(logits), torch.cat(hiddens), taps_cat

    @torch.inference_mode()
    def logits(self, ids: list[int], media: MediaPrompt | None = None) -> torch.Tensor:
        """fp32 logits ``[T, V]`` of a full prefill of ``ids`` (no sampling; for validation)."""
        self.check_fits(len(ids), 0)
        self.check_ids(ids)
        self.cache.reset(self.scratch_slot)
        out, _, _ = self.prefill(self.scratch_slot, list(ids), all_logits=True, media=media)
        return out.float().cpu()

    @torch.inference_mode()
    def path_logits(self, ids: list[int], start: int) -> torch.Tensor:
        """fp32 logits ``[len(ids) - start, V]`` of positions ``start ..`` of one prefill of ``ids`` (the positions
        before ``start`` prefilled without logits: a long prompt's rows are never all kept; for validation)."""
        if not 0 <= start < len(ids):
            raise ValueError(f"path_logits: start {start} outside the {len(ids)} ids")
        self.check_fits(len(ids), 0)
        self.check_ids(ids)
        self.cache.reset(self.scratch_slot)
        if start:
            self.prefill(self.scratch_slot, list(ids[:start]))
        out, _, _ = self.prefill(self.scratch_slot, list(ids[start:]), start, all_logits=True)
        return out.float().cpu()

    def score(self, ids: list[int], top: int = 0) -> PromptScores:
        """Each token's log-probability given those before it, and the ``top`` most likely of each position, for
        ``ids`` prefilled chunk by chunk on the scratch slot (compact: no ``[T, V]`` rows are kept, see
        :mod:`.scoring`). A server scores in the request's own prefill instead (``prompt_logprobs``)."""
        self.check_fits(len(ids), 0)
        self.check_ids(ids)
        self.cache.reset(self.scratch_slot)
        seq = Sequence(slot=self.scratch_slot, prompt=list(ids),
                       params=SamplingParams(max_new_tokens=0, prompt_logprobs=top))
        while not self.prefill_step(seq):
            pass
        return seq.prompt_scores

    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence], ids: torch.Tensor, mode: str = DECODE):
        """One forward of ``ids [B, T]`` continuing each sequence at its length: (hidden, logits [B, T, V])."""
        hidden, logits, _ = self.forward_rows(seqs, ids, mode)
        return hidden, logits

    def forward_rows(self, seqs: list[Sequence], ids: torch.Tensor, mode: str, taps: tuple[int, ...] = ()):
        """(hidden, logits, taps) of ``ids [B, T]`` at each sequence's length; via CUDA graphs when captured."""
        b, t = ids.shape
        start = self.device_ids([s.length for s in seqs])
        pos = start[:, None] + torch.arange(t, device=self.device)[None]
        slots = self.device_ids([s.slot for s in seqs])
        rope = self.rope_shift(seqs, pos)
        if self.graphs is not None and rope is None:  # graphs rotate at the cache position: media rows run eagerly
            return self.graphs.forward(mode, ids, pos, slots, taps)
        step = Step(ids, pos, slots, kv_len=max(s.length for s in seqs) + t, mode=mode, taps=taps, rope_pos=rope)
        hidden, tap_out = self.model.forward(step, self.cache)
        return hidden, self.model.logits(hidden), tap_out

    def commit(self, keep: torch.Tensor) -> None:
        """Roll the verified rows back to their first ``keep`` positions (graph replay when captured)."""
        pending = self.cache.pending
        if self.graphs is not None and hasattr(pending, "commit_graph"):
            self.cache.pending = None
            self.graphs.commit(pending, keep)
        else:
            self.cache.commit(keep)

    # ---- generation ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_step(self, seq: Sequence, chunk: int | None = None) -> bool:
        """Prefill the next ``chunk`` (default ``--prefill-chunk``) tokens of ``seq``'s prompt (from ``seq.length``,
        so a cached prefix is skipped), scoring its positions when ``seq.prompt_scores`` asks for it. After the last
        chunk, pick the first token and prime the drafter (``max_new_tokens`` 0: neither, the sequence ends there);
        returns True then."""
        chunk = min(chunk or self.options.prefill_chunk, self.options.prefill_chunk)
        start = seq.length
        piece = seq.prompt[start:start + chunk]
        prefill_only = seq.params.max_new_tokens == 0
        final = start + len(piece) == len(seq.prompt)
        taps = self.drafter.taps if self.drafter and not prefill_only else ()
        out = head = last = None
        if self.graphs is not None and seq.media is None and seq.prompt_scores is None:
            # None: no graph for it (GraphRunner.prefill_plan); a final chunk's graph also picks the first token
            out = self.graphs.prefill(piece, seq.slot, taps, start, head=final and not prefill_only,
                                      all_rows=self.all_rows(seq))
        if out is None:
            step = self._chunk_step(seq, start, len(piece), taps)
            hidden, tap_out = self.model.forward(step, self.cache)
            last = step.head
        else:
            hidden, tap_out, head = out
        return self._chunk_done(seq, start, len(piece), hidden, tap_out, head, last)

    def all_rows(self, seq: Sequence) -> bool:
        """Whether every prompt row's final hidden state is read after its chunk's forward (Step.all_rows): prompt
        scores, or a drafter that reads them (MTP); otherwise only the last prompt token's, for the first token."""
        return seq.prompt_scores is not None or bool(
            self.drafter and seq.params.max_new_tokens and getattr(self.drafter, "reads_hidden", True))

    def _chunk_step(self, seq: Sequence, start: int, n: int, taps: tuple[int, ...]) -> Step:
        """The eager prefill Step of ``seq``'s prompt tokens ``start .. start + n - 1``; with ``--last-rows`` the final
        hidden state read at the prompt's last token (in its final chunk, where a token follows), every row's too
        where :meth:`all_rows`."""
        ids = self.device_ids([seq.prompt[start:start + n]])
        pos = torch.arange(start, start + n, device=self.device)[None]
        rows = None
        if self.options.last_rows:
            head = start + n == len(seq.prompt) and seq.params.max_new_tokens > 0
            rows = self.device_ids([[n - 1]]) if head else torch.empty(1, 0, dtype=torch.long, device=self.device)
        return Step(ids, pos, self.device_ids([seq.slot]), kv_len=start + n, mode=PREFILL, taps=taps, start=start,
                    rows=rows, all_rows=self.all_rows(seq), **self._media_rows(seq.media, start, start + n))

    def _chunk_done(self, seq: Sequence, start: int, n: int, hidden, tap_out, head, last=None) -> bool:
        """What follows the forward of ``seq``'s prompt chunk ``start .. start + n - 1`` (:meth:`prefill_step`): the
        length advanced, prompt scores, and after the last chunk the first token picked (``head``: a prefill
        graph's logits and argmax, or None; else from ``last``, the final hidden state of the prompt's last token
        ``[1, 1, H]`` (Step.head), or ``hidden``'s last row); the drafter primed. Returns whether the prompt is
        done."""
        final = start + n == len(seq.prompt)
        prefill_only = seq.params.max_new_tokens == 0
        seq.length += n
        if seq.prompt_scores is not None:  # each position scores the prompt token after it
            following = self.device_ids(seq.prompt[start + 1:seq.length + 1])
            seq.prompt_scores.add(self.model.logits, hidden[0], start, following)
            if final:
                seq.prompt_scores.finish()
        if prefill_only:  # nothing to generate, nothing to draft: the sequence ends with its prompt
            seq.finish_reason = "length" if final else None
            return final
        if final:
            row = head[0][0] if head is not None else self.model.logits(
                (hidden if last is None else last)[0, -1:])[0]
            keep_logprobs(seq, row)
            greedy = head is not None and self.plain_argmax([seq])  # the graph's argmax is pick's
            seq.tokens.append(int(head[1][0] if greedy else self.pick([seq], row[None])[0]))
        if self.drafter:
            self.drafter.begin(seq, start, hidden[0], torch.cat([t[0] for t in tap_out], dim=-1) if tap_out else None)
        if final:
            self.stops.finish(seq)
        return final

    def layer_prefill(self, seq: Sequence) -> bool:
        """Whether :meth:`start` prefills ``seq``'s prompt layer by layer (``--layer-prefill``): text, more than one
        chunk left, the fused prefill path, packed weights dequantized for prefill (no dense copies kept: a weight is
        then dequantized once instead of once a chunk), and every chunk's activations held across the layers (its
        normed input and residual, and the drafter's tap outputs) within LAYER_PREFILL_SHARE of the free memory."""
        left = len(seq.prompt) - seq.length
        if not (self.options.layer_prefill and self.model.fused_prefill and self.model.fast is not None
                and self.tp is None and seq.media is None and left > self.options.prefill_chunk
                and self.weights.dequantizes_prefill):
            return False
        from ..model.memory import available_bytes

        taps = len(self.drafter.taps) if self.drafter and seq.params.max_new_tokens else 0
        need = (2 + taps) * left * self.model_config.hidden_size * self.dtype.itemsize
        have = available_bytes(self.device)
        return have is None or need <= LAYER_PREFILL_SHARE * have

    @torch.inference_mode()
    def prefill_layers(self, seq: Sequence, on_prefill=None) -> None:
        """Prefill the rest of ``seq``'s prompt layer by layer (HybridModel's FastPath.forward_layers): its chunks of
        ``--prefill-chunk`` tokens all through one layer before the next; then, chunk by chunk in order, what
        :meth:`prefill_step` does after a forward. ``on_prefill(done, total)`` follows the layers."""
        prefill_only = seq.params.max_new_tokens == 0
        taps = self.drafter.taps if self.drafter and not prefill_only else ()
        size = self.options.prefill_chunk
        chunks = [(a, min(size, len(seq.prompt) - a)) for a in range(seq.length, len(seq.prompt), size)]
        steps = [self._chunk_step(seq, a, n, taps) for a, n in chunks]
        layers, left, base = self.model_config.num_hidden_layers, len(seq.prompt) - seq.length, seq.length

        def after(i: int) -> None:  # the prompt tokens through all the layers so far; the caller reports the end
            if on_prefill and i + 1 < layers:
                on_prefill(base + left * (i + 1) // layers, len(seq.prompt))

        outs = self.model.fast.forward_layers(steps, self.cache, after_layer=after)
        for (a, n), step, (hidden, tap_out) in zip(chunks, steps, outs):
            self._chunk_done(seq, a, n, hidden, tap_out, None, step.head)

    def packable(self, seq: Sequence) -> bool:
        """Whether ``seq``'s next prompt chunk may share one forward with other requests' (:meth:`prefill_steps`):
        text only, no prompt scores, something to generate."""
        return seq.media is None and seq.prompt_scores is None and seq.params.max_new_tokens > 0

    @torch.inference_mode()
    def prefill_steps(self, work: list[tuple[Sequence, int]], on_final=None) -> list[bool]:
        """Prefill the next ``n`` prompt tokens of each ``(seq, n)`` of ``work`` (the scheduler's prompt chunks of
        one iteration); returns, per item, whether its prompt is done (:meth:`prefill_step`'s result). With
        ``pack_prefill`` and two or more chunks that :meth:`packable` allows, they run as one forward: rows padded to
        the longest chunk (``Step.valid``: the padding is inert in the recurrent state and never attended by a real
        token), so every weight is read once for all of them; the others (or all, with it off) one forward each.
        ``on_final(i)`` is called as soon as item ``i``'s prompt is done (its first token can go out)."""
        packed = [i for i, (seq, _) in enumerate(work) if self.packable(seq)] if self.options.pack_prefill else []
        if len(packed) > 1:
            t = max(work[i][1] for i in packed)
            packed = [i for i in packed if work[i][0].length + t <= self.capacity]  # padding stays inside the slot
        done: dict[int, bool] = {}

        def finished(i: int, final: bool) -> None:
            done[i] = final
            if final and on_final:
                on_final(i)

        if len(packed) > 1:
            for i, final in zip(packed, self._prefill_packed([work[i] for i in packed])):
                finished(i, final)
        for i, (seq, n) in enumerate(work):
            if i not in done:
                finished(i, self.prefill_step(seq, n))
        return [done[i] for i in range(len(work))]

    def _prefill_packed(self, work: list[tuple[Sequence, int]]) -> list[bool]:
        """One forward over several sequences' next prompt chunks (see :meth:`prefill_steps`); then, per sequence,
        what :meth:`prefill_step` does after its forward: the drafter primed, the first token of a finished prompt
        (every finished row picked in one batched call, each from its own sample stream)."""
        t = max(n for _, n in work)
        rows = [seq.prompt[seq.length:seq.length + n] + [0] * (t - n) for seq, n in work]
        starts = [seq.length for seq, _ in work]
        taps = self.drafter.taps if self.drafter else ()
        pos = self.device_ids(starts)[:, None] + torch.arange(t, device=self.device)[None]
        # --last-rows: each row's final hidden state read at its last real token (Step.rows), every row's too for a
        # drafter that reads them
        step = Step(self.device_ids(rows), pos, self.device_ids([seq.slot for seq, _ in work]),
                    kv_len=max(starts) + t, mode=PREFILL, taps=taps, valid=self.device_ids([n for _, n in work]),
                    rows=self.device_ids([[n - 1] for _, n in work]) if self.options.last_rows else None,
                    all_rows=self.all_rows(work[0][0]))
        hidden, tap_out = self.model.forward(step, self.cache)
        finals = []
        for r, (seq, n) in enumerate(work):
            seq.length += n
            if seq.length == len(seq.prompt):
                finals.append(r)
        if finals:
            last = self.model.logits(step.head[finals, 0] if step.head is not None else
                                     torch.stack([hidden[r, work[r][1] - 1] for r in finals]))
            fin = [work[r][0] for r in finals]
            for seq, row in zip(fin, last):
                keep_logprobs(seq, row)
            for seq, tok in zip(fin, self.pick(fin, last).tolist()):
                seq.tokens.append(tok)
        for r, (seq, n) in enumerate(work):
            if self.drafter:
                self.drafter.begin(seq, starts[r], hidden[r, :n],
                                   torch.cat([x[r, :n] for x in tap_out], dim=-1) if taps else None)
            if r in finals:
                self.stops.finish(seq)
        return [r in finals for r in range(len(work))]

    def start(self, seq: Sequence, on_prefill=None) -> None:
        """Prefill ``seq``'s prompt (past any cached prefix), pick its first token, and prime the drafter.
        ``on_prefill(done, total)`` is called after each chunk with the prompt tokens prefilled so far."""
        if seq.length >= len(seq.prompt):
            raise ValueError("nothing to prefill: the cached prefix covers the whole prompt")
        if self.layer_prefill(seq):
            self.prefill_layers(seq, on_prefill)
            if on_prefill:
                on_prefill(seq.length, len(seq.prompt))
            return
        done = False
        while not done:
            done = self.prefill_step(seq)
            if on_prefill:
                on_prefill(seq.length, len(seq.prompt))

    @torch.inference_mode()
    def advance(self, seqs: list[Sequence]) -> None:
        """One decode round (plain, or draft + verify) for every unfinished sequence in ``seqs`` (batched)."""
        live = [s for s in seqs if s.finish_reason is None]
        if not live:
            return
        if self.drafter is not None:
            speculative_round(self, live)
            if self.step_delay:
                self.step_delay()
            return
        ids = self.device_ids([[s.last] for s in live])
        _, logits = self.decode_step(live, ids)
        if self.step_delay:  # queued behind the step's kernels, before its token is read
            self.step_delay()
        last = logits[:, -1]
        for r, s in enumerate(live):
            keep_logprobs(s, last[r])
        picked = self.pick(live, last)
        for s, tok in zip(live, picked.tolist()):  # one device-to-host read for the whole batch
            s.length += 1
            s.tokens.append(tok)
            self.stops.finish(s)

    @staticmethod
    def plain_argmax(seqs: list[Sequence]) -> bool:
        """Whether :meth:`pick` takes the rows' argmax: every sequence greedy, none keeping top log-probabilities."""
        return all(s.params.greedy and s.params.top_logprobs is None for s in seqs)

    def pick(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The next token of each of ``seqs`` from its row of ``logits [B, V]``, every row in one batched call
        (``sampling.sample_rows``): the argmax for a greedy row; for a sampling row draw ``len(seq.tokens)`` of its
        request's stream (``seq.sample_seed``): a seeded request's tokens do not depend on what it is batched with.
        A row whose request keeps ``top_logprobs`` N gets the token's log-probability (under the model's own
        distribution) and its N most likely appended to ``seq.logprobs``, from the same call."""
        if self.plain_argmax(seqs):
            return logits.argmax(-1)
        tops = [s.params.top_logprobs for s in seqs]
        n = max((t for t in tops if t is not None), default=None)
        params, seeds, steps = [s.params for s in seqs], [s.sample_seed for s in seqs], [len(s.tokens) for s in seqs]
        if n is None and self.graphs is not None:  # captured: a replay instead of the sampler's fifty launches
            return self.graphs.sample(logits, params, seeds, steps)
        rows = RowSampling.make(params, seeds, steps, self.device)
        if n is None:
            return sample_rows(logits, rows).tokens
        out = sample_rows(logits, rows, logprobs=min(n, logits.shape[-1]))
        # each asking row's token log-probability and top N: one small copy for the batch
        lp = out.logprobs.tolist()
        ids = out.top_ids.tolist() if out.top_ids is not None else [[] for _ in seqs]
        vals = out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in seqs]
        for r, (s, k) in enumerate(zip(seqs, tops)):
            if k is not None:
                s.logprobs.append((lp[r], list(zip(ids[r][:k], vals[r][:k]))))
        return out.tokens

    def release(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)
        if seq.slot != self.scratch_slot and seq.slot not in self.free_slots:
            self.free_slots.append(seq.slot)
            self.free_slots.sort()

    def generate(self, prompt_ids: list[int], max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=(), media: MediaPrompt | None = None,
                 on_prefill=None, reference: list[int] | None = None, **extra) -> GenerationResult:
        """Generate from ``prompt_ids`` (with ``media`` from :meth:`media_prompt`); returns tokens, text, timings
        and speculative statistics (the vision encode is part of prefill and TTFT). ``on_prefill(done, total)``
        follows a long prompt's prefill chunk by chunk (see :meth:`start`). ``reference``: with replayed
        acceptance, the plain run's tokens on this prompt (the continuation drafts are replaced by)."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=(stop,) if isinstance(stop, str) else tuple(stop or ()), **extra)
        if self.replay is not None and reference is None:
            raise ValueError("replayed acceptance needs the plain run's tokens on this prompt (reference=...)")
        seq = self.acquire(prompt_ids, params, media)
        if reference is not None and self.replay is not None:
            seq.reference = self.replay.reference(reference, self.device)
        try:
            return self.run(seq, on_prefill)
        finally:
            self.release(seq)

    def run(self, seq: Sequence, on_prefill=None) -> GenerationResult:
        """Prefill and decode an acquired sequence (:meth:`acquire`) until it finishes, timed: what :meth:`generate`
        does between acquiring and releasing the slot."""
        dev = self.device
        _sync(dev)
        t0 = time.perf_counter()
        self.start(seq, on_prefill)
        _sync(dev)
        t1 = time.perf_counter()
        ev0, ev1 = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if dev.type == "cuda" else (None, None)
        if ev0:
            ev0.record()
        self.chain_used = chainable(self, seq) or spec_chain.chainable(self, seq)
        if self.chain_used:
            (spec_chain.decode_spec_chained if self.drafter is not None else decode_chained)(self, seq)
        while seq.finish_reason is None:
            self.advance([seq])
        if ev1:
            ev1.record()
        _sync(dev)
        t2 = time.perf_counter()
        device_ms = ev0.elapsed_time(ev1) if ev0 else (t2 - t1) * 1e3
        text = seq.text if seq.text is not None else self.stops.text(seq.tokens)
        return GenerationResult(tokens=list(seq.tokens), text=text, finish_reason=seq.finish_reason,
                                prompt_tokens=len(seq.prompt), prefill_s=t1 - t0, decode_s=t2 - t1,
                                ttft_s=t1 - t0, device_decode_ms=device_ms, spec=dict(seq.stats),
                                vision=dict(seq.media.stats) if seq.media is not None else {},
                                logprobs=list(seq.logprobs) if seq.params.keeps_logprobs else None)
