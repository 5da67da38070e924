"""One trainer for CPU and GPU: AdamW with fp32 master weights, warmup + cosine, gradient clipping, bf16 autocast
on GPU, held-out evaluation, JSONL metrics, a rich live panel, and atomic torch.distributed.checkpoint checkpoints
that let `--resume` continue bit-for-bit where a killed run stopped."""
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

from moe_book.config import Config, ConfigError, get_config, total_steps
from moe_book.data import DataError, TokenBatches, data_dir_for, load_split, prepare, read_manifest
from moe_book.model import CausalLM


def pick_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu (or auto)")
    return torch.device("cuda" if want in ("auto", "cuda") and torch.cuda.is_available() else "cpu")


def lr_lambda(cfg: Config, steps: int):
    "Linear warmup to the peak, then cosine down to min_lr_ratio of it."
    t = cfg.train
    def f(step):
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def make_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device):
    "AdamW; weight decay on matrices only (norm gains, biases and per-channel vectors are left alone)."
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    t = cfg.train
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), fused=device.type == "cuda")


# ------------------------------------------------------------------------------------------------ checkpoints
class Checkpointer:
    """Checkpoints under <out_dir>/ckpt/step_XXXXXXXX, written with torch.distributed.checkpoint (one process or
    many). Each is written to a `.tmp` folder and renamed into place only when complete, then LATEST is replaced
    atomically, so a crash at any moment leaves the previous checkpoint whole and the pointer valid."""
    def __init__(self, out_dir, keep: int = 2):
        self.dir = Path(out_dir) / "ckpt"
        self.keep = keep
        # One process is a supported DCP mode; its "assuming single process" warning is noise here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def complete(self):
        return sorted(p for p in self.dir.glob("step_*") if p.suffix != ".tmp" and (p / ".metadata").exists())

    def latest(self):
        pointer = self.dir / "LATEST"
        if pointer.exists():
            path = self.dir / pointer.read_text().strip()
            if (path / ".metadata").exists():
                return path
        done = self.complete()
        return done[-1] if done else None

    def save(self, state: dict, step: int):
        import torch.distributed.checkpoint as dcp
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"step_{step:08d}"
        tmp = final.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer_tmp = self.dir / "LATEST.tmp"
        pointer_tmp.write_text(final.name)
        os.replace(pointer_tmp, self.dir / "LATEST")
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, state: dict, path=None):
        "Fill `state` in place from the newest complete checkpoint (or `path`)."
        import torch.distributed.checkpoint as dcp
        path = path or self.latest()
        if path is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.dir}")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        return path


def train_state(model, opt, sched, step: int, cfg: Config) -> dict:
    "Everything a resumed run needs: weights, optimizer moments, schedule, data position (the step), RNG states."
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": step, "rng": rng,
            "config": json.dumps(dataclasses.asdict(cfg))}


def restore_state(state: dict, model, opt, sched):
    from torch.distributed.checkpoint.state_dict import set_state_dict
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return state["step"]


# ----------------------------------------------------------------------------------------------- monitoring
class Monitor:
    "Rich live panel on a terminal, plain lines elsewhere (notebooks, CI logs), and metrics.jsonl always."
    def __init__(self, cfg: Config, out_dir: Path, steps: int, start: int, verbose: bool):
        self.cfg, self.steps, self.verbose = cfg, steps, verbose
        self.path = out_dir / "metrics.jsonl"
        if start > 0 and self.path.exists():      # drop lines a killed run wrote after its last checkpoint
            keep = [l for l in self.path.read_text().splitlines() if l and json.loads(l).get("step", 0) <= start]
            self.path.write_text("".join(l + "\n" for l in keep))
        elif start == 0:
            self.path.unlink(missing_ok=True)
        self.file = open(self.path, "a")
        live = cfg.train.live
        self.live = None
        if verbose and (live == "on" or (live == "auto" and sys.stdout.isatty())):
            from rich.live import Live
            self.live = Live(self._panel({}), refresh_per_second=4, transient=False)
            self.live.start()

    def _panel(self, row: dict):
        from rich.panel import Panel
        from rich.table import Table
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold cyan")
        t.add_column()
        fmt = lambda k, f: (f.format(row[k]) if row.get(k) is not None else "-")
        t.add_row("step", f"{row.get('step', 0)} / {self.steps}")
        t.add_row("loss", fmt("loss", "{:.4f}"))
        t.add_row("held-out loss", fmt("heldout_loss", "{:.4f}"))
        t.add_row("lr", fmt("lr", "{:.2e}"))
        t.add_row("grad norm (pre-clip)", fmt("grad_norm", "{:.3f}"))
        t.add_row("tokens/s", fmt("tokens_per_s", "{:,.0f}"))
        t.add_row("ETA", fmt("eta_s", "{:.0f} s"))
        if row.get("mem_gib") is not None:
            t.add_row("peak memory", fmt("mem_gib", "{:.1f} GiB"))
        for k in sorted(k for k in row if k.startswith("panel/")):
            t.add_row(k[6:], f"{row[k]:.3f}")
        return Panel(t, title=f"moe_book · {self.cfg.preset}", expand=False)

    def write(self, row: dict):
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def show(self, row: dict):
        if self.live is not None:
            self.live.update(self._panel(row))
        elif self.verbose:
            parts = [f"step {row['step']:>6}/{self.steps}", f"loss {row['loss']:.4f}"]
            if row.get("heldout_loss") is not None:
                parts.append(f"held-out {row['heldout_loss']:.4f}")
            parts += [f"lr {row['lr']:.2e}", f"{row['tokens_per_s']:,.0f} tok/s", f"eta {row['eta_s']:.0f}s"]
            print(" | ".join(parts), flush=True)

    def close(self):
        if self.live is not None:
            self.live.stop()
        self.file.close()


