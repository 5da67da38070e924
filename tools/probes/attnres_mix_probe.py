"""Device probe: Block AttnRes's block-mix backward kernel alone, at the small preset's four block openings in a
training step (B 8 x T 4096, d 1024, fp32 blocks; (completed blocks n, readers q) = (2, 8), (3, 8), (4, 8), (5, 1)).
Times the current kernel (moe_book.kernels.attnres_mix) under each candidate launch of BWD_LAUNCH, and, given
OLD=path/to/attnres_mix.py (an earlier version of the generated module), that version at its own launch, checks
both give the same gradients, and reports each against the bytes it must move (reads dU, the blocks; writes their
gradients; fp32). Without OLD there is no comparison (its fields are null). Writes $OUT/attnres_mix_probe.json;
launch settings are keyed by json.dumps(setting, sort_keys=True)."""
import importlib.util, itertools, json, os, time
import torch
import triton
from triton.testing import do_bench
from moe_book.kernels import attnres_mix as cur

OUT = os.environ.get("OUT", "/tmp")
SHAPES = [(2, 8), (3, 8), (4, 8), (5, 1)]
B, T, D = 8, 4096, 1024
M = B * T


def load_old():
    path = os.environ.get("OLD")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("old_attnres_mix", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def old_launch(old, n, q):
    "The old module's own launch: its BWD_LAUNCH where it has one (since 2026-12-07), else its fixed shape."
    if hasattr(old, "BWD_LAUNCH"):
        return old._launch_shape(n, q, D, old.BWD_LAUNCH)
    return old._launch_shape(n, q, D)


def inputs(n, q, gen):
    L = 2 * torch.randn(B, T, n, q, device="cuda", generator=gen)
    V = tuple(torch.randn(B, T, D, device="cuda", generator=gen) for _ in range(n))
    dU = tuple(torch.randn(B, T, D, device="cuda", generator=gen) for _ in range(q))
    dlse = torch.randn(B, T, q, device="cuda", generator=gen)
    return L, V, dU, dlse


def launcher(kernel, n, q, k, L, V, dU, dlse):
    dL, dV = torch.empty_like(L), tuple(torch.empty(B, T, D, device="cuda") for _ in range(n))
    def run():
        kernel[(triton.cdiv(M, k["BLOCK_M"]),)](L, V, dU, dlse, dL, dV, M, D, NP=triton.next_power_of_2(n), **k)
        return dL, dV
    return run


def main():
    old = load_old()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cands = [dict(BLOCK_M=bm, BLOCK_D=bd, num_warps=w) for bm, bd, w in itertools.product((4, 8, 16), (128, 256), (4, 8))]
    rows, t0 = [], time.time()
    for n, q in SHAPES:
        L, V, dU, dlse = inputs(n, q, gen)
        nbytes = 4 * M * D * (q + 2 * n)
        ref = None
        if old is not None:
            k = old_launch(old, n, q)
            run = launcher(old.block_mixes_bwd_kernel, n, q, k, L, V, dU, dlse)
            ref = [x.clone() for x in (run()[0], *run()[1])]
            ms = do_bench(run, warmup=10, rep=50)
            rows.append(dict(kernel="old", n=n, q=q, launch={k_: k[k_] for k_ in ("BLOCK_M", "BLOCK_D")}, ms=ms,
                             gb_per_s=nbytes / ms / 1e6))
            print(f"n={n} q={q} old {k['BLOCK_M']}x{k['BLOCK_D']}: {ms:.3f} ms  {nbytes / ms / 1e6:.0f} GB/s", flush=True)
        for c in cands:
            k = cur._launch_shape(n, q, D, c)
            try:
                run = launcher(cur.block_mixes_bwd_kernel, n, q, k, L, V, dU, dlse)
                got = [x.clone() for x in (run()[0], *run()[1])]
                ms = do_bench(run, warmup=10, rep=50)
            except Exception as e:                       # a launch that does not compile (registers, shared memory)
                rows.append(dict(kernel="new", n=n, q=q, launch=c, error=str(e)[:200]))
                continue
            err = None if ref is None else max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
            rows.append(dict(kernel="new", n=n, q=q, launch=c, ms=ms, gb_per_s=nbytes / ms / 1e6, max_rel_vs_old=err))
            print(f"n={n} q={q} new {c}: {ms:.3f} ms  {nbytes / ms / 1e6:.0f} GB/s  rel vs old {err}", flush=True)
        rows.append(dict(kernel="floor_bytes", n=n, q=q, bytes=nbytes))
    best = {}
    for c in cands:
        ms = [r["ms"] for r in rows if r["kernel"] == "new" and r["launch"] == c and "ms" in r]
        if len(ms) == len(SHAPES):
            best[json.dumps(c, sort_keys=True)] = sum(ms)
    summary = dict(step_sum_ms_old=sum(r["ms"] for r in rows if r["kernel"] == "old") if old else None,
                   step_sum_ms_new_by_launch=best, current_launch=cur.BWD_LAUNCH,
                   step_sum_ms_new_current=best.get(json.dumps(cur.BWD_LAUNCH, sort_keys=True)))
    out = dict(probe="attnres_mix_probe", device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"), shape=dict(B=B, T=T, d=D),
               shapes_nq=SHAPES, rows=rows, summary=summary, seconds=time.time() - t0)
    with open(os.path.join(OUT, "attnres_mix_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
