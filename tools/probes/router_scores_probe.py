"""Probe: how hard is a trained router's batch for the quantile solve? For every MoE layer of a trained model, on
one batch of the run's training split: the structure of the router scores (effective rank of the centred logits,
near-duplicate rows, saturated sigmoids, exact ties in a row's top-k+1, the gap between a token's k-th and
(k+1)-th biased scores) and the MaxVio that 1..32 quantile solves
(quantile_bias, plain and with Anderson extrapolation) leave from a zero bias (cold) and from the layer's newest
solution, as the trainer warm-starts (warm).

  python tools/probes/router_scores_probe.py --run runs/small           # a finished run (GPU: the make train run)
  python tools/probes/router_scores_probe.py --train-toy /tmp/rs_toy --batch 32   # CPU: train a toy first
Writes $OUT/router_scores.json (default: the current directory)."""
import argparse, json, os, time
import torch
import torch.nn.functional as F
from moe_book.data import TokenBatches, data_dir_for, load_split
from moe_book.generate import load_run
from moe_book.layers.moe import LatentMoE, expert_counts, load_stats, quantile_bias, row_topk

# A tiny-shaped model with the small preset's routing (128 experts, top-8), trainable on a CPU in ~9 minutes.
TOY = ["model.moe.n_experts=128", "model.moe.top_k=8", "model.moe.d_expert=32", "model.n_layers=6",
       "train.tokens=1500000", "train.steps=0", "train.batch_size=8", "train.log_every=50",
       "train.eval_every=1000000", "train.ckpt_every=1000000", "train.live=off"]


def effective_rank(x):
    "exp(entropy) of the normalised squared singular values of x - mean(x): how many directions carry the spread."
    sv = torch.linalg.svdvals((x - x.mean(0)).double())
    e = sv.pow(2) / sv.pow(2).sum()
    return float(torch.exp(-(e * e.clamp_min(1e-300).log()).sum()))


def layer_report(scores, newest, stored, top_k, sweeps=32, sample=2048):
    E = scores.shape[1]
    mv = lambda b: load_stats(expert_counts(row_topk(scores + b, top_k)[1], E))["maxvio"]
    curves = {}
    for anderson in (False, True):          # quantile_bias(..., n) for n = 1.. (cold) and 0.. (warm) solves
        tag = "_anderson" if anderson else ""
        curves["maxvio_cold" + tag] = [mv(quantile_bias(scores, torch.zeros_like(stored), top_k, n, anderson))
                                       for n in range(1, sweeps + 1)]
        curves["maxvio_warm" + tag] = [mv(quantile_bias(scores, newest.clone(), top_k, n, anderson))
                                       for n in range(sweeps // 2 + 1)]
    logits = torch.logit(scores.double().clamp(1e-12, 1 - 1e-12))
    sub = F.normalize((logits - logits.mean(0))[:sample], dim=-1)
    cos = sub @ sub.T
    cos.fill_diagonal_(-1)
    nearest = cos.max(1).values
    top = scores.topk(top_k + 1, dim=1).values
    biased = (scores + stored).topk(top_k + 1, dim=1).values
    gap = biased[:, top_k - 1] - biased[:, top_k]               # how far a token's last pick is from the next one
    return {"effective_rank": effective_rank(logits), "near_duplicate_rows_cos_0.99": (nearest > 0.99).float().mean().item(),
            "near_duplicate_rows_cos_0.999": (nearest > 0.999).float().mean().item(),
            "saturated_scores": ((scores == 1) | (scores == 0)).float().mean().item(),
            "rows_with_tie_in_top_k_plus_1": (top[:, :-1] == top[:, 1:]).any(1).float().mean().item(),
            "max_abs_logit": logits.abs().max().item(), "maxvio_stored_bias": mv(stored),
            "kth_gap_median": gap.median().item(), "kth_gap_below_0.01": (gap < 0.01).float().mean().item(), **curves}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="a trainer run directory (train.out_dir)")
    p.add_argument("--train-toy", metavar="DIR", help="train the CPU toy into DIR first, then study it")
    p.add_argument("--batch", type=int, default=None, help="sequences in the batch (default: the run's batch_size)")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M")}
    run = a.run
    if a.train_toy:
        from moe_book.config import get_config
        from moe_book.train import train
        t0 = time.time()
        summary = train(get_config("tiny", TOY + [f"train.out_dir={a.train_toy}"]), verbose=False)
        res["toy"] = {"overrides": TOY, "train_s": time.time() - t0, "heldout_loss": summary["heldout_loss"]}
        run = a.train_toy
    model, cfg = load_run(run, device)
    toks = load_split(data_dir_for(cfg), "train", cfg.model.vocab_size)
    x, _ = TokenBatches(toks, a.batch or cfg.train.batch_size, cfg.train.seq_len, seed=cfg.train.seed + 1).get(0)
    caught = {}
    for i, blk in enumerate(model.layers):
        if isinstance(blk.ffn, LatentMoE):
            score = blk.ffn.router.score
            blk.ffn.router.score = lambda inp, score=score, i=i: caught.setdefault(i, score(inp))
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        model(x.to(device), x.to(device))
    res.update(run=str(run), tokens=int(x.numel()), top_k=cfg.model.moe.top_k, n_experts=cfg.model.moe.n_experts,
               quantile_sweeps=cfg.model.moe.quantile_sweeps, layers={})
    for i, s in caught.items():
        bal = model.layers[i].ffn.balancer
        W = bal.window.shape[0]
        newest = bal.window[(int(bal.pos) - 1) % W] if int(bal.filled) else model.layers[i].ffn.router.bias
        r = layer_report(s.float(), newest.float(), model.layers[i].ffn.router.bias.float(), cfg.model.moe.top_k)
        res["layers"][i] = r
        print(f"layer {i:2d}: eff rank {r['effective_rank']:5.1f}, near-duplicates {r['near_duplicate_rows_cos_0.99']:.3f}"
              f" (cos>0.99) {r['near_duplicate_rows_cos_0.999']:.3f} (>0.999), saturated {r['saturated_scores']:.1e}, "
              f"ties {r['rows_with_tie_in_top_k_plus_1']:.3f}; MaxVio cold after 4/8/16/32 sweeps "
              + " ".join(f"{r['maxvio_cold'][k - 1]:.3f}" for k in (4, 8, 16, 32))
              + " (accelerated " + " ".join(f"{r['maxvio_cold_anderson'][k - 1]:.3f}" for k in (4, 8, 16, 32))
              + "); warm after 0/4/8/16 " + " ".join(f"{r['maxvio_warm'][k]:.3f}" for k in (0, 4, 8, 16))
              + " (accelerated " + " ".join(f"{r['maxvio_warm_anderson'][k]:.3f}" for k in (0, 4, 8, 16)) + ")",
              flush=True)
    out = os.path.join(os.environ.get("OUT", "."), "router_scores.json")
    json.dump(res, open(out, "w"), indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
