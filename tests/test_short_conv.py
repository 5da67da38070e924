"""Chapter 01's short-convolution kernel (moe_book.kernels.short_conv) against F.conv1d, forward and both gradients.
CPU: Triton's interpreter (set below, before triton is imported), fp32 and fp16; with CUDA the same tests on the GPU,
plus bf16 and the layer with `model.kda.prepare=triton` against `model.kda.prepare=compiled` (kda_prepare)."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_book.config import get_config  # noqa: E402
from moe_book.kernels.short_conv import LAUNCH, short_conv_silu  # noqa: E402
from moe_book.layers.kda import KimiDeltaAttention, kda_prepare, kda_prepare_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, w, past, n_heads, normalize):
    "SiLU(causal depthwise F.conv1d), then the per-head L2 norm: what kda_prepare computes for one of q, k, v."
    B, T, C = x.shape
    left = x.new_zeros(B, w.shape[-1] - 1, C) if past is None else past.to(x.dtype)
    y = F.silu(F.conv1d(torch.cat([left, x], 1).transpose(1, 2), w.unsqueeze(1), groups=C).transpose(1, 2))
    return F.normalize(y.view(B, T, n_heads, -1), dim=-1, eps=1e-6).view(B, T, C) if normalize else y


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("B,T,H,K,W,has_past,normalize", [
    (2, 37, 2, 8, 4, False, True),                # T not a multiple of the 32-row tile
    (1, 5, 1, 16, 4, True, True),                 # shorter than the conv's reach into the past
    (2, 2 * LAUNCH["bwd"][0] + 1, 2, 16, 3, True, False),  # v: no norm; a row just past two tiles
    (1, 1, 2, 8, 4, False, True),                 # T = 1
    (1, 33, 1, 8, 1, False, True),                # W = 1: no left context at all
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_short_conv_equals_conv1d(B, T, H, K, W, has_past, normalize, dtype):
    """Values, dx and dw against F.conv1d in fp64 from the same (rounded) inputs. The kernel's math is fp32: sums of
    W taps and of K squares; fp16 outputs round to 2^-11 relative, so fp16 compares at 2e-3, fp32 at 1e-5."""
    gen = torch.Generator().manual_seed(B * T + H * K + W)
    C = H * K
    x = torch.randn(B, T, C, generator=gen).to(DEV, dtype).requires_grad_()
    w = torch.randn(C, W, generator=gen).to(DEV).requires_grad_()
    past = torch.randn(B, W - 1, C, generator=gen).to(DEV, dtype) if has_past else None
    dy = torch.randn(B, T, C, generator=gen).to(DEV)
    y = short_conv_silu(x, w, past, H, normalize)
    assert y.dtype == dtype and y.shape == x.shape
    gx, gw = torch.autograd.grad((y.float() * dy).sum(), (x, w))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = reference(x64, w64, None if past is None else past.double(), H, normalize)
    rx, rw = torch.autograd.grad((y64 * dy.double()).sum(), (x64, w64))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for got, ref in ((y, y64), (gx, rx), (gw, rw)):
        assert _rel(got, ref) < tol
    assert gx.dtype == dtype and gw.dtype == torch.float32


def test_short_conv_reads_a_strided_past():
    "The layer hands each of q, k, v its channels of the cache's (B, W-1, 3C) left context: a strided slice."
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 9, 16, generator=gen).to(DEV)
    w = torch.randn(16, 4, generator=gen).to(DEV)
    wide = torch.randn(2, 3, 48, generator=gen).to(DEV)
    for i in range(3):
        past = wide[..., 16 * i:16 * (i + 1)]
        assert not past.is_contiguous()
        assert _rel(short_conv_silu(x, w, past, 2, True), reference(x.double(), w.double(), past.double(), 2, True)) < 1e-5


@pytest.mark.parametrize("with_past", [False, True])
def test_kda_prepare_triton_equals_kda_prepare(with_past):
    """The layer's Triton prepare against kda_prepare, fp32, all five outputs and every input's gradient; past None is
    the zeros kda_prepare is given in training. Both are fp32 sums of 4 taps and 8-channel norms: 1e-5."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, W = 2, 19, 2, 8, 4
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV).requires_grad_()
    q, k, v, gl = r(B, T, H * K), r(B, T, H * K), r(B, T, H * K), r(B, T, H * K)
    conv_w, gb, bl = r(3 * H * K, 1, W), r(H * K), r(B, T, H)
    past = torch.randn(B, W - 1, 3 * H * K, generator=gen).to(DEV) if with_past else torch.zeros(B, W - 1, 3 * H * K, device=DEV)
    ins = (q, k, v, conv_w, gl, gb, bl)
    res = []
    for fn, left in ((kda_prepare, past), (kda_prepare_triton, past if with_past else None)):
        out = fn(left, q, k, v, conv_w, gl, gb, bl, -5.0, None, H)
        loss = sum((o * (i + 1)).sin().sum() for i, o in enumerate(out))
        res.append((out, torch.autograd.grad(loss, ins)))
    for a, b in zip(res[0][0] + res[0][1], res[1][0] + res[1][1]):
        assert a.shape == b.shape and _rel(b, a) < 1e-5