@torch.no_grad()
def evaluate(model, batches: TokenBatches, n: int, device, autocast) -> float:
    "Mean loss over n fixed held-out batches (the same ones at every evaluation)."
    model.eval()
    losses = []
    for i in range(n):
        x, y = batches.get(i)
        with autocast():
            _, loss = model(x.to(device), y.to(device))
        losses.append(loss.float())
    model.train()
    return torch.stack(losses).mean().item()


# ------------------------------------------------------------------------------------------------------ train
def train(cfg: Config, resume: bool = False, verbose: bool = True) -> dict:
    """Train `cfg` to its budget and return the run summary (also written to <out_dir>/summary.json).
    With resume=True, continue from the newest complete checkpoint in <out_dir>/ckpt, if any."""
    t = cfg.train
    device = pick_device(cfg)
    out_dir = Path(t.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = prepare(cfg, log=print if verbose else (lambda *a: None))
    manifest = read_manifest(data_dir)
    train_batches = TokenBatches(load_split(data_dir, "train", cfg.model.vocab_size), t.batch_size, t.seq_len, t.seed)
    heldout_batches = TokenBatches(load_split(data_dir, "heldout", cfg.model.vocab_size), t.batch_size, t.seq_len, seed=0)

    torch.manual_seed(t.seed)
    model = CausalLM(cfg.model).to(device)
    steps = total_steps(cfg)
    opt = make_optimizer(model, cfg, device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, steps))
    ckpt = Checkpointer(out_dir, t.keep_ckpts)
    start = 0
    if resume and ckpt.latest() is not None:
        state = train_state(model, opt, sched, 0, cfg)
        path = ckpt.load(state)
        start = restore_state(state, model, opt, sched)
        if verbose:
            print(f"train: resumed from {path} at step {start}")
    (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    fwd = torch.compile(model) if t.compile else model
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else \
        (lambda: torch.autocast("cpu", enabled=False))
    mon = Monitor(cfg, out_dir, steps, start, verbose)
    tokens_per_step = t.batch_size * t.seq_len
    history, evals = [], []
    pending = []   # per-step losses kept on the device until the next log step (no host sync every step)
    heldout = None
    t0, t_last, step_last = time.time(), time.time(), start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        for step in range(start, steps):
            x, y = train_batches.get(step)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                _, loss = fwd(x, y)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            model.post_step()
            pending.append((step + 1, loss.detach(), grad_norm.detach()))
            done = step + 1
            is_eval = done % t.eval_every == 0 or done == steps
            if done % t.log_every == 0 or is_eval or done == steps:
                if is_eval:
                    heldout = evaluate(model, heldout_batches, t.eval_batches, device, autocast)
                    evals.append({"step": done, "heldout_loss": heldout})
                now = time.time()
                tok_s = (done - step_last) * tokens_per_step / max(now - t_last, 1e-9)
                t_last, step_last = now, done
                vals = torch.stack([torch.stack([l.float(), g.float()]) for _, l, g in pending]).tolist()
                for (s, _, _), (l, g) in zip(pending, vals):
                    mon.write({"step": s, "loss": l, "grad_norm": g})
                pending.clear()
                row = {"step": done, "loss": vals[-1][0], "grad_norm": vals[-1][1], "lr": sched.get_last_lr()[0],
                       "tokens": done * tokens_per_step, "tokens_per_s": tok_s,
                       "eta_s": (steps - done) * tokens_per_step / max(tok_s, 1e-9),
                       "heldout_loss": heldout if is_eval else None}
                if device.type == "cuda":
                    row["mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                row.update(model.step_metrics())
                history.append(row)
                mon.write({"event": "log", **row})
                mon.show(row)
            if done % t.ckpt_every == 0 or done == steps:
                ckpt.save(train_state(model, opt, sched, done, cfg), done)
    finally:
        mon.close()
    final_loss = history[-1]["loss"] if history else None
    summary = {"preset": cfg.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": steps,
               "tokens": steps * tokens_per_step, "params": model.num_params(),
               "train_loss": final_loss, "heldout_loss": heldout,
               "unigram_entropy_nats": manifest.get("unigram_entropy_nats"),
               "tokens_per_s": (steps - start) * tokens_per_step / max(time.time() - t0, 1e-9),
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
               "resumed_from": start, "history": history, "evals": evals}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m moe_book.train", description=__doc__)
    p.add_argument("--preset", default="auto", help="tiny, small, or auto (small on a GPU, tiny on CPU)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in train.out_dir")
    p.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. train.lr=1e-3 model.d_model=256")
    a = p.parse_args(argv)
    preset = a.preset
    if preset == "auto":
        preset = "small" if torch.cuda.is_available() else "tiny"
        why = f"CUDA device {torch.cuda.get_device_name()} found" if torch.cuda.is_available() else "no CUDA device found"
        print(f"train: preset '{preset}' ({why}; pass PRESET=tiny|small to choose)")
    cfg = get_config(preset, a.overrides)
    if a.show_config:
        print(json.dumps(dataclasses.asdict(cfg), indent=1))
        return
    print(f"train: {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, "
          f"{total_steps(cfg)} steps x {cfg.train.batch_size * cfg.train.seq_len:,} tokens -> {cfg.train.out_dir}")
    s = train(cfg, resume=a.resume)
    print(f"train: done. train loss {s['train_loss']:.4f}, held-out loss {s['heldout_loss']:.4f} "
          f"(unigram baseline {s['unigram_entropy_nats']:.4f}), {s['tokens_per_s']:,.0f} tokens/s")


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataError) as e:
        sys.exit(f"error: {e}")
