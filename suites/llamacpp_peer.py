"""The llama.cpp peer (``--engine llamacpp``): the same weights exported to GGUF (``export-gguf``, exact), run by
llama.cpp through ``llama-cpp-python`` in a worker process (:mod:`.llamacpp_worker`: its CUDA libraries and torch's
cannot share one), greedy, on the same prompt tokens.

Generation is llama.cpp's own decode per token with a host argmax over its last logits row (what its greedy
sampler does; ties go to the lowest id, as ours): TTFT is the prompt's decode plus the first argmax, decode time the
rest. :func:`agreement` sets llama.cpp against our engine on ours' greedy path: the tokens to the first divergence of
the two greedy runs, and teacher-forced (every position of ours' path fed to both) llama.cpp's top-1 against ours'
token and KL(ours || llama.cpp). llama.cpp quantizes activations to 8 bits for its quantized matrix products on a
CPU, so small differences are expected; they are reported, not hidden.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..engine.artifact.gguf_export import export_gguf, same_weights
from ..engine.artifact.loader import load_source
from ..engine.runtime.options import apply_cpu_threads
from ..engine.runtime.sequence import GenerationResult

AGREE_PREFIX = 64  # the tokens two greedy runs should share (the bar: >= 64 on most prompts)


def require_llama_cpp() -> None:
    """The clear error where llama-cpp-python is not installed, found without importing it: an import loads
    llama.cpp's libraries (its CUDA ones too) into this process, which is what the worker process is for."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise ValueError("--engine llamacpp needs llama-cpp-python: pip install 'ninfer-bench[peers]' (built from "
                         "source; CMAKE_ARGS=\"-DGGML_CUDA=on\" for a CUDA build)")


WORKER = Path(__file__).with_name("llamacpp_worker.py")


class Worker:
    """:mod:`.llamacpp_worker` in a process of its own (llama.cpp's CUDA libraries and torch's cannot share one),
    one JSON line each way a request; its stderr (llama.cpp's log) kept in a temporary file for errors."""

    def __init__(self, workdir: Path):
        self.log = open(workdir / "llamacpp.log", "w+b")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True, bufsize=1)

    def call(self, op: str, **kw) -> dict:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the llama.cpp worker has exited (status {self.proc.returncode}){self._tail()}")
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"the llama.cpp worker died during {op} (status {self.proc.returncode}){self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp {op}: {reply['error']}")
        return reply

    def _tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        lines = [x for x in self.log.read().decode(errors="replace").splitlines() if x.strip()]
        return f": {lines[-1][:300]}" if lines else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close")
                self.proc.wait(timeout=30)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


