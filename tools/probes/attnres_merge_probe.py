"""Device probe: Block AttnRes's merge-with-pre-norm backward kernel alone (merge_norm_bwd_kernel; 28 launches a step
at the small preset), B 8 x T 4096, d 1024: fp32 mix u and partial sum p, bf16 output gradient, under candidate
MERGE_LAUNCH["bwd"] settings (rows a program, warps, programs per SM). Each launch is timed by itself, the way
_MergeNormed.backward issues it, without autograd or the partial sums' reduction around it; every setting's outputs
are compared with the committed setting's. Bytes: reads u, p (fp32) and dy (bf16), writes du, dp (fp32).
Writes $OUT/attnres_merge_probe.json."""
import itertools, json, os, time
import torch
import triton
from triton.testing import do_bench
from moe_book.kernels import attnres_mix as am

OUT = os.environ.get("OUT", "/tmp")
B, T, D = 8, 4096, 1024
M = B * T


def launcher(setting, u, lse, p, w, nw, dy):
    k = dict(setting)
    nprog = max(1, min(triton.cdiv(M, k["BLOCK_M"]), k.pop("programs_per_sm") * am._sm_count(u.device)))
    du, dp = torch.empty_like(u), torch.empty_like(p)
    dlse = torch.empty(B, T, device=u.device)
    dw_part, dnw_part = (torch.zeros(nprog, D, device=u.device) for _ in range(2))

    def run():
        am.merge_norm_bwd_kernel[(nprog,)](u, lse, p, w, nw, dy, du, dp, dlse, dw_part, dnw_part, M, D, D, D,
                                           1e-6, 1e-6, BLOCK_D=triton.next_power_of_2(D), **k)
        return du, dp, dlse, dw_part.sum(0), dnw_part.sum(0)
    return run


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    u, p = (torch.randn(B, T, D, device="cuda", generator=gen) for _ in range(2))
    lse = torch.randn(B, T, device="cuda", generator=gen)
    w, nw = (torch.randn(D, device="cuda", generator=gen) for _ in range(2))
    dy = torch.randn(B, T, D, device="cuda", generator=gen).bfloat16()
    nbytes = M * D * (4 * 4 + 2)
    committed = dict(am.MERGE_LAUNCH["bwd"])
    ref = [x.clone() for x in launcher(committed, u, lse, p, w, nw, dy)()]
    rows = []
    for bm, warps, per_sm in itertools.product((1, 2, 4), (4, 8), (2, 4, 8)):
        setting = dict(BLOCK_M=bm, num_warps=warps, programs_per_sm=per_sm)
        try:
            run = launcher(setting, u, lse, p, w, nw, dy)
            got = [x.clone() for x in run()]
            ms = do_bench(run, warmup=10, rep=100)
        except Exception as e:                  # a setting that does not compile (registers, shared memory)
            rows.append(dict(launch=setting, error=str(e)[:200]))
            continue
        err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
        rows.append(dict(launch=setting, ms=ms, gb_per_s=nbytes / ms / 1e6, max_rel_vs_committed=err))
        print(f"{setting}: {ms:.3f} ms  {nbytes / ms / 1e6:.0f} GB/s  rel vs committed {err:.1e}", flush=True)
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"])
    out = dict(probe="attnres_merge_probe", device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"), shape=dict(B=B, T=T, d=D),
               bytes=nbytes, committed=committed, rows=rows,
               summary=dict(committed_ms=next((r["ms"] for r in timed if r["launch"] == committed), None),
                            best_launch=best["launch"], best_ms=best["ms"], step_launches=28))
    with open(os.path.join(OUT, "attnres_merge_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
