"""Probe (GPU): kda_ut_solve_fwd alone at bench kda's first shape (B 8 x T 4096, H 16, K = V = 128, bf16) under
1, 2 and 4 warps, with its error against a float64 inverse, then the whole chunk_kda forward and forward+backward
at LAUNCH's setting. Writes $OUT/ut_solve.json. (The version at commit 706fb0b also timed a product-of-powers
inverse of the diagonal blocks; results/ut_solve.json is from that version.)"""
import json, os, torch, torch.nn.functional as F
from triton.testing import do_bench
import moe_book.kernels.kda_chunk as kc

B, T, H, K, V = 8, 4096, 16, 128, 128
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
q = F.normalize(torch.randn(B, T, H, K, device=dev, generator=g), dim=-1).to(dt).requires_grad_()
k = F.normalize(torch.randn(B, T, H, K, device=dev, generator=g), dim=-1).to(dt).requires_grad_()
v = torch.randn(B, T, H, V, device=dev, generator=g).to(dt).requires_grad_()
gate = (-5 * torch.sigmoid(torch.randn(B, T, H, K, device=dev, generator=g) - 2)).requires_grad_()
beta = torch.rand(B, T, H, device=dev, generator=g).requires_grad_()
ins = [q, k, v, gate, beta]
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": dict(B=B, T=T, H=H, K=K, V=V),
       "solve_alone": {}, "chunk_kda": {}}

with torch.no_grad():                                 # the solve's input, as the forward makes it
    _, _, (G, Aqk, Akk, Tm0, ch) = kc.kda_chunk_fwd(q, k, v, gate, beta, K ** -0.5, None, False, None, True)
NC, C = ch.n_chunks, kc.BT
Tm = torch.empty_like(Akk)
A64 = Akk.view(B * T // C, C, H, C)[:64].double().permute(0, 2, 1, 3)       # float64 reference on 64 chunks
b64 = beta.detach().view(B * T // C, C, H)[:64].double().permute(0, 2, 1)[..., None]
ref = torch.linalg.inv(torch.eye(C, device=dev, dtype=torch.float64) + b64 * A64)


def solve(warps, stages):
    kc.kda_ut_solve_fwd[(NC, H)](Akk, beta, Tm, None, None, T, H=H, BT=kc.BT, BC=kc.BC, IS_VARLEN=False,
                                 PREC="tf32", num_warps=warps, num_stages=stages)


for warps in (1, 2, 4):
    for stages in (1, 2):
        solve(warps, stages)
        got = Tm.view(B * T // C, C, H, C)[:64].double().permute(0, 2, 1, 3)
        err = ((got - ref).norm() / ref.norm()).item()
        ms = do_bench(lambda: solve(warps, stages), warmup=10, rep=100)
        res["solve_alone"][f"w{warps}_s{stages}"] = {"ms": ms, "rel_err_vs_float64": err}
        print(f"solve w{warps} s{stages}: {ms:.4f} ms, rel err {err:.2e}", flush=True)

do = torch.randn(B, T, H, V, device=dev, generator=g).to(dt)
run = lambda: kc.chunk_kda(q, k, v, gate, beta, g_lower_bound=-5.0)[0]
with torch.no_grad():
    f = do_bench(run, warmup=10, rep=100)
fb = do_bench(lambda: run().backward(do), warmup=10, rep=100, grad_to_none=ins)
res["chunk_kda"] = {"launch": dict(kc.LAUNCH["kda_ut_solve_fwd"]), "fwd_ms": f, "fwd_bwd_ms": fb}
print(f"chunk_kda: fwd {f:.3f} ms, fwd+bwd {fb:.3f} ms", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "ut_solve.json"), "w"), indent=1)
