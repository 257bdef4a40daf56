"""In-process A/B of the CPU prefill attention paths on the bundled model: 'mask' (every chunk masked, before
d43cd78), 'first' (the first chunk through is_causal, d43cd78), 'split' (also the later chunks as past + own block);
alternating, at 2,048 / 4,096 / 8,192 tokens (2,048-token chunks), the first token checked equal across modes."""
import statistics, sys, time
import torch
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.artifact.loader import default_model
from ninfer_bench.engine.sampling import SamplingParams
from ninfer_bench.kernels import attention as ak

eng = Engine.load(default_model(), device="cpu", max_context=16384)
print("torch", torch.__version__, "threads", torch.get_num_threads())
ids = (list(range(5, 8000)) * 3)
real_zero, real_end = ak.starts_at_zero, ak.ends_at_length
never = lambda q_pos, length: False
def mode(m):
    ak.starts_at_zero = never if m == "mask" else real_zero
    ak.ends_at_length = real_end if m == "split" else never
def run(n):
    seq = eng.acquire(ids[:n], SamplingParams(max_new_tokens=2)); t = time.perf_counter(); eng.start(seq)
    dt = time.perf_counter() - t; first = seq.tokens[-1] if seq.tokens else None; eng.release(seq); return dt, first
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
res, firsts = {}, {}
for n in (2048, 4096, 8192):
    mode("split"); run(n)
    for rep in range(reps):
        for m in ("mask", "first", "split"):
            mode(m); dt, f = run(n); res.setdefault((n, m), []).append(dt); firsts.setdefault((n, m), set()).add(f)
mode("split")
for (n, m), v in sorted(res.items()):
    print(f"{n:5d} {m:6s} median {statistics.median(v)*1e3:8.1f} ms {n/statistics.median(v):8.1f} tok/s "
          f"{[round(x*1e3, 1) for x in v]} first token {sorted(firsts[(n, m)])}")
for n in (2048, 4096, 8192):
    base = statistics.median(res[(n, 'mask')])
    print(n, " ".join(f"{m}/mask {statistics.median(res[(n, m)]) / base:.3f}" for m in ("first", "split")))
