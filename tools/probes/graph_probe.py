"""Device probe (2026-12-04, results/step_cuda_graph.json): whole-step CUDA graph (fwd+bwd+clip+AdamW) of the small
preset vs eager, same weights. Written before moe_book.train.GraphedStep: it bumps the MoE layers' Python counters
by hand after each replay, which host_effect now does."""
import copy, json, os, sys, time
import torch
from moe_book.bench.system import build_ours, every_piece, train_step, measure
from moe_book.layers.moe import LatentMoE

dev = torch.device("cuda")
x = torch.randint(0, 32768, (8, 4096), device=dev)
ac = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
# eager, as when the numbers in results/step_cuda_graph.json were taken (build_ours now also returns the graphed step)
model, opt, fwd, _ = build_ours(every_piece("small", ["train.cuda_graph=off"]), dev)
moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
r = measure(model, opt, fwd, x, dev, warmup=3, steps=10, log=lambda *a: None)
print("eager", r, flush=True)
del opt
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=torch.tensor(1e-4, device=dev), fused=True, capturable=True)

def body():
    with ac():
        loss = fwd(x)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss.detach(), gn

s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        body(); model.post_step()
torch.cuda.current_stream().wait_stream(s)
opt.zero_grad(set_to_none=True)
g = torch.cuda.CUDAGraph()
t0 = time.perf_counter()
try:
    with torch.cuda.graph(g):
        sl, sg = body()
except Exception as e:
    import traceback; traceback.print_exc(); sys.exit(1)
print(f"captured in {time.perf_counter()-t0:.1f} s", flush=True)
def step():
    g.replay()
    for m in moes:
        m._forwards = 1; m.balancer._n_obs = 1
    model.post_step()
for _ in range(3): step()
torch.cuda.synchronize()
losses = []
t0 = time.perf_counter()
for _ in range(10):
    step()
torch.cuda.synchronize()
ms = (time.perf_counter() - t0) / 10 * 1e3
print(f"graphed: {ms:.1f} ms/step, {x.numel()/ms*1e3:.0f} tok/s, loss {sl.item():.4f} gn {sg.item():.3f}, peak {torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)