def test_short_conv_zero_rows_take_the_eps_branch():
    "A row whose SiLU output is ~0 has norm below eps: F.normalize divides by eps there, and so must the backward."
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    x[:, 2:4] = 0.0                                   # rows 2, 3 and (with W = 1) nothing else see only zeros
    w = torch.randn(16, 1, dtype=torch.float64)
    dy = torch.randn(1, 6, 16, dtype=torch.float64)
    xk, wk = x.float().to(DEV).requires_grad_(), w.float().to(DEV).requires_grad_()
    y = short_conv_silu(xk, wk, None, 1, True)
    gx, gw = torch.autograd.grad((y * dy.float().to(DEV)).sum(), (xk, wk))
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y64 = reference(x64, w64, None, 1, True)
    rx, rw = torch.autograd.grad((y64 * dy).sum(), (x64, w64))
    assert rx[:, 2:4].abs().max() > 0                 # the eps branch has a gradient: it is checked, not skipped
    for got, ref in ((y, y64), (gx, rx), (gw, rw)):
        assert _rel(got.cpu(), ref) < 1e-5


def test_short_conv_bad_input_is_a_clear_error():
    x, w = torch.randn(1, 4, 12, device=DEV), torch.randn(12, 4, device=DEV)
    with pytest.raises(ValueError, match="power-of-two"):
        short_conv_silu(x, w, None, 2)                # heads of 6 channels
    with pytest.raises(ValueError, match=r"w \(C, W\)"):
        short_conv_silu(x, w[:8], None, 1)
    with pytest.raises(ValueError, match="past"):
        short_conv_silu(x, w, torch.zeros(1, 2, 12, device=DEV), 1)
    with pytest.raises(ValueError, match="detach"):
        short_conv_silu(x[..., :8], w[:8], torch.zeros(1, 3, 8, device=DEV, requires_grad=True), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [False, True])
