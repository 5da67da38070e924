"""Device probe: kernel table of today's eager step (GPU time is what the graph replays), router precision and
quantile sweep parts timed alone."""
import json, os, time
import torch, triton
from moe_book.bench.system import build_ours, every_piece, train_step
from moe_book.layers.moe import quantile_margins, quantile_sweep
OUT = os.environ.get("OUT", "/tmp")   # writes profile_probe.json there; committed as results/step_kernels.json
dev = torch.device("cuda")
res = {}
x = torch.randint(0, 32768, (8, 4096), device=dev)
ac = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
model, opt, fwd, _ = build_ours(every_piece("small"), dev)   # timed eagerly below: GPU time is what a graph replays
for _ in range(3):
    train_step(model, opt, fwd, x, ac)
torch.cuda.synchronize()
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        train_step(model, opt, fwd, x, ac)
    torch.cuda.synchronize()
ka = prof.key_averages()
key = "self_device_time_total"
rows = sorted(ka, key=lambda e: getattr(e, key), reverse=True)
tot = sum(getattr(e, key) for e in ka)
res["total_gpu_ms_per_step"] = tot / 2e3
res["kernels"] = [{"name": e.key[:160], "ms": getattr(e, key) / 2e3, "calls": e.count / 2} for e in rows[:80]]
print(f"total GPU {tot/2e3:.1f} ms/step", flush=True)
for r in res["kernels"][:60]:
    print(f"{r['ms']:8.2f} ms {r['calls']:6.0f}x  {r['name'][:130]}", flush=True)
del model, opt
torch.cuda.empty_cache()

# router GEMM precision: fp32 vs tf32, fwd+bwd at the small preset's shape
N, d, E, k = 32768, 1024, 128, 8
xr = torch.randn(N, d, device=dev).bfloat16().float().requires_grad_()
w = (torch.randn(E, d, device=dev) * 0.02).requires_grad_()
def router():
    s = torch.sigmoid(torch.nn.functional.linear(xr, w))
    s.backward(torch.ones_like(s))
for prec in ("ieee", "tf32"):
    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    res[f"router_fwd_bwd_ms_{prec}"] = triton.testing.do_bench(router, grad_to_none=[xr, w])
    print(prec, res[f"router_fwd_bwd_ms_{prec}"], flush=True)
torch.backends.cuda.matmul.allow_tf32 = False
with torch.no_grad():
    s32 = torch.nn.functional.linear(xr, w)
    torch.backends.cuda.matmul.allow_tf32 = True
    s_tf = torch.nn.functional.linear(xr, w)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = torch.nn.functional.linear(xr.double(), w.double())
    res["router_logit_err_fp32"] = (s32.double() - ref).abs().max().item()
    res["router_logit_err_tf32"] = (s_tf.double() - ref).abs().max().item()
    res["router_logit_scale"] = ref.abs().max().item()
print({k: v for k, v in res.items() if k.startswith("router")}, flush=True)

# the quantile sweep's parts
scores = torch.sigmoid(torch.randn(N, E, device=dev))
bias = torch.zeros(E, device=dev)
margin = quantile_margins(scores, bias, k)
share = N * k // E
res["sweep_ms"] = triton.testing.do_bench(lambda: quantile_sweep(scores, bias, k))
res["margins_ms"] = triton.testing.do_bench(lambda: quantile_margins(scores, bias, k))
res["topk_edge_ms"] = triton.testing.do_bench(lambda: torch.topk(margin, share + 1, dim=-1, sorted=False))
edge = torch.topk(margin, share + 1, dim=-1, sorted=False).values
res["topk2_ms"] = triton.testing.do_bench(lambda: torch.topk(edge, 2, dim=-1, largest=False))
res["kthvalue_ms"] = triton.testing.do_bench(lambda: torch.kthvalue(margin, N - share, dim=-1))
print({k: v for k, v in res.items() if k.endswith("_ms")}, flush=True)
json.dump(res, open(os.path.join(OUT, "profile_probe.json"), "w"), indent=1)
