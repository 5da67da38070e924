"""Device probe: the quantile balancer's solve at the small preset's shape (32768 tokens, 128 experts, top-8), whose two
kernels ran 240 times in the H100's eager step of 2026-12-07 (quantile_margins_kernel 56 us, boundary_midpoints_kernel
44 us a launch: 12 ms of ~267). Times, one launch at a time:
  - the selection: boundary_midpoints (bisection on the float bits, 32 counting passes) against a radix select
    (four 256-bin tl.histogram passes, `radix_kernel` here: tried on 2026-12-07 and 7x slower) and the bisection two
    bits a pass (16 passes, three counts packed into one int64 reduction: `two_bit_kernel`), under several warp
    counts, outputs compared bit for bit;
  - the margins: quantile_margins_kernel under candidate launches (rows a program, warps), and a variant that
    packs each biased score's sort key with its column into one uint64, so each of the k+1 rounds takes one max
    instead of a max and a min (`packed_margins_kernel`), all compared bit for bit with the committed launch;
  - the whole solve, quantile_bias with the default 8 sweeps, as the trainer calls it.
The rows in results/step_ab_h100_2026-12-07.json came from this probe's first run, with a wider margins grid
(BLOCK_R 8-64, 1-8 warps) that ran past its 90 s; give it ~150 s. Writes $OUT/quantile_solve_probe.json."""
import itertools, json, os, time
import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from moe_book.kernels import moe_topk as mt
from moe_book.layers.moe import quantile_bias

OUT = os.environ.get("OUT", "/tmp")
N, n, k = 32768, 128, 8
share = N * k // n


@triton.jit
def radix_kernel(M, T, N, share, BLOCK: tl.constexpr):
    "boundary_midpoints_kernel's result by radix select: a histogram of each byte of the keys that share the bytes above."
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    live = offs < N
    key = mt._sort_key(tl.load(M + row.to(tl.int64) * N + offs, mask=live, other=0.0))
    byte = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    above = tl.zeros([], dtype=tl.int32)                  # keys larger than every key that has this prefix
    for shift in tl.static_range(24, -8, -8):
        if shift == 24:
            match = live
        else:
            match = live & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
        h = tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
        at_least = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h       # of those keys, how many have a byte >= b
        b = tl.max(tl.where(above + at_least > share, byte, -1), axis=0)
        above += tl.sum(tl.where(byte == b, at_least - h, 0), axis=0)
        prefix = prefix | (b.to(tl.uint32) << shift)
    hi = tl.min(tl.where(live & (key > prefix), key, 0xFFFFFFFF), axis=0)
    hi = tl.where(above == share, hi, prefix)
    tl.store(T + row, -(mt._from_sort_key(prefix) + mt._from_sort_key(hi)) / 2)


@triton.jit
def two_bit_kernel(M, T, N, share, BLOCK: tl.constexpr):
    "boundary_midpoints_kernel's bisection two bits a pass: the counts at three candidates packed in one int64 sum."
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    live = offs < N
    key = tl.where(live, mt._sort_key(tl.load(M + row.to(tl.int64) * N + offs, mask=live, other=0.0)), 0)
    lo = tl.zeros([], dtype=tl.uint32)
    for b in tl.static_range(30, -2, -2):
        c1 = lo | (1 << b)
        c2 = lo | (2 << b)
        c3 = lo | (3 << b)
        # 21 bits a count (N <= 65536 < 2^21): one reduction gives all three
        packed = ((key >= c1).to(tl.int64) + ((key >= c2).to(tl.int64) << 21) + ((key >= c3).to(tl.int64) << 42))
        tot = tl.sum(packed, axis=0)
        n1, n2, n3 = tot & 0x1FFFFF, (tot >> 21) & 0x1FFFFF, tot >> 42
        lo = tl.where(n3 > share, c3, tl.where(n2 > share, c2, tl.where(n1 > share, c1, lo)))
    above = key > lo
    hi = tl.min(tl.where(above, key, 0xFFFFFFFF), axis=0)
    hi = tl.where(tl.sum(above.to(tl.int32), axis=0) == share, hi, lo)
    tl.store(T + row, -(mt._from_sort_key(lo) + mt._from_sort_key(hi)) / 2)


