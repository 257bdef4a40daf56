"""Profile one 2,048-token prefill of the bundled model on the CPU with the first-chunk causal path off (the mask,
as before d43cd78) and on; then alternate both 5 times at 512 and 2,048 tokens in this one process."""
import statistics, time
import torch
from torch.profiler import profile, ProfilerActivity
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.artifact.loader import default_model
from ninfer_bench.engine.sampling import SamplingParams
from ninfer_bench.kernels import attention as ak

eng = Engine.load(default_model(), device="cpu", max_context=4096)
print("torch", torch.__version__, "threads", torch.get_num_threads())
ids = list(range(5, 8000))
real = ak.starts_at_zero
def mode(m): ak.starts_at_zero = real if m == "causal" else (lambda q_pos, length: False)
def run(n):
    seq = eng.acquire(ids[:n], SamplingParams(max_new_tokens=2)); t = time.perf_counter(); eng.start(seq)
    dt = time.perf_counter() - t; eng.release(seq); return dt
run(2048)
for m in ("mask", "causal"):
    mode(m)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        run(2048)
    print(f"== profile, {m}: one 2,048-token prefill")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
res = {}
for n in (512, 2048):
    run(n)
    for rep in range(5):
        for m in ("mask", "causal"):
            mode(m); res.setdefault((n, m), []).append(run(n))
mode("causal")
print("== A/B, alternating, 5 repeats each")
for (n, m), v in sorted(res.items()):
    print(f"{n:5d} {m:7s} median {statistics.median(v)*1e3:8.1f} ms {n/statistics.median(v):8.1f} tok/s "
          f"{[round(x*1e3, 1) for x in v]}")
for n in (512, 2048):
    print(n, "causal / mask time", round(statistics.median(res[(n, 'causal')]) / statistics.median(res[(n, 'mask')]), 3))
