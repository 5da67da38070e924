"""Chapter 02: the Triton chunk-KDA kernels against chapter 01's references.

CPU (default): the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported) at
tiny shapes, with fp32 and fp16 inputs (bf16 tl.dot is wrong in the interpreter). With CUDA present the same tests
run on the GPU. Tolerances are RMS-relative errors against the fp64 chunked reference:
  fp32 inputs, bounded gate: 1e-5 (fp32 arithmetic throughout; observed ~1e-6);
  fp32 inputs, strong softplus gate: 5e-5 (chunk prefix sums |G| ~ 1e3 keep exponents to |G| * 6e-8 in fp32);
  fp16 inputs: 2e-3 (product operands rounded to 11 bits, unit roundoff 4.9e-4, a handful of roundings deep).
GPU (`pytest -m gpu tests/test_kda_kernel.py`): bf16 up to T=8192 against the fp32 reference with the design's
bounds (o, final state < 5e-3; dq, dk, dv, d initial state < 8e-3; dg, dbeta < 2e-2), and against fla if installed.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from moe_book.kernels.kda_chunk import chunk_kda  # noqa: E402
from moe_book.ops.kda import chunk_kda_torch, kda_op, naive_recurrent_kda  # noqa: E402

torch.set_num_threads(int(os.environ.get("MOE_BOOK_TEST_THREADS", "2")))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["o", "S_T", "dq", "dk", "dv", "dg", "dbeta", "dS0"]


def rms_rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def inputs(B, T, H, K, V, gate="bounded", seed=0, g_min=-5.0):
    "fp64: unit q, k; bounded gate g_min*sigmoid(x - 2) or a strong softplus gate; beta in (0, 1)."
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    x = r(B, T, H, K)
    g = g_min * torch.sigmoid(x - 2) if gate == "bounded" else -4 * F.softplus(3 * x)
    return q, k, r(B, T, H, V), g, torch.sigmoid(r(B, T, H))


def run(fn, xs, S0, cu=None, seed=1):
    "[o, final state, dq, dk, dv, dg, dbeta, dS0] for random d(o) and d(final state)."
    xs = [x.clone().requires_grad_() for x in xs] + [S0.clone().requires_grad_()]
    o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
    ds = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s)
    ((o * do).sum() + (s * ds).sum()).backward()
    return [o, s] + [x.grad for x in xs]


def compare(B, T, H, K, V, gate, dtype, lb, tol, seed=0, cu=None, g=None, beta=None, n_seqs=None):
    q, k, v, g0, b0 = inputs(B, T, H, K, V, gate, seed)
    g = g0 if g is None else g
    beta = b0 if beta is None else beta
    q, k, v = (x.to(dtype).double() for x in (q, k, v))      # the reference sees the same rounded inputs
    S0 = torch.randn(n_seqs or B, H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7))
    ref = run(chunk_kda_torch, [q, k, v, g, beta], S0, cu)
    ours = lambda *a, **kw: chunk_kda(*a, g_lower_bound=lb, **kw)
    got = run(ours, [x.to(DEV, dtype) for x in (q, k, v)] + [g.float().to(DEV), beta.float().to(DEV)],
              S0.float().to(DEV), None if cu is None else cu.to(DEV))
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert all(torch.isfinite(x).all() for x in got)
    # a reference below fp32's range (e.g. the final state exp(-384) S0 when beta = 0, g = -6) is 0 in fp32:
    # such tensors must come out tiny too; the rest is compared RMS-relative
    tiny = {n: a.abs().max().item() for n, a, b in zip(NAMES, got, ref) if b.abs().max() < 1e-30}
    assert all(t < 1e-30 for t in tiny.values()), tiny
    errs = {n: rms_rel(a, b) for n, a, b in zip(NAMES, got, ref) if n not in tiny}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errs})"
    return errs


@pytest.mark.parametrize("gate,lb,tol", [("bounded", -5.0, 1e-5), ("softplus", None, 5e-5)])
def test_fp32_forward_backward_match_reference(gate, lb, tol):
    compare(2, 70, 1, 16, 32, gate, torch.float32, lb, tol)         # a partial second chunk in both sequences


def test_head_size_128_runs_every_k_and_v_block():
    """At K = V = 128 the launch table's blocks (BK 32 / 64, BV 32 / 64) split K and V into several blocks per
    program, which the small-K tests above never do. fp32 in the interpreter, both gate paths, a partial 3rd chunk."""
    from moe_book.kernels.kda_chunk import LAUNCH
    assert any(c.get(b) not in (None, 128) for c in LAUNCH.values() for b in ("BK", "BV"))
    compare(1, 130, 1, 128, 128, "bounded", torch.float32, -5.0, 1e-5, seed=11)
    compare(1, 130, 1, 128, 128, "softplus", torch.float32, None, 5e-5, seed=12)


def test_fp16_inputs():
    compare(1, 80, 2, 32, 16, "bounded", torch.float16, -5.0, 2e-3, seed=3)


def test_unbounded_path_is_exact_for_a_bounded_gate():
    "The pairwise path needs no bound; on a bounded gate it must agree with the reference just the same."
    compare(1, 64, 1, 16, 16, "bounded", torch.float32, None, 1e-5, seed=4)


@pytest.mark.parametrize("gate,lb", [("bounded", -5.0), ("softplus", None)])
def test_varlen_1_63_65_against_oracle_and_reference(gate, lb):
    """Three packed sequences (one token, a chunk minus one, a chunk plus one), each from its own state; forward and
    backward against the chunked reference, and (bounded) the forward against the token-by-token oracle."""
    cu = torch.tensor([0, 1, 64, 129])
    compare(1, 129, 1, 16, 16, gate, torch.float32, lb, 1e-5 if gate == "bounded" else 5e-5, seed=5, cu=cu,
            n_seqs=3)
    if gate != "bounded":
        return
    q, k, v, g, beta = inputs(1, 129, 1, 16, 16, gate, seed=6)
    S0 = torch.randn(3, 1, 16, 16, dtype=torch.float64)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    o, s = chunk_kda(*(x.float().to(DEV) for x in (q, k, v, g, beta)), initial_state=S0.float().to(DEV),
                     output_final_state=True, cu_seqlens=cu.to(DEV), g_lower_bound=lb)
    assert rms_rel(o, o_ref) < 5e-5 and rms_rel(s, s_ref) < 5e-5


def test_T_equals_1_and_no_initial_state():
    q, k, v, g, beta = inputs(3, 1, 2, 16, 16)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o, s = chunk_kda(*(x.float().to(DEV) for x in (q, k, v, g, beta)), output_final_state=True, g_lower_bound=-5.0)
    assert rms_rel(o, o_ref) < 1e-5 and rms_rel(s, s_ref) < 1e-5
    o2, s2 = chunk_kda(*(x.float().to(DEV) for x in (q, k, v, g, beta)), g_lower_bound=-5.0)
    assert s2 is None and torch.equal(o2, o)


@pytest.mark.parametrize("b", [0.0, 1.0])
def test_beta_0_and_1_with_gates_at_the_bound(b):
    "beta=0: nothing written, the state only decays; beta=1: each key's content replaced. g = g_min everywhere."
    g = torch.full((1, 64, 1, 16), -6.0, dtype=torch.float64)
    beta = torch.full((1, 64, 1), b, dtype=torch.float64)
    compare(1, 64, 1, 16, 16, "bounded", torch.float32, -6.0, 1e-5, seed=8, g=g, beta=beta)


def test_gates_alternating_between_0_and_the_bound():
    "The widest spread of tile exponents the bounded path can meet: runs of g = 0 next to runs of g = g_min."
    g = torch.zeros(1, 64, 1, 16, dtype=torch.float64)
    g[:, 8:16] = -6.0
    g[:, 40:48, :, ::2] = -6.0
    compare(1, 64, 1, 16, 16, "bounded", torch.float32, -6.0, 1e-5, seed=9, g=g)


def test_very_negative_unbounded_gates_stay_finite_and_exact():
    "g = -50 per step: the state forgets everything each token; the pairwise path must neither overflow nor NaN."
    g = -50.0 * torch.rand(1, 64, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    compare(1, 64, 1, 16, 16, "softplus", torch.float32, None, 5e-5, seed=10, g=g)


def test_bad_inputs_raise_clear_errors():
    q, k, v, g, beta = (x.float().to(DEV) for x in inputs(1, 8, 1, 16, 16))
    with pytest.raises(ValueError, match="g_lower_bound"):
        chunk_kda(q, k, v, g, beta, g_lower_bound=-20.0)
    with pytest.raises(ValueError, match="v must be"):
        chunk_kda(q, k, v[:, :4], g, beta)
    big = torch.zeros(1, 8, 1, 512, device=DEV)
    with pytest.raises(ValueError, match="K, V <= 256"):
        chunk_kda(big, big, big, big, beta)
    with pytest.raises(ValueError, match="fp64"):
        chunk_kda(q, k, v.double(), g, beta)


def test_kda_op_triton_backend_matches_torch_backend():
    "Chapter 01's switch: backend='triton' calls this kernel with the bounded gate's g_lower_bound."
    q, k, v, g, beta = (x.float().to(DEV) for x in inputs(1, 40, 2, 16, 16, seed=11))
    o_t, s_t = kda_op(q, k, v, g, beta, output_final_state=True, backend="torch")
    o_k, s_k = kda_op(q, k, v, g, beta, output_final_state=True, backend="triton", g_lower_bound=-5.0)
    assert rms_rel(o_k, o_t) < 1e-5 and rms_rel(s_k, s_t) < 1e-5


# ----------------------------------------------------------------------------------------------------------------------
# GPU: bf16 at real sizes (run with `pytest -m gpu tests/test_kda_kernel.py` on a CUDA machine)
# ----------------------------------------------------------------------------------------------------------------------
TOL = {"o": 5e-3, "S_T": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dS0": 8e-3, "dg": 2e-2, "dbeta": 2e-2}


def gpu_inputs(B, T, H, K, V, gate, seed=0, n_seqs=None):
    "bf16 q, k, v; fp32 g (bounded -5*sigmoid or softplus), beta, initial state."
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    q = F.normalize(r(B, T, H, K), dim=-1).bfloat16()
    k = F.normalize(r(B, T, H, K), dim=-1).bfloat16()
    v = r(B, T, H, V).bfloat16()
    g = -5.0 * torch.sigmoid(r(B, T, H, K) - 2) if gate == "bounded" else -F.softplus(r(B, T, H, K) - 1)
    return [q, k, v, g, torch.sigmoid(r(B, T, H))], r(n_seqs or B, H, K, V)


def gpu_case(B, T, H, K, V, gate, seed=0, g=None, beta=None, cu=None, n_seqs=None):
    "(ours in bf16, the fp32 reference on the same bf16 inputs): [o, S_T, dq, dk, dv, dg, dbeta, dS0] each."
    xs, S0 = gpu_inputs(B, T, H, K, V, gate, seed, n_seqs)
    xs[3] = xs[3] if g is None else g
    xs[4] = xs[4] if beta is None else beta
    lb = -5.0 if gate == "bounded" else None
    ours = run(lambda *a, **kw: chunk_kda(*a, g_lower_bound=lb, **kw), xs, S0, cu)
    ref = run(chunk_kda_torch, [x.float() for x in xs], S0, cu)
    return ours, ref


def check_gpu(ours, ref, label):
    errs = {n: rms_rel(a, b) for n, a, b in zip(NAMES, ours, ref) if b.abs().max() > 0}
    print(label, " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    bad = {n: e for n, e in errs.items() if not e < TOL[n]}
    assert not bad, f"{label}: above tolerance {bad} (all: {errs})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("B,T,H", [(2, 1, 4), (2, 63, 4), (2, 65, 4), (2, 1000, 4), (1, 8192, 4)])
def test_gpu_bf16_against_fp32_reference(B, T, H, gate):
    ours, ref = gpu_case(B, T, H, 128, 128, gate)
    assert ours[0].dtype == torch.bfloat16
    check_gpu(ours, ref, f"{gate} B={B} T={T}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b", [0.0, 1.0])
def test_gpu_beta_0_1_gates_at_the_bound(b):
    B, T, H, K = 2, 300, 4, 128
    g = torch.full((B, T, H, K), -5.0, device="cuda")
    beta = torch.full((B, T, H), b, device="cuda")
    check_gpu(*gpu_case(B, T, H, K, K, "bounded", g=g, beta=beta), f"beta={b} g=-5")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_varlen():
    cu = torch.tensor([0, 1, 64, 129, 1000, 4096], device="cuda")
    check_gpu(*gpu_case(1, 4096, 4, 128, 128, "bounded", cu=cu, n_seqs=5), "varlen")


def walk_settings():
    "Every distinct launch setting the state-walk table WALKS can give, per kernel."
    from moe_book.kernels.kda_chunk import WALKS
    return [(name, s) for name, rows in WALKS.items() for i, (_, s) in enumerate(rows) if s not in
            [r[1] for r in rows[:i]]]


def test_walk_table_covers_every_walk_count():
    "Thresholds rise and the last row takes any count, so every shape has a state-walk setting, the first that fits."
    from moe_book.kernels.kda_chunk import WALKS, walk_setting
    for name, rows in WALKS.items():
        most = [m for m, _ in rows]
        assert most[-1] is None and most[:-1] == sorted(most[:-1]), (name, most)
        for n in (1, 7, 8, 9, 31, 32, 33, 128, 10 ** 6):
            assert walk_setting(name, n) == next(s for m, s in rows if m is None or n <= m)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,setting", walk_settings(), ids=lambda x: str(x))
def test_gpu_every_walk_setting(name, setting, monkeypatch):
    "Each setting of the walk table, forced for every walk count, gives the reference's numbers (3 chunks + a part)."
    from moe_book.kernels import kda_chunk
    monkeypatch.setitem(kda_chunk.WALKS, name, [(None, setting)])
    check_gpu(*gpu_case(2, 200, 4, 128, 128, "bounded"), f"{name} {setting}")


FIRST_CALL = """
import sys, torch
sys.path.insert(0, "tests")
import test_kda_kernel as t
ours, ref = t.gpu_case(2, 1, 4, 128, 128, "bounded")
t.check_gpu(ours, ref, "first call of a fresh process")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_gpu_first_backward_of_a_fresh_process(cache, tmp_path_factory):
    """The first forward+backward of a process (T=1, bounded, bf16) matches the reference, d(initial state) included:
    under triton.autotune that call sometimes returned a NaN dS0 while every later call was right. Run in a new
    process, with an empty Triton cache (everything compiles inside the call) and then with the one it filled."""
    import subprocess
    import sys
    cache_dir = tmp_path_factory.getbasetemp() / "triton_cache_first_call"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_layer_uses_the_kernel():
    "The KDA layer on CUDA with backend=triton equals backend=torch (forward and parameter gradients)."
    from moe_book.config import get_config
    from moe_book.layers.kda import KimiDeltaAttention
    grads = {}
    for backend in ("torch", "triton"):
        cfg = get_config("tiny", [f"model.kda.backend={backend}"]).model
        torch.manual_seed(0)
        layer = KimiDeltaAttention(cfg, 0).cuda()
        x = torch.randn(2, 300, cfg.d_model, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        y = layer(x)
        y.pow(2).mean().backward()
        grads[backend] = [y] + [p.grad for p in layer.parameters()]
    for a, b in zip(grads["triton"], grads["torch"]):
        assert rms_rel(a, b) < 1e-4                    # fp32 layer: ieee fp32 products inside the kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_gpu_against_fla(gate):
    "fla's chunk_kda as a second yardstick (bounded: safe_gate=True, lower_bound=-5) on the same bf16 inputs."
    fla = pytest.importorskip("fla.ops.kda")
    B, T, H, K = 2, 4096, 4, 128
    ours, _ = gpu_case(B, T, H, K, K, gate, seed=3)
    xs, S0 = gpu_inputs(B, T, H, K, K, gate, seed=3)
    kw = dict(safe_gate=True, lower_bound=-5.0) if gate == "bounded" else {}
    theirs = run(lambda *a, initial_state, output_final_state, cu_seqlens: fla.chunk_kda(
        *a, initial_state=initial_state, output_final_state=output_final_state, **kw), xs, S0)
    check_gpu(ours, theirs, f"vs fla {gate}")


def test_bench_toy_run_writes_the_schema(tmp_path):
    "The benchmark's plumbing at toy size: rows, summary keys, JSON after every row, fla rows null when absent."
    import json
    from moe_book.bench.kda import main
    out = tmp_path / "bench_kda.json"
    main(["--toy", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["name"] == "kda" and {"device", "date", "versions", "rows", "summary"} <= set(res)
    assert set(res["summary"]) == {"speedup_vs_fla_fwd_bwd", "speedup_vs_fla_fwd", "bounded_over_unbounded_fwd_bwd",
                                   "speedup_vs_sdpa_fwd_bwd"}
    ours = [r for r in res["rows"] if r["impl"].startswith("ours")]
    assert len(ours) == 4 and all(r["ms"] > 0 for r in ours)
    assert all(set(r) == {"impl", "B", "T", "H", "K", "V", "pass", "ms"} for r in res["rows"])
    assert res["summary"]["bounded_over_unbounded_fwd_bwd"]["B1_T64"] > 0
    # the headline pair first (a run cut short keeps same-process fla ratios), each implementation's rows together
    from moe_book.bench.kda import ROW_ORDER
    impls = [r["impl"] for r in res["rows"]]
    assert list(dict.fromkeys(impls)) == ROW_ORDER[:len(set(impls))] and ROW_ORDER[:2] == ["ours_bounded", "fla_bounded"]


def ut_solve(Akk, beta, dtype):
    "kda_ut_solve_fwd alone on one sequence of whole chunks: Akk (1, T, H, 64) fp32, beta (1, T, H)."
    import moe_book.kernels.kda_chunk as kc
    T, H = Akk.shape[1], Akk.shape[2]
    Tm = torch.empty_like(Akk)
    kc.kda_ut_solve_fwd[(T // kc.BT, H)](Akk, beta, Tm, None, None, T, H=H, BT=kc.BT, BC=kc.BC, IS_VARLEN=False,
                                         PREC=kc._dot_precision(dtype))
    return Tm


@pytest.mark.parametrize("case", ["random", "near_identical_keys"])
def test_ut_solve_is_the_inverse(case):
    """kda_ut_solve_fwd gives (I + diag(beta) Akk)^-1 to fp32 accuracy, also in a hard case: near_identical_keys
    (every key close to one direction, beta = 1) makes L close to the all-ones strictly lower matrix, whose powers
    grow to thousands while the inverse stays O(1); forward substitution never forms them (a product-of-powers
    inverse tried in chapter 02 lost three digits here)."""
    T, H, C = 128, 2, 64
    gen = torch.Generator().manual_seed(3)
    if case == "random":
        k = F.normalize(torch.randn(T, H, 16, generator=gen, dtype=torch.float64), dim=-1)
        beta = torch.rand(T, H, generator=gen, dtype=torch.float64)
    else:
        k = F.normalize(1 + 0.02 * torch.randn(T, H, 16, generator=gen, dtype=torch.float64), dim=-1)
        beta = torch.ones(T, H, dtype=torch.float64)
    kc_ = k.view(T // C, C, H, 16)
    A = torch.einsum("ncha,nmha->nhcm", kc_, kc_).tril(-1)                  # (chunks, H, t, i), strictly lower
    Akk = A.permute(0, 2, 1, 3).reshape(1, T, H, C)                         # stored as (tokens, H, 64)
    got = ut_solve(Akk.float().to(DEV), beta.float().to(DEV)[None], torch.float32)
    L = beta.view(T // C, C, H).transpose(1, 2)[..., None] * A              # rows t scaled by beta_t
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + L)
    # fp32 throughout, a few dozen roundings per entry: ~1e-7 seen in both cases
    assert rms_rel(got.view(T // C, C, H, C).permute(0, 2, 1, 3), ref) < 1e-5
