"""The fused (torch.compile'd on CUDA) pointwise pieces against their eager definitions: values and gradients.
On CPU `fused` runs the eager function itself, so the CPU tests check dtype behaviour only."""
import pytest
import torch

from moe_book.layers.base import RMSNorm, fused, out_dtype, rms_norm
from moe_book.layers.kda import kda_output, kda_prepare
from moe_book.layers.moe import ACTIVATIONS, expert_activation, weighted_slot_sum
from moe_book.model import lm_loss


def test_fused_runs_eager_on_cpu():
    calls = []

    @fused
    def f(x):
        calls.append(1)
        return x * 2
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0)) and len(calls) == 1 and f.eager is not f


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_expert_activation_takes_the_packed_gate_up_output(name):
    """expert_activation(name, h) is ACTIVATIONS[name] of h's two halves [gate | up], with h's gradient one tensor:
    the same numbers and gradients as splitting outside (exactly: the same ops in the same order)."""
    gen = torch.Generator().manual_seed(0)
    h = (3 * torch.randn(5, 2 * 24, generator=gen)).requires_grad_()
    g = torch.randn(5, 24, generator=gen)
    y = expert_activation(name, h)
    (dh,) = torch.autograd.grad(y, h, g)
    h2 = h.detach().clone().requires_grad_()
    y2 = ACTIVATIONS[name](*h2.chunk(2, dim=-1))
    (dh2,) = torch.autograd.grad(y2, h2, g)
    assert y.shape == (5, 24) and torch.equal(y, y2) and torch.equal(dh, dh2) and dh.is_contiguous()


def test_rmsnorm_hands_the_autocast_dtype_to_its_matmuls():
    norm = RMSNorm(8)
    x = torch.randn(4, 8)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    torch.testing.assert_close(norm(x), ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
        assert out_dtype(x) == torch.bfloat16
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref.to(torch.bfloat16))
    assert norm(x.double()).dtype == torch.float64


def _inputs_for(name, dev, gen):
    r = lambda *s: torch.randn(*s, generator=gen).to(dev).requires_grad_()
    B, T, H, K = 2, 40, 2, 16
    if name == "rms_norm":
        return (r(B, T, 64), r(64), 1e-6, torch.float32)
    if name == "kda_prepare":
        return (r(B, 3, 3 * H * K), r(B, T, H * K), r(B, T, H * K), r(B, T, H * K), r(3 * H * K, 1, 4),
                r(B, T, H * K), r(H * K), r(B, T, H), -5.0, None, H)
    if name == "kda_output":
        return (r(B, T, H, K), r(B, T, H * K), r(K), 1e-6, torch.float32)
    if name == "lm_loss":
        return (r(B, T, 300), torch.randint(0, 300, (B, T), generator=gen).to(dev))
    if name == "weighted_slot_sum":
        return (r(B * T, 8, 64), r(B * T, 8))
    return (r(B * T, 32), r(B * T, 32))          # an expert activation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["rms_norm", "kda_prepare", "kda_output", "lm_loss", "weighted_slot_sum", "situ",
                                  "swiglu"])
def test_fused_equals_eager_on_cuda(name):
    """fp32 on both sides: the compiled kernels only reorder fp32 sums (rows of <= 300 terms), so values and gradients
    agree to a few ulps of fp32 times the row length: rtol 1e-5, atol 1e-5."""
    named = {"rms_norm": rms_norm, "kda_prepare": kda_prepare, "kda_output": kda_output, "lm_loss": lm_loss,
             "weighted_slot_sum": weighted_slot_sum}
    fn = named.get(name)
    if fn is None:
        fn = lambda g, u: expert_activation(name, torch.cat([g, u], -1))     # the packed [gate | up] layout
        fn.eager = ACTIVATIONS[name]
    outs = []
    for f in (fn, fn.eager):
        args = _inputs_for(name if name in named else "act",
                           torch.device("cuda"), torch.Generator().manual_seed(0))
        y = f(*args)
        y = y if isinstance(y, tuple) else (y,)
        loss = sum((t.float() * (i + 1)).sin().sum() for i, t in enumerate(y))
        grads = torch.autograd.grad(loss, [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad])
        outs.append((y, grads))
    for a, b in zip(outs[0][0] + outs[0][1], outs[1][0] + outs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _LooksCuda(torch.Tensor):
    "A CPU tensor that says it is on CUDA, so `fused` takes its compile path (with torch.compile stubbed out)."
    @property
    def is_cuda(self):
        return True


def test_fused_falls_back_to_eager_once_when_compiling_fails_but_not_on_oom(monkeypatch):
    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("inductor: no C compiler")
        return run
    monkeypatch.setattr(torch, "compile", broken)

    @fused
    def double(x):
        return x * 2
    x = torch.ones(3).as_subclass(_LooksCuda)
    with pytest.warns(UserWarning, match="torch.compile of double failed.*no C compiler"):
        assert torch.equal(double(x).as_subclass(torch.Tensor), torch.full((3,), 2.0))
    assert torch.equal(double(x).as_subclass(torch.Tensor), torch.full((3,), 2.0))   # eager from now on, no warning

    def out_of_memory(fn, **kw):
        def run(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return run
    monkeypatch.setattr(torch, "compile", out_of_memory)

    @fused
    def triple(x):
        return x * 3
    with pytest.raises(torch.OutOfMemoryError):
        triple(x)
