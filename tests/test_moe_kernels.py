"""Chapter 05's Triton top-k (moe_book.kernels.moe_topk) against torch.topk, and the quantile sweep's one-selection
boundary against the two-selection definition. CPU: the kernel runs in Triton's interpreter (set below, before
triton is imported); with CUDA the same tests run on the GPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_book.kernels.moe_topk import topk_rows  # noqa: E402
from moe_book.layers.moe import quantile_sweep  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("N,n,k", [(1, 8, 1), (70, 128, 9), (33, 100, 8), (5, 7, 7), (0, 16, 2)])
def test_topk_rows_equals_torch_topk(N, n, k):
    x = torch.rand(N, n, generator=torch.Generator().manual_seed(N * n + k)).to(DEV)
    v, i = topk_rows(x, k)
    ref = torch.topk(x, k, dim=-1)
    assert torch.equal(v, ref.values) and torch.equal(i, ref.indices)   # continuous values: no ties


def test_topk_rows_ties_go_to_the_lower_index_and_strides_and_dtypes_work():
    x = torch.tensor([[0.5, 0.9, 0.9, 0.1, 0.9]], device=DEV)
    v, i = topk_rows(x, 3)
    assert i.tolist() == [[1, 2, 4]] and torch.equal(v, x[:, [1, 1, 1]])
    big = torch.rand(6, 40, generator=torch.Generator().manual_seed(1)).to(DEV)
    view = big.to(torch.float16)[:, ::2]                              # a strided, half-precision view
    assert not view.is_contiguous()
    v, i = topk_rows(view, 4)
    ref = torch.topk(view, 4, dim=-1)
    assert v.dtype == torch.float16 and torch.equal(v, ref.values) and torch.equal(i, ref.indices)


def test_topk_rows_nan_and_minus_inf_rows_give_k_distinct_valid_indices():
    # After a bad optimizer step the router scores are NaN. The trainer catches the NaN loss and rolls back, but
    # only if routing did not first hand a gather an out-of-range index (which kills the CUDA context).
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[nan] * 6, [-inf] * 6, [0.3, nan, 0.7, -inf, nan, 0.1]], device=DEV)
    v, i = topk_rows(x, 4)
    assert i.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [2, 0, 5, 1]]   # NaN ranks last, ties to the lower index
    assert v[2, :3].tolist() == pytest.approx([0.7, 0.3, 0.1]) and v[2, 3] == -inf


def test_topk_rows_rejects_bad_shapes():
    with pytest.raises(ValueError, match="0 < k <= n"):
        topk_rows(torch.rand(4, 8, device=DEV), 9)
    with pytest.raises(ValueError, match=r"\(N, n\)"):
        topk_rows(torch.rand(2, 4, 8, device=DEV), 2)


def _sweep_two_selections(scores, bias, top_k):
    "The sweep as first written: both boundary margins by kthvalue."
    N, n = scores.shape
    biased = scores + bias
    top = torch.topk(biased, top_k + 1, dim=-1)
    kth, next_ = top.values[:, top_k - 1:top_k], top.values[:, top_k:top_k + 1]
    picked = torch.zeros_like(biased, dtype=torch.bool).scatter_(1, top.indices[:, :top_k], True)
    margin = (scores - torch.where(picked, next_, kth)).T
    share = min(max(round(N * top_k / n), 1), N - 1)
    lo = torch.kthvalue(margin, N - share, dim=-1).values
    hi = torch.kthvalue(margin, N - share + 1, dim=-1).values
    t = -(lo + hi) / 2
    return t - t.mean()


@pytest.mark.parametrize("ties", [False, True])
def test_sweep_boundary_equals_two_kthvalues(ties):
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(512, 16, generator=gen)
    if ties:                                      # many identical tokens: margins tied across the boundary
        scores[:200] = scores[0]
        scores = (scores * 8).round() / 8
    bias = 0.1 * torch.randn(16, generator=gen)
    torch.testing.assert_close(quantile_sweep(scores.to(DEV), bias.to(DEV), 3).cpu(), _sweep_two_selections(scores, bias, 3),
                               rtol=0, atol=1e-7)


def _margins_torch(scores, bias, k):
    "chapter 05's torch definition of the margins (the CPU path of layers.moe.quantile_margins)."
    from moe_book.layers import moe
    return moe.quantile_margins(scores.cpu(), bias.cpu(), k)


@pytest.mark.parametrize("N,n,k", [(1, 8, 1), (70, 128, 8), (33, 100, 7), (129, 16, 3)])
def test_fused_quantile_margins_equal_the_torch_definition(N, n, k):
    "One Triton pass gives the same fp32 numbers as add, top-(k+1), scatter, subtract, transpose (ties included)."
    from moe_book.kernels.moe_topk import quantile_margins
    gen = torch.Generator().manual_seed(N + n + k)
    scores = torch.rand(N, n, generator=gen)
    scores[: N // 2] = (scores[: N // 2] * 4).round() / 4          # ties inside and across the top-k boundary
    bias = (0.4 * torch.randn(n, generator=gen)).round() / 4        # quarter steps: biased sums stay exact, ties stay
    got = quantile_margins(scores.to(DEV), bias.to(DEV), k)
    assert got.shape == (n, N) and got.dtype == torch.float32
    assert torch.equal(got.cpu(), _margins_torch(scores, bias, k))


def test_fused_quantile_margins_reject_bad_shapes():
    from moe_book.kernels.moe_topk import quantile_margins
    with pytest.raises(ValueError, match="0 < k < n"):
        quantile_margins(torch.rand(4, 8, device=DEV), torch.zeros(8, device=DEV), 8)


def _midpoints_two_topk(margin, share):
    "The sweep's boundary as torch writes it: the share+1 largest, then the two smallest of those."
    edge = torch.topk(margin, share + 1, dim=-1, sorted=False).values
    last_out, first_in = torch.topk(edge, 2, dim=-1, largest=False).values.unbind(-1)
    return -(last_out + first_in) / 2


@pytest.mark.parametrize("n,N,share", [(3, 10, 1), (4, 100, 9), (5, 257, 31), (2, 64, 63), (6, 2048, 128)])
def test_boundary_midpoints_equal_two_topk_selections(n, N, share):
    "Bisection on the float bits finds the same order statistics as torch.topk: ties, signed zeros, infinities."
    from moe_book.kernels.moe_topk import boundary_midpoints
    gen = torch.Generator().manual_seed(n * N + share)
    m = torch.randn(n, N, generator=gen) * 3
    m[0, : N // 2] = (m[0, : N // 2] * 2).round() / 2               # ties, also across the boundary
    m[1, ::2], m[1, 1::3] = 0.0, -0.0                                # a row of zeros of both signs
    if n > 2:
        m[2, :share] = float("inf")                                  # the experts' top margins can be infinite
        m[2, -1] = float("-inf")
    got = boundary_midpoints(m.to(DEV), share).cpu()
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert torch.equal(got, _midpoints_two_topk(m, share))


@pytest.mark.parametrize("low_bits", [0, 8, 16, 24])
def test_boundary_midpoints_when_the_boundary_keys_differ_only_below_a_byte(low_bits):
    "Margins that share their top bytes, so the bisection's first passes all agree and the bits below decide (ties too)."
    from moe_book.kernels.moe_topk import boundary_midpoints
    gen = torch.Generator().manual_seed(low_bits)
    base = torch.tensor([1.5, -0.75]).view(torch.int32)                       # one positive, one negative row
    jitter = torch.randint(0, 1 << low_bits, (2, 3000), generator=gen, dtype=torch.int32)   # low_bits 0: all tied
    m = (base[:, None] + jitter).view(torch.float32)                          # equal above bit `low_bits`
    m[:, :7] = torch.tensor([9.0, -9.0])[:, None]                             # a few far from the pack
    for share in (1, 7, 8, 1500, 2999):
        assert torch.equal(boundary_midpoints(m.to(DEV), share).cpu(), _midpoints_two_topk(m, share)), share


def test_boundary_midpoints_on_a_full_row_of_65536_tokens():
    from moe_book.kernels.moe_topk import BOUNDARY_MAX_TOKENS, boundary_midpoints
    m = torch.randn(2, BOUNDARY_MAX_TOKENS, generator=torch.Generator().manual_seed(3))
    m[1] = (m[1] * 4).round() / 4                                             # a few dozen values, all tied
    share = BOUNDARY_MAX_TOKENS * 8 // 128
    assert torch.equal(boundary_midpoints(m.to(DEV), share).cpu(), _midpoints_two_topk(m, share))


def test_boundary_midpoints_reject_bad_shapes():
    from moe_book.kernels.moe_topk import BOUNDARY_MAX_TOKENS, boundary_midpoints
    with pytest.raises(ValueError, match="0 < share < N"):
        boundary_midpoints(torch.rand(4, 8, device=DEV), 8)
    with pytest.raises(ValueError, match=str(BOUNDARY_MAX_TOKENS)):
        boundary_midpoints(torch.empty(1, BOUNDARY_MAX_TOKENS + 1, device=DEV), 4)
