"""Device probe (2026-12-04, results/step_cuda_graph.json): is the small-preset training step GPU-bound or launch-bound? GPU busy time (union of kernel
intervals) vs wall time of a profiled step, and the top CPU ops by self CPU time."""
import json, os, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from moe_book.bench.system import build_ours, every_piece, train_step, measure

dev = torch.device("cuda")
ov = sys.argv[1:]
x = torch.randint(0, 32768, (8, 4096), device=dev)
# eager, as when the numbers in results/step_cuda_graph.json were taken (build_ours now also returns the graphed step)
model, opt, fwd, _ = build_ours(every_piece("small", ov + ["train.cuda_graph=off"]), dev)
ac = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
r = measure(model, opt, fwd, x, dev, warmup=3, steps=10, log=lambda *a: None)
print("measure", ov, r, flush=True)
# CPU issue time of one step when the GPU queue is empty at the start: time until train_step returns
torch.cuda.synchronize()
t0 = time.perf_counter(); train_step(model, opt, fwd, x, ac); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"one step: python returns after {1e3*(t1-t0):.1f} ms, GPU done after {1e3*(t2-t0):.1f} ms", flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        train_step(model, opt, fwd, x, ac)
    torch.cuda.synchronize()
iv = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
busy, cur_s, cur_e = 0, None, None
for s, e in iv:
    if cur_e is None or s > cur_e:
        if cur_e is not None: busy += cur_e - cur_s
        cur_s, cur_e = s, e
    else:
        cur_e = max(cur_e, e)
busy += cur_e - cur_s
span = iv[-1][1] - iv[0][0]
print(f"2 profiled steps: GPU span {span/1e3:.1f} ms, busy {busy/1e3:.1f} ms ({busy/span:.0%})")
# gaps: where the GPU idles > 50 us, and the CPU ops running then
gaps = []
cur_e = iv[0][1]
for s, e in iv[1:]:
    if s - cur_e > 50: gaps.append((cur_e, s))
    cur_e = max(cur_e, e)
print(f"idle gaps > 50us: {len(gaps)}, total {sum(b-a for a,b in gaps)/1e3:.1f} ms")
ka = prof.key_averages()
print(ka.table(sort_by="self_cpu_time_total", row_limit=25))
