"""Chapter 04's Triton block mixes (moe_book.kernels.attnres_mix) against the torch definition, forward and both
gradients. CPU: Triton's interpreter (set below, before triton is imported); with CUDA the same tests on the GPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_book.config import get_config  # noqa: E402
from moe_book.kernels.attnres_mix import block_open_mixes_triton  # noqa: E402
from moe_book.layers.attnres import BlockAttnRes, block_open_mixes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("B,T,n,q,d", [(1, 3, 1, 1, 16), (2, 5, 2, 3, 200), (1, 7, 3, 8, 64), (2, 3, 5, 8, 130),
                                       (2, 5, 3, 3, 200), (1, 9, 5, 6, 130), (2, 7, 6, 5, 64)])
def test_triton_mixes_equal_block_open_mixes(B, T, n, q, d):
    """Forward and both gradients against block_open_mixes in fp64. Tolerance: fp32 sums of n products (forward) and
    of d products (the weights' gradient), a few ulps of fp32 relative to the largest value."""
    gen = torch.Generator().manual_seed(B * T * n * q + d)
    logits = (2 * torch.randn(B, T, n, q, generator=gen)).to(DEV).requires_grad_()
    blocks = [torch.randn(B, T, d, generator=gen).to(DEV).requires_grad_() for _ in range(n)]
    dU, dlse = torch.randn(B, T, q, d, generator=gen).to(DEV), torch.randn(B, T, q, generator=gen).to(DEV)
    mixes, lse = block_open_mixes_triton(logits, blocks)
    assert len(mixes) == q and all(m.shape == (B, T, d) and m.dtype == torch.float32 for m in mixes)
    assert lse.shape == (B, T, q) and lse.dtype == torch.float32
    U = torch.stack(mixes, -2)
    gl, *gb = torch.autograd.grad((U * dU).sum() + (lse * dlse).sum(), (logits, *blocks))
    l64, b64 = logits.detach().double().requires_grad_(), [b.detach().double().requires_grad_() for b in blocks]
    U_ref, lse_ref = block_open_mixes(l64, b64)
    gl_ref, *gb_ref = torch.autograd.grad((U_ref * dU.double()).sum() + (lse_ref * dlse.double()).sum(), (l64, *b64))
    for got, ref in ((U, U_ref), (lse, lse_ref), (gl, gl_ref), *zip(gb, gb_ref)):
        assert _rel(got, ref) < 1e-6


@pytest.mark.parametrize("launch", [dict(BLOCK_M=8, BLOCK_D=128, num_warps=4), dict(BLOCK_M=16, BLOCK_D=32, num_warps=8),
                                    dict(BLOCK_M=2, BLOCK_D=64, num_warps=1)])
def test_triton_mixes_backward_any_launch_gives_the_same_numbers(monkeypatch, launch):
    """The backward's launch setting (tools/probes/attnres_mix_probe.py sweeps it) only tiles the work: tokens past
    the end in the last program, d in chunks that do not divide it, n and q both padded to powers of two."""
    import moe_book.kernels.attnres_mix as am
    gen = torch.Generator().manual_seed(5)
    logits = (2 * torch.randn(1, 11, 3, 5, generator=gen)).to(DEV).requires_grad_()
    blocks = [torch.randn(1, 11, 100, generator=gen).to(DEV).requires_grad_() for _ in range(3)]
    dU, dlse = torch.randn(1, 11, 5, 100, generator=gen).to(DEV), torch.randn(1, 11, 5, generator=gen).to(DEV)
    runs = []
    for bwd in (dict(am.BWD_LAUNCH), launch):
        monkeypatch.setattr(am, "BWD_LAUNCH", bwd)
        mixes, lse = block_open_mixes_triton(logits, blocks)
        runs.append(torch.autograd.grad((torch.stack(mixes, -2) * dU).sum() + (lse * dlse).sum(), (logits, *blocks)))
    for a, b in zip(*runs):
        assert _rel(a, b) < 1e-6


def test_triton_mixes_read_blocks_in_place_and_a_missing_reader_gradient():
    """The blocks are saved for the backward as they are (no stacked copy), and a reader whose mix gets no gradient
    (a mix nobody used) counts as a zero gradient."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 3, 2, generator=gen).to(DEV).requires_grad_()
    blocks = [torch.randn(1, 4, 16, generator=gen).to(DEV).requires_grad_() for _ in range(3)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mixes, lse = block_open_mixes_triton(logits, blocks)
    ptrs = {t.untyped_storage().data_ptr() for t in saved}
    assert all(b.untyped_storage().data_ptr() in ptrs for b in blocks)
    assert all(t.untyped_storage().nbytes() <= blocks[0].untyped_storage().nbytes() for t in saved)
    gl, *gb = torch.autograd.grad(mixes[0].sum(), (logits, *blocks))            # reader 1's mix and lse unused
    l64 = logits.detach().double().requires_grad_()
    b64 = [b.detach().double().requires_grad_() for b in blocks]
    gl_ref, *gb_ref = torch.autograd.grad(block_open_mixes(l64, b64)[0][..., 0, :].sum(), (l64, *b64))
    for got, ref in ((gl, gl_ref), *zip(gb, gb_ref)):
        assert _rel(got, ref) < 1e-6


def test_triton_mixes_bf16_blocks_and_bad_shapes():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 4, 2, 3, generator=gen).to(DEV)
    blocks = [torch.randn(1, 4, 32, generator=gen).to(DEV, torch.bfloat16).requires_grad_() for _ in range(2)]
    mixes, _ = block_open_mixes_triton(logits, blocks)
    U_ref = block_open_mixes(logits.double(), [b.double() for b in blocks])[0]
    assert _rel(torch.stack(mixes, -2), U_ref) < 1e-6                                # bf16 values, fp32 math
    g = torch.autograd.grad(sum(m.sum() for m in mixes), blocks)
    assert all(x.dtype == torch.bfloat16 for x in g)
    with pytest.raises(ValueError, match=r"\(B, T, n, q\) fp32"):
        block_open_mixes_triton(logits.double(), blocks)
    with pytest.raises(ValueError, match="mix_dtype"):
        block_open_mixes_triton(logits, blocks, torch.float16)
    with pytest.raises(ValueError, match="same"):
        block_open_mixes_triton(logits, blocks[:1])
    with pytest.raises(ValueError, match="same"):
        block_open_mixes_triton(logits, [blocks[0], blocks[1][:, :2]])


def test_triton_mixes_stored_in_bf16():
    """mix_dtype=bf16 rounds only what is stored. The mixes equal block_open_mixes to one bf16 rounding of each element
    (half a spacing, 2^-8 relative, on the GPU; up to a whole one, 2^-7, in the interpreter, which truncates), plus
    the fp32 sum's own error; their gradients come in bf16 and are read as they are, so the logits' and blocks'
    gradients equal the fp64 reference given the same bf16 gradients, to fp32 rounding."""
    gen = torch.Generator().manual_seed(11)
    logits = (2 * torch.randn(2, 5, 3, 4, generator=gen)).to(DEV).requires_grad_()
    blocks = [torch.randn(2, 5, 96, generator=gen).to(DEV).requires_grad_() for _ in range(3)]
    dU = torch.randn(2, 5, 4, 96, generator=gen).to(DEV, torch.bfloat16)
    mixes, lse = block_open_mixes_triton(logits, blocks, torch.bfloat16)
    assert all(m.dtype == torch.bfloat16 and m.shape == (2, 5, 96) for m in mixes) and lse.dtype == torch.float32
    U = torch.stack(mixes, -2)
    gl, *gb = torch.autograd.grad((U.float() * dU.float()).sum() + lse.sum(), (logits, *blocks))
    l64, b64 = logits.detach().double().requires_grad_(), [b.detach().double().requires_grad_() for b in blocks]
    U_ref, lse_ref = block_open_mixes(l64, b64)
    assert ((U.double() - U_ref).abs() <= 2 ** -7 * U_ref.abs() + 1e-6 * U_ref.abs().max()).all()
    assert _rel(lse, lse_ref) < 1e-6
    gl_ref, *gb_ref = torch.autograd.grad((U_ref * dU.double()).sum() + lse_ref.sum(), (l64, *b64))
    for got, ref in ((gl, gl_ref), *zip(gb, gb_ref)):
        assert _rel(got, ref) < 1e-6


def _drive_both_agree(a, b, read, params=(), tol=(1e-5, 1e-4), loss=lambda y: y.square().sum()):
    """Drive two BlockAttnRes (a's random queries copied into b) through 8 sublayers on the GPU with `read(res, state,
    i)`: the reads and the gradients of e, the queries and `params` under `loss` must agree to `tol` (reads,
    gradients); by default fp32 rounding of the mixes' sums."""
    for q in a.queries:
        torch.nn.init.normal_(q, std=0.5)
    b.load_state_dict(a.state_dict())
    e = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    outs = [torch.randn(2, 16, 64, device="cuda") for _ in range(8)]
    res = []
    for r in (a, b):
        st, reads = r.begin(e), []
        for i, o in enumerate(outs):
            reads.append(read(r, st, i))
            st = r.write(st, i, o)
        y = torch.stack(reads + [r.end(st)])
        res.append((y, torch.autograd.grad(loss(y), [e, *r.queries, *params])))
    assert _rel(res[1][0], res[0][0]) < tol[0]
    for ga, gb in zip(res[0][1], res[1][1]):
        assert _rel(gb, ga) < tol[1]


@pytest.mark.gpu
def test_block_attnres_with_triton_mixes_matches_the_compiled_mixes():
    cfg = get_config("tiny", ["model.n_layers=4", "model.d_model=64", "model.attnres_block=1"]).model
    torch.manual_seed(0)
    a = BlockAttnRes(cfg, triton_mixes=False).cuda()
    b = BlockAttnRes(cfg, triton_mixes=True, mix_dtype=torch.float32).cuda()
    _drive_both_agree(a, b, lambda r, st, i: r.read(st, i))


@pytest.mark.parametrize("B,T,q,d,eps", [(1, 1, 1, 16, 1e-6), (2, 5, 3, 200, 1e-6), (3, 3, 2, 64, 0.0)])
def test_triton_merge_equals_merge_partial_normed(B, T, q, d, eps):
    """Forward and the five gradients against merge_partial_normed in fp64, u read in place from a slice of U (the
    layout of the two-phase mixes). B*T is never a multiple of the backward's 2-row tiles here, so tiles run past the
    last token; eps=0 checks those rows stay finite. Tolerance: fp32 sums over d (forward) and over B*T*d (the
    weight gradients), a few ulps of fp32 relative to the largest value."""
    from moe_book.kernels.attnres_mix import merge_partial_normed_triton
    from moe_book.layers.attnres import merge_partial_normed
    gen = torch.Generator().manual_seed(B * T * q + d)
    rnd = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=gen)).to(DEV).requires_grad_()
    U, lse, p, w = rnd(B, T, q, d), rnd(B, T, q, s=2.0), rnd(B, T, d), rnd(d)
    g = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEV).requires_grad_()
    dy = torch.randn(B, T, d, generator=gen).to(DEV)
    j = q - 1
    y, lam = merge_partial_normed_triton(U[..., j, :], lse[..., j], p, w, eps, g, 1e-5, torch.float32)
    assert y.dtype == torch.float32 and lam.shape == (B, T, 1) and not lam.requires_grad
    got = torch.autograd.grad((y * dy).sum(), (U, lse, p, w, g))
    ins64 = [t.detach().double().requires_grad_() for t in (U, lse, p, w, g)]
    U64, l64, p64, w64, g64 = ins64
    y_ref, lam_ref = merge_partial_normed(U64[..., j, :], l64[..., j], p64, w64, eps, g64, 1e-5, torch.float64)
    ref = torch.autograd.grad((y_ref * dy.double()).sum(), ins64)
    assert _rel(y, y_ref) < 1e-6 and _rel(lam, lam_ref) < 1e-6
    for name, a, b in zip(("dU", "dlse", "dp", "dw", "dnorm_w"), got, ref):
        assert torch.isfinite(a).all() and _rel(a, b) < 1e-5, name


def test_triton_merge_dtypes_and_bad_shapes():
    "bf16 out for the bf16 autocast dtype, gradients in each input's dtype; mismatched shapes are refused by name."
    from moe_book.kernels.attnres_mix import merge_partial_normed_triton
    from moe_book.layers.attnres import merge_partial_normed
    gen = torch.Generator().manual_seed(7)
    u, p = torch.randn(1, 4, 32, generator=gen).to(DEV), torch.randn(1, 4, 32, generator=gen).to(DEV, torch.bfloat16)
    lse, w, g = torch.randn(1, 4, generator=gen).to(DEV), torch.randn(32, generator=gen).to(DEV), torch.ones(32).to(DEV)
    p.requires_grad_()
    y, _ = merge_partial_normed_triton(u, lse, p, w, 1e-6, g, 1e-6, torch.bfloat16)
    y_ref, _ = merge_partial_normed(u.double(), lse.double(), p.double(), w.double(), 1e-6, g.double(), 1e-6, torch.float64)
    # one conversion of the output to bf16: half a bf16 spacing (2^-8 relative) rounded on the GPU, up to a whole one
    # (2^-7) in the interpreter, which truncates
    assert y.dtype == torch.bfloat16 and _rel(y, y_ref) < 2 ** -7
    (gp,) = torch.autograd.grad(y.float().sum(), p)
    assert gp.dtype == torch.bfloat16
    # a bf16 mix (BlockAttnRes's default storage): computed in fp32, its gradient stored straight into bf16
    ub, pf = u.to(torch.bfloat16).requires_grad_(), p.detach().float()
    dy = torch.randn(1, 4, 32, generator=gen).to(DEV)
    y, _ = merge_partial_normed_triton(ub, lse, pf, w, 1e-6, g, 1e-6, torch.float32)
    (gu,) = torch.autograd.grad((y * dy).sum(), ub)
    u64 = ub.detach().double().requires_grad_()
    y_ref, _ = merge_partial_normed(u64, lse.double(), pf.double(), w.double(), 1e-6, g.double(), 1e-6, torch.float64)
    (gu_ref,) = torch.autograd.grad((y_ref * dy.double()).sum(), u64)
    assert _rel(y, y_ref) < 1e-6                               # the bf16 values themselves are read exactly
    assert gu.dtype == torch.bfloat16 and _rel(gu, gu_ref) < 2 ** -7
    with pytest.raises(ValueError, match=r"u and partial \(B, T, d\)"):
        merge_partial_normed_triton(u, lse[:, :3], p, w, 1e-6, g, 1e-6, torch.float32)


@pytest.mark.gpu
def test_block_attnres_with_triton_merge_matches_the_compiled_merge():
    "The whole fused two-phase read path through read_normed, with each merge kernel: same reads, same gradients."
    from moe_book.layers.base import RMSNorm
    cfg = get_config("tiny", ["model.n_layers=4", "model.d_model=64", "model.attnres_block=2"]).model
    torch.manual_seed(0)
    # fp32 mixes in both: what is compared is the merge kernel, not the mixes' storage
    a = BlockAttnRes(cfg, triton_merge=False, mix_dtype=torch.float32).cuda()
    b = BlockAttnRes(cfg, triton_merge=True, mix_dtype=torch.float32).cuda()
    norms = torch.nn.ModuleList(RMSNorm(64) for _ in range(8)).cuda()
    for n in norms:
        torch.nn.init.normal_(n.weight, 1.0, 0.1)
    _drive_both_agree(a, b, lambda r, st, i: r.read_normed(st, i, norms[i]), list(norms.parameters()))


@pytest.mark.gpu
def test_block_attnres_bf16_mixes_match_fp32_mixes_to_bf16_rounding():
    """The default (bf16 mixes) against fp32 mixes on the fused read path: reads within two bf16 roundings (a mix's
    own, at most 2^-8 of it, carried through the merge's convex sum and the pre-norm), gradients within a few
    (the mixes' gradients are rounded once more). The loss is linear in the reads: a sum of squares of normed reads is
    nearly constant (RMSNorm fixes their scale), so its gradients would be rounding noise, not something to compare."""
    from moe_book.layers.base import RMSNorm
    cfg = get_config("tiny", ["model.n_layers=4", "model.d_model=64", "model.attnres_block=1"]).model
    torch.manual_seed(0)
    a, b = BlockAttnRes(cfg, mix_dtype=torch.float32).cuda(), BlockAttnRes(cfg, mix_dtype=torch.bfloat16).cuda()
    norms = torch.nn.ModuleList(RMSNorm(64) for _ in range(8)).cuda()
    for n in norms:
        torch.nn.init.normal_(n.weight, 1.0, 0.1)
    R = torch.randn(9, 2, 16, 64, device="cuda")
    _drive_both_agree(a, b, lambda r, st, i: r.read_normed(st, i, norms[i]), list(norms.parameters()),
                      tol=(2 ** -7, 2 ** -6), loss=lambda y: (y * R).sum())


@pytest.mark.gpu
def test_bf16_mixes_move_the_loss_less_than_bf16_autocast_does():
    """The tiny model (every piece on) on one batch: storing the mixes in bf16 moves the loss and its gradient by
    less than bf16 autocast itself moves them (both against fp32 mixes; autocast off vs on)."""
    from moe_book.model import CausalLM
    cfg = get_config("tiny").model
    torch.manual_seed(0)
    model = CausalLM(cfg).cuda()
    for q in model.residual.queries:
        torch.nn.init.normal_(q, std=0.5)
    x = torch.randint(0, cfg.vocab_size, (2, 257), device="cuda")
    params = [p for p in model.parameters() if p.requires_grad]

    def run(mix_dtype, amp):
        model.residual.mix_dtype = mix_dtype
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            _, loss = model(x[:, :-1], x[:, 1:])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return loss.item(), torch.cat([g.flatten() for g in grads if g is not None])

    l32, g32 = run(torch.float32, False)
    lamp, gamp = run(torch.float32, True)
    lmix, gmix = run(torch.bfloat16, True)
    assert not torch.equal(gmix, gamp)              # the setting took effect: the mixes were stored in bf16
    assert abs(lmix - lamp) < abs(lamp - l32)
    assert (gmix - gamp).norm() < (gamp - g32).norm()
