"""Where one training step of the small preset spends its time (GPU diagnostic, not part of the package).

Times each kind of sublayer alone, forward and forward+backward, at the system bench's shape (B=8, T=4096, bf16
autocast, fp32 master weights), then the whole step, and a profiler table of the whole step grouped by input
shape. Prints a table and writes JSON (--out). Usage: python tools/step_breakdown.py [--out F] [overrides...]"""
import argparse
import json
import time

import torch

from moe_book.bench.system import build_ours, every_piece, train_step


def bench_ms(fn, warmup=2, iters=5):
    if not torch.cuda.is_available():      # a CPU smoke run of this script: wall clock
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def fwd_bwd(module, x, grad=None):
    dev, cuda = x.device, x.is_cuda
    def fwd():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            return module(x)

    def both():
        y = fwd()
        y.backward(grad if grad is not None else torch.ones_like(y))
    with torch.no_grad():
        f = bench_ms(fwd)
    return {"fwd_ms": f, "fwd_bwd_ms": bench_ms(both)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="breakdown.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    B, T = a.batch, a.seq
    cuda = torch.cuda.is_available()
    cfg = every_piece("small" if cuda else "tiny", [f"train.seq_len={T}", f"train.batch_size={B}"] + a.overrides)
    dev = torch.device("cuda" if cuda else "cpu")
    model, opt, forward = build_ours(cfg, dev)
    d = cfg.model.d_model
    x = torch.randn(B, T, d, device=dev, requires_grad=True)
    rows = {}
    kinds = {}
    for i, blk in enumerate(model.layers):
        kinds.setdefault(f"mixer:{blk.mixer_type}", (i, blk.mixer))
        kinds.setdefault(f"ffn:{blk.ffn_type}{'(first)' if i < cfg.model.first_dense else ''}", (i, blk.ffn))
    kinds["norm"] = (0, model.layers[0].mixer_norm)
    counts = {}
    for i, blk in enumerate(model.layers):
        counts[f"mixer:{blk.mixer_type}"] = counts.get(f"mixer:{blk.mixer_type}", 0) + 1
        k = f"ffn:{blk.ffn_type}{'(first)' if i < cfg.model.first_dense else ''}"
        counts[k] = counts.get(k, 0) + 1
    counts["norm"] = 2 * cfg.model.n_layers + 1
    for name, (i, mod) in kinds.items():
        try:
            rows[name] = {**fwd_bwd(mod, x), "count": counts[name]}
            model.zero_grad(set_to_none=True)
            x.grad = None
        except Exception as e:
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, rows[name], flush=True)
    # MoE without the in-forward quantile solve, and the solve alone
    moe = next((blk.ffn for blk in model.layers if blk.ffn_type == "moe"), None)
    if moe is not None:
        from moe_book.layers.moe import quantile_bias, Balancer
        bal = moe.balancer
        moe.balancer = Balancer(cfg.model.moe)
        rows["ffn:moe(balancer none)"] = fwd_bwd(moe, x)
        moe.balancer = bal
        xs = torch.randn(B * T, d, device=dev)
        scores = moe.router.score(xs)
        rows["quantile_bias(8 sweeps)"] = {"fwd_ms": bench_ms(lambda: quantile_bias(scores, moe.router.bias, moe.top_k, 8))}
        rows["router topk"] = {"fwd_ms": bench_ms(lambda: torch.topk(scores, moe.top_k + 1, dim=-1))}
        rows["router sort"] = {"fwd_ms": bench_ms(lambda: torch.sort(scores, dim=-1, descending=True))}
        print({k: rows[k] for k in rows if "moe" in k or "router" in k or "quantile" in k}, flush=True)
    # LM head + loss
    h = torch.randn(B, T, d, device=dev, requires_grad=True)
    tgt = torch.randint(0, cfg.model.vocab_size, (B, T), device=dev)

    def head():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model.lm_head(model.norm(h))
            return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))
    rows["head+loss"] = {"fwd_bwd_ms": bench_ms(lambda: head().backward()), "count": 1}
    model.zero_grad(set_to_none=True)
    # residual: whole-model forward+backward with this residual vs plain is left to `bench attnres`.
    idx = torch.randint(0, cfg.model.vocab_size, (B, T), device=dev)
    autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda)
    step = bench_ms(lambda: train_step(model, opt, forward, idx, autocast), warmup=2, iters=3)
    for p_ in model.parameters():
        p_.grad = torch.zeros_like(p_)

    def optim():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    rows["clip+adamw"] = {"fwd_bwd_ms": bench_ms(optim), "count": 1}
    opt.zero_grad(set_to_none=True)
    accounted = sum(r.get("fwd_bwd_ms", 0) * r.get("count", 0) for r in rows.values())
    print(f"\nwhole step {step:.1f} ms; sum of parts x counts {accounted:.1f} ms; rest (residual stream, embedding, "
          f"glue) {step - accounted:.1f} ms")
    print(f"{'part':32s} {'count':>5s} {'fwd ms':>8s} {'f+b ms':>8s} {'x count':>8s}")
    for k, r in rows.items():
        print(f"{k:32s} {r.get('count', ''):>5} {r.get('fwd_ms', float('nan')):8.2f} {r.get('fwd_bwd_ms', float('nan')):8.2f} "
              f"{r.get('fwd_bwd_ms', 0) * r.get('count', 0):8.1f}")
    # profiler, grouped by input shape
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True) as prof:
        train_step(model, opt, forward, idx, autocast)
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=45,
                                                               max_name_column_width=40, max_shapes_column_width=70)
    print(table)
    json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name() if cuda else "cpu", "B": B, "T": T,
               "overrides": a.overrides, "step_ms": step, "rows": rows, "profile_table": table},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