@triton.jit
def packed_margins_kernel(S, B, M, N, n, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    inside = (rows < N)[:, None] & (cols < n)[None, :]
    s = tl.load(S + rows[:, None] * n + cols[None, :], mask=inside, other=0.0)
    x = s + tl.load(B + cols, mask=cols < n, other=0.0)[None, :]
    # high word: the value's sort key; low word: BLOCK_C - 1 - column, so among equal values the lowest column wins
    key = (mt._sort_key(x).to(tl.uint64) << 32) | (BLOCK_C - 1 - cols).to(tl.uint64)[None, :]
    key = tl.where(inside, key, 0)
    picked = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    kth = tl.zeros([BLOCK_R], dtype=tl.float32)
    top = tl.zeros([BLOCK_R], dtype=tl.uint64)
    for j in tl.static_range(K + 1):
        top = tl.max(key, axis=1)
        hit = key == top[:, None]
        if j < K:
            picked = tl.where(hit, 1, picked)
        if j == K - 1:
            kth = mt._from_sort_key((top >> 32).to(tl.uint32))
        key = tl.where(hit, 0, key)
    nxt = mt._from_sort_key((top >> 32).to(tl.uint32))
    margin = s - tl.where(picked != 0, nxt[:, None], kth[:, None])
    tl.store(M + cols[None, :] * N + rows[:, None], margin, mask=inside)


def timed(fn, check):
    try:
        got = fn().clone()
        ms = do_bench(fn, warmup=10, rep=100)
    except Exception as e:                      # a launch that does not compile (registers, shared memory)
        return dict(error=str(e)[:200])
    return dict(ms=ms, us=ms * 1e3, equal=bool(torch.equal(got, check)))


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    # sigmoid router scores with per-expert offsets (the trained router's spread), a small bias as from the window
    scores = torch.sigmoid(torch.randn(N, n, device="cuda", generator=gen) + torch.randn(n, device="cuda", generator=gen))
    bias = 0.05 * torch.randn(n, device="cuda", generator=gen)
    margin = mt.quantile_margins(scores, bias, k)
    rows = []

    ref_sel = mt.boundary_midpoints(margin, share)
    BLOCK = triton.next_power_of_2(N)
    for warps in (8, 16, 32):
        for name, kern in (("bisection", mt.boundary_midpoints_kernel), ("two_bit", two_bit_kernel), ("radix", radix_kernel)):
            out = torch.empty(n, device="cuda")

            def run(kern=kern, out=out, warps=warps):
                kern[(n,)](margin, out, N, share, BLOCK=BLOCK, num_warps=warps)
                return out
            r = dict(part="selection", kernel=name, num_warps=warps, **timed(run, ref_sel))
            rows.append(r)
            print(r, flush=True)

    BLOCK_C = triton.next_power_of_2(n)
    for name, kern in (("committed", mt.quantile_margins_kernel), ("packed", packed_margins_kernel)):
        for block_r, warps in itertools.product((4, 8, 16, 64), (2, 4, 8)):
            out = torch.empty(n, N, device="cuda")

            def run(kern=kern, out=out, block_r=block_r, warps=warps):
                kern[(triton.cdiv(N, block_r),)](scores, bias, out, N, n, K=k, BLOCK_R=block_r, BLOCK_C=BLOCK_C,
                                                 num_warps=warps)
                return out
            r = dict(part="margins", kernel=name, BLOCK_R=block_r, num_warps=warps, **timed(run, margin))
            rows.append(r)
            print(r, flush=True)

    solve = dict(sweeps=8, ms=do_bench(lambda: quantile_bias(scores, bias, k, 8), warmup=10, rep=100))
    print("quantile_bias, 8 sweeps:", solve, flush=True)

    def best(part, kernel):
        ok = [r for r in rows if r["part"] == part and r["kernel"] == kernel and r.get("equal")]
        return min(ok, key=lambda r: r["ms"]) if ok else None
    committed_sel = next(r for r in rows if r["part"] == "selection" and r["kernel"] == "bisection"
                         and r["num_warps"] == max(4, min(32, BLOCK // 2048)))
    committed_mar = next(r for r in rows if r["part"] == "margins" and r["kernel"] == "committed"
                         and dict(BLOCK_R=r["BLOCK_R"], num_warps=r["num_warps"]) == mt.MARGINS_LAUNCH)
    out = dict(probe="quantile_solve_probe", device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"), shape=dict(N=N, n=n, k=k),
               rows=rows, solve=solve,
               summary=dict(selection_committed_us=committed_sel.get("us"),
                            selection_best={kk: best("selection", kk) for kk in ("bisection", "two_bit", "radix")},
                            margins_committed_us=committed_mar.get("us"),
                            margins_best={kk: best("margins", kk) for kk in ("committed", "packed")},
                            solve_8_sweeps_ms=solve["ms"]))
    with open(os.path.join(OUT, "quantile_solve_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
