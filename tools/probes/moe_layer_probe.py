"""Device probe: where the latent-MoE layer's 4.85 ms (H100, bench moe of 2026-12-07) goes. Kernel tables (device time,
full kernel names) of one fwd+bwd of the layer at bench moe's shapes under bf16 autocast, and of the router alone;
then the router's fp32 logits GEMM timed alone against candidate ways to get fp32-grade logits (TF32, a 3-pass bf16
split) with their error against an fp64 reference and how many top-8 picks each changes. Writes
$OUT/moe_layer_probe.json."""
import json, os
import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench
from moe_book.config import ModelConfig, MoEConfig
from moe_book.layers.moe import LatentMoE, _bf16_gemm_fp32_out, router_logits, row_topk, split_weight
from moe_book.bench.moe import SHAPES

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
T, d, L, E, k, h, ns = (SHAPES[n] for n in ("tokens", "d_model", "latent", "experts", "top_k", "hidden", "shared"))
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": SHAPES}
torch.manual_seed(0)
cfg = ModelConfig(d_model=d, n_layers=1, moe=MoEConfig(n_experts=E, top_k=k, d_expert=h, n_shared=ns, latent_dim=L,
                                                       act="situ", balancer="none"))
layer = LatentMoE(cfg, 0).to(dev)
with torch.no_grad():
    layer.router.proj.weight.normal_(0, 1.0 / d ** 0.5)
x = torch.randn(T, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
gy = torch.randn(T, d, device=dev, dtype=torch.bfloat16)


def layer_step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(gy)


def router_step():
    layer.router(x)[2].sum().backward()


def table(fn, reps=5):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    out = [{"name": e.key, "ms": e.self_device_time_total / reps / 1e3, "calls": e.count / reps} for e in rows[:40]]
    return {"total_ms": sum(e.self_device_time_total for e in rows) / reps / 1e3, "kernels": out}


for name, fn in (("layer", layer_step), ("router", router_step)):
    res[name] = table(fn)
    res[name]["wall_ms"] = do_bench(fn, warmup=25, rep=200, return_mode="median")
    print(f"{name}: wall {res[name]['wall_ms']:.3f} ms, kernels {res[name]['total_ms']:.3f} ms", flush=True)
    for r in res[name]["kernels"][:25]:
        print(f"  {r['ms']:7.3f} ms {r['calls']:4.0f}x  {r['name'][:150]}", flush=True)

# fp32-grade router logits: candidates, timed alone, error vs fp64 and top-8 picks changed vs fp64
w = layer.router.proj.weight.detach()
xb = x.detach()
ref = xb.double() @ w.double().T
ref_idx = torch.topk(ref, k, dim=-1).indices.sort(-1).values


def split3():
    hi, lo = split_weight(w).split(E)          # x is bf16 already, so its low part is zero: two passes suffice
    return (xb @ hi.T).float() + (xb @ lo.T).float()


def stacked():
    z = (xb @ split_weight(w).T).float()       # bf16 out: rounds each half
    return z[:, :E] + z[:, E:]


def tf32():
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return xb.float() @ w.T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


cands = {"fp32 SGEMM (the router until 2026-12-07)": lambda: torch.nn.functional.linear(xb.float(), w.float()),
         "tf32": tf32,
         "bf16 x, w = w_hi + w_lo (2 bf16 GEMMs)": split3,
         "stacked [w_hi; w_lo], one bf16 GEMM, bf16 out": stacked,
         "stacked [w_hi; w_lo], one bf16 GEMM, fp32 out (router_logits)": lambda: router_logits(xb, w),
         "bf16 (one GEMM, fp32 out)": lambda: (xb @ w.bfloat16().T).float()}
res["logits"] = {}
res["router_logits_takes_split_gemm"] = _bf16_gemm_fp32_out(dev)   # else it is the fp32 GEMM
for name, fn in cands.items():
    try:
        z = fn()
    except Exception as e:          # torch.mm's out_dtype is recent
        res["logits"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(f"logits {name}: {res['logits'][name]['error']}", flush=True)
        continue
    err = ((z.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    idx = torch.topk(z, k, dim=-1).indices.sort(-1).values
    changed = (idx != ref_idx).any(-1).float().mean().item()
    ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
    res["logits"][name] = {"ms": ms, "rms_rel_err_vs_fp64": err, "rows_with_changed_top8": changed}
    print(f"logits {name:42s} {ms:7.3f} ms  err {err:.2e}  rows changed {changed:.4f}", flush=True)
s = torch.sigmoid(ref.float())
res["topk_rows_ms"] = do_bench(lambda: row_topk(s, k), warmup=25, rep=200, return_mode="median")
res["torch_topk_ms"] = do_bench(lambda: torch.topk(s, k, dim=-1), warmup=25, rep=200, return_mode="median")
print(f"topk_rows {res['topk_rows_ms']:.3f} ms, torch.topk {res['torch_topk_ms']:.3f} ms", flush=True)
json.dump(res, open(f"{OUT}/moe_layer_probe.json", "w"), indent=1)
