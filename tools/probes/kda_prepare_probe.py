"""Probe (GPU): the KDA layer's pointwise prepare (short convolutions, SiLU, L2 norms, gates), forward and
forward+backward at the small preset's shape (B 8 x T 4096, 8 heads x 128), as chapter 01 writes it (kda_prepare:
q, k, v convolved one at a time) against the earlier form over their concatenation, and the Triton short
convolutions (model.kda.prepare=triton). Writes $OUT/kda_prepare.json."""
import json, os, sys, torch, torch.nn.functional as F
from triton.testing import do_bench
from moe_book.layers.kda import kda_gates, kda_prepare, kda_prepare_triton, kda_gate, _fp

B, T, H, K, W = 8, 4096, 8, 128, 4
C = H * K
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device=dev, generator=g).to(dt)
q, k, v, gl = (mk(B, T, C).requires_grad_() for _ in range(4))
bl = mk(B, T, H).requires_grad_()
conv_w = (0.3 * mk(3 * C, 1, W, dt=torch.float32)).requires_grad_()
gate_bias = mk(C, dt=torch.float32).requires_grad_()
past = torch.zeros(B, W - 1, 3 * C, device=dev, dtype=torch.bfloat16)
ins = [q, k, v, conv_w, gl, gate_bias, bl]


def concatenated(past, q, k, v, conv_w, gate_logits, gate_bias, beta_logits, g_min, A_log, n_heads):
    "kda_prepare as it was until 2026-12-04: one convolution over the fp32 concatenation of q, k and v"
    fp = _fp(q)
    B, T, C = q.shape
    W = conv_w.shape[-1]
    seq = torch.cat([past.to(fp), torch.cat([q, k, v], -1).to(fp)], 1)
    w = conv_w.reshape(3 * C, W).to(fp)
    y = sum(seq[:, j:j + T] * w[:, j] for j in range(W))
    qc, kc, vc = F.silu(y).view(B, T, 3, n_heads, C // n_heads).unbind(2)
    logits = gate_logits.view(B, T, n_heads, -1).to(fp) + gate_bias.view(n_heads, -1).to(fp)
    return (F.normalize(qc, dim=-1, eps=1e-6).to(q.dtype), F.normalize(kc, dim=-1, eps=1e-6).to(q.dtype),
            vc.to(q.dtype), kda_gate(logits, g_min, A_log), torch.sigmoid(beta_logits.to(fp)))


fns = {"concatenated": torch.compile(concatenated), "kda_prepare": kda_prepare,   # the latter compiled by `fused`
       # the layer with model.kda.prepare=triton, in training: no left context to read
       "triton_short_conv": lambda past, *args: kda_prepare_triton(None, *args)}
grads = None
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": dict(B=B, T=T, H=H, K=K, W=W), "ms": {}}
ref = None


def measure(name, fn):
    global grads, ref
    run = lambda: fn(past, q, k, v, conv_w, gl, gate_bias, bl, -5.0, None, H)
    out = run()
    if grads is None:
        grads = [torch.randn_like(o) for o in out]

    def fb():
        torch.autograd.backward(run(), grads)
    for x in ins:
        x.grad = None
    fb()
    gr = [x.grad.float().clone() for x in ins]
    if ref is None:
        ref = ([o.float() for o in out], gr)
    err = max([((a.float() - b).norm() / b.norm()).item() for a, b in zip(out, ref[0])] +
              [((a - b).norm() / b.norm()).item() for a, b in zip(gr, ref[1])])
    with torch.no_grad():
        f_ms = do_bench(run, warmup=5, rep=50)
    fb_ms = do_bench(fb, warmup=5, rep=50, grad_to_none=ins)
    res["ms"][name] = {"fwd_ms": f_ms, "fwd_bwd_ms": fb_ms, "max_rel_err_vs_concatenated": err}
    print(f"{name:>24}: fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms, max rel err vs concatenated {err:.2e}", flush=True)


for name, fn in fns.items():
    measure(name, fn)

# Where the Triton path's backward goes: the gates alone, and the kernel's launch shapes (rows per program, warps).
ggrads = [torch.randn(B, T, H, K, device=dev), torch.randn(B, T, H, device=dev)]
gins = [gl, gate_bias, bl]
gates = lambda: kda_gates(gl, gate_bias, bl, -5.0, None, H)
with torch.no_grad():
    g_f = do_bench(gates, warmup=5, rep=50)
g_fb = do_bench(lambda: torch.autograd.backward(gates(), ggrads), warmup=5, rep=50, grad_to_none=gins)
res["ms"]["kda_gates_alone"] = {"fwd_ms": g_f, "fwd_bwd_ms": g_fb}
print(f"{'kda_gates alone':>24}: fwd {g_f:.3f} ms, fwd+bwd {g_fb:.3f} ms", flush=True)
import moe_book.kernels.short_conv as sc
default = dict(sc.LAUNCH)
for rows in (8, 16, 32):
    for warps in (2, 4, 8):
        sc.LAUNCH = {"fwd": default["fwd"], "bwd": (rows, warps)}
        measure(f"triton_bwd_rows{rows}_warps{warps}", fns["triton_short_conv"])
sc.LAUNCH = default
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "kda_prepare.json"), "w"), indent=1)
