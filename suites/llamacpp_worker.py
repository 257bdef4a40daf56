"""llama.cpp in a process of its own, driven by :class:`.llamacpp_peer.LlamaCppPeer` over JSON lines.

A separate process because llama.cpp's CUDA libraries and torch's cannot share one: on the H200 machine, with torch
imported first the process segfaults when llama.cpp loads a model, and with llama.cpp first torch's import aborts.
This file imports no torch (nor anything of the package): the peer starts it by path with the same interpreter.

Requests, one JSON object a line on stdin; one reply a line (``{"error": ...}`` on failure):

* ``{"op": "load", "path", "n_ctx", "n_gpu_layers", "n_threads", "n_batch", "n_ubatch", "flash_attn"}`` ->
  ``n_vocab``, ``n_ctx``, ``version``, ``gpu_offload``, ``flash_attn``
* ``{"op": "generate", "ids", "max_new_tokens", "eos", "ignore_eos"}`` -> ``tokens``, ``prefill_s``, ``decode_s``
  (timed here: the prompt's decode and the first argmax, then one decode and argmax a token)
* ``{"op": "path_logits", "ids", "start", "out"}`` -> ``rows``: fp32 logits of positions ``start ..`` written to
  the ``.npy`` file ``out``
* ``{"op": "tokenize", "text"}`` -> ``ids`` (special tokens parsed, no BOS added)
* ``{"op": "close"}``

The protocol has the process's original stdout to itself; anything else printing to stdout (llama.cpp's C code
included) goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _open_protocol():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # fd 1 (C-level printf, Python's print) now writes to stderr
    sys.stdout = sys.stderr
    return proto


class Worker:
    def __init__(self):
        import llama_cpp
        import numpy as np

        self.llama_cpp, self.np = llama_cpp, np
        self.llm = None

    def load(self, path, n_ctx, n_gpu_layers, n_threads, n_batch=2048, n_ubatch=512, flash_attn=False):
        lc = self.llama_cpp
        if n_gpu_layers and not lc.llama_supports_gpu_offload():
            raise RuntimeError("this llama-cpp-python was built without GPU support (reinstall with "
                               "CMAKE_ARGS=\"-DGGML_CUDA=on\")")
        self.llm = lc.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                            n_gpu_layers=n_gpu_layers, n_threads=n_threads, n_threads_batch=n_threads,
                            flash_attn=bool(flash_attn), logits_all=False, verbose=False, seed=0)
        self.n_ubatch = n_ubatch
        self.n_vocab = self.llm.n_vocab()
        return {"n_vocab": self.n_vocab, "n_ctx": self.llm.n_ctx(), "version": lc.__version__,
                "gpu_offload": bool(n_gpu_layers), "flash_attn": bool(flash_attn)}

    def _last_argmax(self) -> int:
        ptr = self.llm._ctx.get_logits_ith(-1)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def generate(self, ids, max_new_tokens, eos=(), ignore_eos=True):
        llm, eos = self.llm, set(eos)
        if len(ids) + max_new_tokens > llm.n_ctx():
            raise ValueError(f"llama.cpp's context holds {llm.n_ctx()} tokens: {len(ids)} prompt + "
                             f"{max_new_tokens} new do not fit")
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(list(ids))
        tokens = [self._last_argmax()]
        t1 = time.perf_counter()
        while len(tokens) < max_new_tokens and (ignore_eos or tokens[-1] not in eos):
            llm.eval([tokens[-1]])
            tokens.append(self._last_argmax())
        end = time.perf_counter()
        return {"tokens": tokens, "prefill_s": t1 - t0, "decode_s": end - t1}

    def path_logits(self, ids, start, out):
        np, llm = self.np, self.llm
        llm.reset()
        rows = []
        step = self.n_ubatch  # a scored chunk's logits are len(chunk) x n_vocab floats on the host
        for i in range(0, len(ids), step):
            chunk = ids[i:i + step]
            scored = i + len(chunk) > start  # a chunk before the path needs no logits (a long prompt's would not fit)
            llm._batch.set_batch(batch=chunk, n_past=i, logits_all=scored)
            llm._ctx.decode(llm._batch)
            if scored:
                block = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(chunk), self.n_vocab))
                rows.append(block[max(start - i, 0):].copy())
        llm.reset()
        table = np.concatenate(rows)
        np.save(out, table)
        return {"rows": int(table.shape[0])}

    def tokenize(self, text):
        return {"ids": self.llm.tokenize(text.encode(), add_bos=False, special=True)}

    def close(self):
        if self.llm is not None:
            self.llm.close()
            self.llm = None


def main() -> int:
    proto = _open_protocol()
    try:
        worker = Worker()
    except ImportError as e:
        proto.write(json.dumps({"error": f"llama-cpp-python does not import: {e}"}) + "\n")
        return 1
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            if op == "close":
                worker.close()
                proto.write(json.dumps({"ok": True}) + "\n")
                return 0
            if op not in ("load", "generate", "path_logits", "tokenize"):
                raise ValueError(f"unknown op {op!r}")
            reply = getattr(worker, op)(**req)
        except Exception as e:  # noqa: BLE001  (every failure goes back to the peer as one line)
            reply = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