def test_short_conv_bf16_on_cuda(normalize):
    """bf16 in and out at the small preset's head size: the output and dx round to 2^-9 relative. The gradient that
    reaches a bf16 output is itself bf16, so the reference gets that rounded dy too: against the unrounded one, dw
    (a sum over 2000 rows of x dy) differs by ~2^-9/sqrt(3) relative from the rounding alone (1.8e-3 in fp64 on the
    CPU; the GPU run of 2026-12-06 saw 1.4e-3 and failed the 1e-4 this test asked for), which is not the kernel's."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 1000, 1024, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (0.3 * torch.randn(1024, 4, device="cuda", generator=gen)).requires_grad_()
    dy = torch.randn(2, 1000, 1024, device="cuda", generator=gen)
    y = short_conv_silu(x, w, None, 8, normalize)
    gx, gw = torch.autograd.grad((y.float() * dy).sum(), (x, w))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = reference(x64, w64, None, 8, normalize)
    rx, rw = torch.autograd.grad((y64 * dy.bfloat16().double()).sum(), (x64, w64))    # the dy the kernel is given
    assert _rel(y, y64) < 8e-3 and _rel(gx, rx) < 8e-3 and _rel(gw, rw) < 1e-4


@pytest.mark.gpu
def test_layer_with_triton_prepare_matches_kda_prepare():
    """The KDA layer with the Triton convolutions against kda_prepare, fp32, forward and every parameter's gradient.
    The reference names `compiled`: the default, `auto`, is the Triton kernels on CUDA."""
    cfg = get_config("tiny", ["model.mixer=kda", "model.kda.prepare=compiled"]).model
    cfg_triton = get_config("tiny", ["model.mixer=kda", "model.kda.prepare=triton"]).model
    torch.manual_seed(0)
    a = KimiDeltaAttention(cfg, 0).cuda()
    b = KimiDeltaAttention(cfg_triton, 0).cuda()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 100, cfg.d_model, device="cuda")
    res = []
    for layer in (a, b):
        y = layer(x)
        res.append((y, torch.autograd.grad(y.square().sum(), list(layer.parameters()))))
    # fp32 on both sides: the convolutions agree to summation order (~1e-7 relative); the chunk kernel after them
    # is the same, and gradients summed over every token (the conv taps, the gate bias) get 1e-3 of headroom
    assert _rel(res[1][0], res[0][0]) < 1e-4
    for ga, gb in zip(res[0][1], res[1][1]):
        assert _rel(gb, ga) < 1e-3
    with torch.no_grad():                               # decoding with a cache goes through the same kernels
        cache_a, cache_b = a.new_cache(2, 100, "cuda"), b.new_cache(2, 100, "cuda")
        ya = torch.cat([a(x[:, :60], cache_a)] + [a(x[:, t:t + 1], cache_a) for t in range(60, 64)], 1)
        yb = torch.cat([b(x[:, :60], cache_b)] + [b(x[:, t:t + 1], cache_b) for t in range(60, 64)], 1)
    assert _rel(yb, ya) < 1e-4


@pytest.mark.parametrize("fwd,bwd", [((8, 2), (16, 4)), ((16, 4), (8, 8))])
def test_short_conv_any_launch_shape_gives_the_same_numbers(monkeypatch, fwd, bwd):
    "The rows per program (the probe sweeps them) only tile the work: the tile edges and dw's partial sums move."
    import moe_book.kernels.short_conv as sc
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 21, 32, generator=gen).to(DEV).requires_grad_()
    w = torch.randn(32, 4, generator=gen).to(DEV).requires_grad_()
    dy = torch.randn(2, 21, 32, generator=gen).to(DEV)
    runs = []
    for launch in (dict(sc.LAUNCH), {"fwd": fwd, "bwd": bwd}):
        monkeypatch.setattr(sc, "LAUNCH", launch)
        y = short_conv_silu(x, w, None, 2, True)
        runs.append((y, *torch.autograd.grad((y * dy).sum(), (x, w))))
    for a, b in zip(*runs):
        assert _rel(a, b) < 1e-6


@pytest.mark.skipif(torch.cuda.is_available(), reason="the off-GPU behaviour of model.kda.prepare")
def test_prepare_switch_off_the_gpu():
    "auto runs kda_prepare off the GPU (the same layer output as compiled); triton says it needs CUDA; bad values fail."
    from moe_book.config import ConfigError
    torch.manual_seed(0)
    layers = {p: KimiDeltaAttention(get_config("tiny", ["model.mixer=kda", f"model.kda.prepare={p}"]).model, 0)
              for p in ("compiled", "auto", "triton")}
    for p in ("auto", "triton"):
        layers[p].load_state_dict(layers["compiled"].state_dict())
    x = torch.randn(1, 20, layers["compiled"].q_proj.in_features)
    assert torch.equal(layers["auto"](x), layers["compiled"](x))
    with pytest.raises(RuntimeError, match="model.kda.prepare=triton .* CUDA"):
        layers["triton"](x)
    with pytest.raises(ConfigError, match="model.kda.prepare='conv'"):
        get_config("tiny", ["model.mixer=kda", "model.kda.prepare=conv"])