class LlamaCppPeer:
    """llama.cpp holding a GGUF export of a loaded model (in a worker process), with the Engine's generate
    surface."""

    def __init__(self, worker: Worker, info: dict, loaded, gguf_path: Path, device: torch.device, workdir,
                 export_s: float, threads: int | None, given: bool):
        self.worker, self.info, self.loaded, self.gguf_path, self.device = worker, info, loaded, gguf_path, device
        self.tokenizer, self.config = loaded.tokenizer, loaded.config
        self.dtype = "gguf"
        self.recorded = {"runtime": "llama.cpp", "kv_dtype": "f16"}  # its own runtime, its default K/V cache type
        self._workdir, self.export_s, self.threads = workdir, export_s, threads
        self.given = given  # --llamacpp-gguf: an earlier export, checked (not written by this run)
        self.n_vocab = info["n_vocab"]

    @classmethod
    def load(cls, opts, loaded=None, n_ctx: int | None = None) -> "LlamaCppPeer":
        """The peer for a decode run's options: the weights exported to a temporary GGUF file, loaded with every
        layer on the GPU when the run's device is CUDA (a llama.cpp built with CUDA), else on the CPU with our
        engine's thread count."""
        require_llama_cpp()  # before any export
        device = opts.engine_options.torch_device
        if loaded is None:
            loaded = load_source(opts.model, synthetic=opts.synthetic, quant=opts.quant, seed=opts.seed,
                                 device=device)
        workdir = tempfile.TemporaryDirectory(prefix="ninfer-gguf-")
        t0 = time.perf_counter()
        if opts.llamacpp_gguf:  # an export made before (export-gguf): checked to hold these weights
            path = Path(opts.llamacpp_gguf)
            if why := same_weights(loaded, path):
                workdir.cleanup()
                raise ValueError(f"--llamacpp-gguf {why}")
        else:
            path = Path(workdir.name) / "model.gguf"
            export_gguf(loaded, path)
        export_s = time.perf_counter() - t0
        threads = None
        if device.type == "cpu":
            apply_cpu_threads(loaded.config.hidden_size)
            threads = torch.get_num_threads()
        ctx = n_ctx or min(loaded.config.max_position_embeddings, opts.engine_options.max_context or 8192)
        flash = opts.llamacpp_flash_attn if opts.llamacpp_flash_attn is not None else device.type == "cuda"
        worker = Worker(Path(workdir.name))
        try:  # llama-bench's batch sizes (2048 tokens a call, 512 a micro-batch)
            info = worker.call("load", path=str(path), n_ctx=ctx, n_gpu_layers=-1 if device.type == "cuda" else 0,
                               n_threads=threads or os.cpu_count() or 1, n_batch=2048, n_ubatch=512,
                               flash_attn=flash)
        except BaseException:
            worker.close()
            workdir.cleanup()
            raise
        return cls(worker, info, loaded, path, device, workdir, export_s, threads, bool(opts.llamacpp_gguf))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self._workdir.cleanup()

    @property
    def weight_bytes_per_step(self) -> int:
        """The GGUF file's tensor bytes a step reads: all of them but the embedding table's other rows (as the
        Engine counts its own)."""
        import gguf

        reader = gguf.GGUFReader(str(self.gguf_path))
        total, embed = 0, 0
        for t in reader.tensors:
            total += int(t.n_bytes)
            if t.name == "token_embd.weight":
                embed = int(t.n_bytes)
        tied = not any(t.name == "output.weight" for t in reader.tensors)
        return total if tied else total - embed + embed // max(self.config.vocab_size, 1)

    @property
    def model_info(self) -> dict:
        return {**self.loaded.info, "engine": "llama.cpp", "llama_cpp_python": self.info["version"],
                "gguf_bytes": self.gguf_path.stat().st_size,
                "gguf_check_s" if self.given else "gguf_export_s": round(self.export_s, 3),
                "gpu_offload": self.info["gpu_offload"], "flash_attn": self.info["flash_attn"],
                "n_ctx": self.info["n_ctx"], "threads": self.threads}

    def generate(self, prompt_ids, max_new_tokens: int = 256, ignore_eos: bool = True, **_) -> GenerationResult:
        """One greedy generation of ``max_new_tokens`` (or to an end token unless ``ignore_eos``), timed in the
        worker."""
        r = self.worker.call("generate", ids=[int(i) for i in prompt_ids], max_new_tokens=int(max_new_tokens),
                             eos=[int(i) for i in self.tokenizer.eos_ids], ignore_eos=bool(ignore_eos))
        tokens = r["tokens"]
        finish = "length" if len(tokens) >= max_new_tokens else "stop"
        return GenerationResult(tokens=tokens, text=self.tokenizer.decode(tokens), finish_reason=finish,
                                prompt_tokens=len(prompt_ids), prefill_s=r["prefill_s"], decode_s=r["decode_s"],
                                ttft_s=r["prefill_s"], device_decode_ms=r["decode_s"] * 1e3, spec={})

    def path_logits(self, ids: list[int], start: int) -> np.ndarray:
        """llama.cpp's fp32 logits rows for positions ``start .. len(ids) - 1`` of one prefill of ``ids`` (each row
        predicts the token after its position): ``[len(ids) - start, V]``."""
        out = Path(self._workdir.name) / "path_logits.npy"
        self.worker.call("path_logits", ids=[int(i) for i in ids], start=int(start), out=str(out))
        try:
            return np.load(out)
        finally:
            out.unlink(missing_ok=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def agreement(peer: LlamaCppPeer, ours_logits, prompts: list[list[int]], ours: list[list[int]],
              theirs: list[list[int]], reference: str) -> dict:
    """llama.cpp against our engine on ours' greedy path, per prompt and over all: ``prefix_tokens`` (leading
    generated tokens the two greedy runs share), ``top1_agreement`` (teacher-forced on ours' path: llama.cpp's most
    likely token is ours' next token) and KL(ours || llama.cpp) in nats, mean and max over positions.
    ``ours_logits(ids, start)`` gives our engine's fp32 logits of positions ``start ..`` of ``ids``
    (:meth:`Engine.path_logits`); ``reference`` names ours' run."""
    per, agree, total, kls = [], 0, 0, []
    for prompt, mine, other in zip(prompts, ours, theirs):
        shared = next((i for i, (a, b) in enumerate(zip(mine, other)) if a != b), min(len(mine), len(other)))
        path = list(prompt) + list(mine[:-1])  # every position that predicts one of ours' tokens
        start = len(prompt) - 1
        lp_theirs = _log_softmax(peer.path_logits(path, start))
        lp_ours = _log_softmax(np.asarray(ours_logits(path, start), dtype=np.float32))
        top = lp_theirs.argmax(axis=-1)
        hits = int((top == np.asarray(mine)).sum())
        kl = (np.exp(lp_ours) * (lp_ours - lp_theirs)).sum(axis=-1)
        per.append({"prefix_tokens": shared, "tokens": len(mine), "top1_agreement": hits / len(mine),
                    "kl_mean": float(kl.mean()), "kl_max": float(kl.max())})
        agree += hits
        total += len(mine)
        kls.append(kl)
    kl_all = np.concatenate(kls) if kls else np.zeros(0)
    bar = min(AGREE_PREFIX, min((len(m) for m in ours), default=0))
    return {"reference": reference, "prompts": len(per),
            "prompts_equal_to_bar": sum(p["prefix_tokens"] >= bar for p in per), "bar_tokens": bar,
            "prefix_tokens_min": min((p["prefix_tokens"] for p in per), default=None),
            "top1_agreement": agree / total if total else None,
            "kl_mean": float(kl_all.mean()) if kl_all.size else None,
            "kl_max": float(kl_all.max()) if kl_all.size else None,
            "per_prompt": per}

