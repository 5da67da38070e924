"""Device probe: where Block AttnRes's step-time overhead goes. The kernel tables (torch.profiler, self device time,
eager steps: the GPU time a CUDA graph replays) of the small preset with every piece on, once with the plain
residual and once with Block AttnRes, at bench system's shape, and their difference per kernel name, largest first.
Then the aten ops of the Block AttnRes step grouped by input shape (who launches the copies and adds), and the
LatentMoE layer alone (bench moe's shape) as its own table, for the MoE layer's ms outside the expert GEMMs.
Writes $OUT/diff_profile.json. On a CPU it runs at a toy shape (CPU ops instead of kernels) as a smoke test."""
import json, os, sys
import torch
from torch.profiler import ProfilerActivity, profile
from moe_book.bench.system import build_ours, every_piece, train_step, SHAPE, TOY_SHAPE

OUT = os.environ.get("OUT", "/tmp")
cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
shape = SHAPE if cuda else TOY_SHAPE
preset = "small" if cuda else "tiny"
acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
key = "self_device_time_total" if cuda else "self_cpu_time_total"
ac = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else (lambda: torch.autocast("cpu", enabled=False))


def sync():
    if cuda:
        torch.cuda.synchronize()


def table(fn, steps=2, warmup=3):
    for _ in range(warmup):
        fn()
    sync()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        sync()
    # Full kernel names as keys: cut to 160 characters, the grouped-GEMM variants (whose names differ only further
    # on) overwrote each other and the table lost most of their time.
    return {e.key: {"ms": getattr(e, key) / (1e3 * steps), "calls": e.count / steps} for e in prof.key_averages()
            if getattr(e, key) > 0}


res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shape": shape,
       "preset": preset, "tables": {}}
x = torch.randint(0, 1000, (shape["batch"], shape["seq"]), device=dev)
for residual in ("plain", "block_attnres"):
    model, opt, fwd, _ = build_ours(every_piece(preset, [f"model.residual={residual}"]), dev)
    res["tables"][residual] = table(lambda: train_step(model, opt, fwd, x, ac))
    tot = sum(r["ms"] for r in res["tables"][residual].values())
    print(f"{residual}: {tot:.1f} ms of {'GPU' if cuda else 'CPU'} time a step", flush=True)
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
a, b = res["tables"]["plain"], res["tables"]["block_attnres"]
diff = sorted(((n, b.get(n, {}).get("ms", 0.0) - a.get(n, {}).get("ms", 0.0),
                b.get(n, {}).get("calls", 0) - a.get(n, {}).get("calls", 0)) for n in set(a) | set(b)),
              key=lambda r: -abs(r[1]))
res["block_attnres_minus_plain"] = [{"name": n, "ms": ms, "calls": c} for n, ms, c in diff[:60]]
res["total_ms"] = {k: sum(r["ms"] for r in t.values()) for k, t in res["tables"].items()}
print(f"difference: {res['total_ms']['block_attnres'] - res['total_ms']['plain']:+.1f} ms a step", flush=True)
for r in res["block_attnres_minus_plain"][:40]:
    print(f"{r['ms']:+8.2f} ms {r['calls']:+6.0f}x  {r['name'][:120]}", flush=True)
# Which aten ops (and input shapes) launch the step's copies and adds: the Block AttnRes step once more, with the ops
# recorded on the host side and grouped by input shape, ranked by the device time under them.
model, opt, fwd, _ = build_ours(every_piece(preset), dev)
for _ in range(3):
    train_step(model, opt, fwd, x, ac)
sync()
with profile(activities=acts + ([ProfilerActivity.CPU] if cuda else []), record_shapes=True) as prof:
    train_step(model, opt, fwd, x, ac)
    sync()
ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
ops.sort(key=lambda e: -getattr(e, key))
res["ops_by_shape"] = [{"op": e.key, "shapes": str(e.input_shapes)[:200], "ms": getattr(e, key) / 1e3,
                        "calls": e.count} for e in ops[:60]]
print("aten ops by input shape (block_attnres step), device ms:", flush=True)
for r in res["ops_by_shape"][:30]:
    print(f"{r['ms']:8.2f} ms {r['calls']:5d}x  {r['op']:28s} {r['shapes'][:100]}", flush=True)
del model, opt
if cuda:
    torch.cuda.empty_cache()
for name in ("plain", "block_attnres"):            # keep the 80 largest rows of each table, not every kernel
    res["tables"][name] = dict(sorted(res["tables"][name].items(), key=lambda kv: -kv[1]["ms"])[:80])

# The LatentMoE layer alone at bench moe's shape: its kernels, fwd+bwd, with the quantile solve as in training.
from moe_book.layers.moe import LatentMoE
cfg = every_piece(preset).model
with torch.device(dev):
    moe = LatentMoE(cfg, layer=1)
moe.train()
N = 32768 if cuda else 256
xm = torch.randn(N, cfg.d_model, device=dev, requires_grad=True)
gm = torch.randn(N, cfg.d_model, device=dev)


def moe_step():
    with ac():
        y = moe(xm)
    y.backward(gm)
    moe.post_step()


t = table(moe_step, steps=5)
res["moe_layer"] = dict(sorted(t.items(), key=lambda kv: -kv[1]["ms"])[:60])
print(f"LatentMoE layer: {sum(r['ms'] for r in t.values()):.2f} ms fwd+bwd", flush=True)
for n, r in list(res["moe_layer"].items())[:30]:
    print(f"{r['ms']:8.3f} ms {r['calls']:5.0f}x  {n[:120]}", flush=True)
json.dump(res, open(os.path.join(OUT, "diff_profile.json"), "w"), indent=1)
