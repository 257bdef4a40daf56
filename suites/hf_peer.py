"""The transformers peer (``--engine hf``): the same weights, dequantized, through ``generate``.

This is what a Python user would otherwise run: ``Qwen3_5ForCausalLM`` in bf16 on CUDA (fp32 on CPU), eager
greedy ``generate``. TTFT is the time to its first new token and decode time the rest of the same call (the
anchors measure it the same way). torch's default dtype is back at fp32 once the model is built: the reference-GPU
anchors' transformers probe leaves it at bf16, which alone makes its 27B decode about a third slower on the
H200 (8.77 against 12.64 tok/s in one process; inference mode or not makes no difference at fp32:
docs/perf/2026-12-01d-norm-epilogue-peer-modes-h200.md).
"""

from __future__ import annotations

import time

import torch

from ..engine.artifact.loader import load_source
from ..engine.model.weights import text_weight_names
from ..engine.runtime.options import apply_cpu_threads
from ..engine.runtime.sequence import GenerationResult


def cpu_blocked() -> str | None:
    """Why transformers' Qwen3.5 cannot run on the CPU in this environment, None when it can: before 5.24 (the H200
    machine's 5.17), with fla-core importable its GDN layers hand CPU tensors to fla's Triton kernels, which fail
    ("Pointer argument cannot be accessed from Triton"); 5.24 falls back to its torch implementation there."""
    import importlib.util
    import re

    import transformers

    if importlib.util.find_spec("fla") is None:
        return None
    if tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2]) >= (5, 24):
        return None
    return (f"transformers {transformers.__version__} with fla-core installed runs fla's Triton kernels on CPU "
            f"tensors, which fails: run the peer with --device cuda, or on the CPU with transformers >= 5.24")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def transformers_model(loaded, device, dtype):
    """``Qwen3_5ForCausalLM`` (eval mode, ``dtype`` on ``device``) holding a loaded model's text weights, dequantized;
    torch's default dtype is restored once it is built."""
    import transformers

    cfg = loaded.config
    hf_cfg = transformers.Qwen3_5TextConfig(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.Qwen3_5ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(previous)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in text_weight_names(cfg, mtp=False):
            if name in params:
                params[name].copy_(loaded.raws[name].dense(torch.float32, device).reshape(params[name].shape))
    return model.eval()


class HFPeer:
    """A transformers model holding an artifact's (or preset's) weights, with the Engine's generate surface."""

    def __init__(self, model, loaded, device, dtype):
        self.model, self.loaded, self.device, self.dtype = model, loaded, device, dtype
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config

    @classmethod
    def load(cls, opts, loaded=None) -> "HFPeer":
        """The peer for a decode run's options; ``loaded``: the weights, when already loaded for ``opts``."""
        try:
            import transformers  # noqa: F401  (the clear error before any weight loads)
        except ImportError:
            raise ValueError("--engine hf needs transformers: pip install 'ninfer-bench[hf]'") from None
        device, dtype = opts.engine_options.torch_device, opts.engine_options.torch_dtype  # as our engine reads them
        if device.type == "cpu" and (why := cpu_blocked()):
            raise ValueError(f"--engine hf on the CPU: {why}")
        if loaded is None:
            loaded = load_source(opts.model, synthetic=opts.synthetic, quant=opts.quant, seed=opts.seed,
                                 device=device)
        if device.type == "cpu":
            apply_cpu_threads(loaded.config.hidden_size)  # the same thread rule as our engine, for a fair comparison
        return cls(transformers_model(loaded, device, dtype), loaded, device, dtype)

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads, counted as the Engine counts its own: every parameter, but of an
        untied input embedding one row (a step looks up one token; tied, the table is the lm_head and read whole)."""
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())  # (tied: counted once)
        embed = self.model.get_input_embeddings().weight
        if embed.data_ptr() != self.model.get_output_embeddings().weight.data_ptr():
            total -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
        return total

    @property
    def model_info(self) -> dict:
        """The artifact's info, plus what sets the peer's speed: transformers' GDN kernels (fla's when it imports,
        else its torch fallbacks: the anchors' 27B decode 7.62 against 5.67 tok/s) and how generate runs."""
        from ..kernels._triton import available

        default = str(torch.get_default_dtype()).replace("torch.", "")
        return {**self.loaded.info, "engine": "transformers", "dtype": str(self.dtype).replace("torch.", ""),
                "gdn_kernels": "fla" if available("fla") else "torch fallback",
                "generate": f"inference_mode, torch default dtype {default}"}

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int = 256, ignore_eos: bool = True, **_) -> GenerationResult:
        """One greedy ``generate``; a streamer stamps each new token as it arrives (transformers synchronises with
        the device every step to test its stopping criteria), so TTFT and decode come from the same call."""
        ids = torch.tensor([prompt_ids], device=self.device)
        eos = None if ignore_eos else list(self.tokenizer.eos_ids)
        stamps = _Stamps()
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens if ignore_eos
                                  else 0, do_sample=False, eos_token_id=eos, pad_token_id=0, streamer=stamps)
        _sync(self.device)
        end = time.perf_counter()
        tokens = out[0, len(prompt_ids):].tolist()
        if not stamps.times:
            raise RuntimeError("transformers generate produced no token")
        ttft = stamps.times[0] - t0
        decode = end - stamps.times[0]  # the tokens after the first, as our engine counts them
        return GenerationResult(tokens=tokens, text=self.tokenizer.decode(tokens),
                                finish_reason="length" if len(tokens) >= max_new_tokens else "stop",
                                prompt_tokens=len(prompt_ids), prefill_s=ttft, decode_s=decode, ttft_s=ttft,
                                device_decode_ms=decode * 1e3, spec={})


class _Stamps:
    """A transformers streamer that keeps the host time of each generated token (the first ``put`` is the
    prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
