"""Chapter 01: the KDA references, the gates and the layer (CPU, fast)."""
import math

import pytest
import torch
import torch.nn.functional as F

from moe_book.config import ConfigError, get_config
from moe_book.layers.kda import KimiDeltaAttention
from moe_book.model import CausalLM
from moe_book.ops.kda import (FACTOR_EXP_LIMIT, bounded_gate, check_g_min, chunk_kda_torch, intra_chunk_scores_factorised,
                              intra_chunk_scores_pairwise, kda_op, naive_recurrent_kda, softplus_gate, tile_numerics,
                              tile_spread)

torch.set_num_threads(2)


def rms_rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def inputs(B, T, H, K, V, seed=0, dtype=torch.float64, gate="bounded"):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    x = r(B, T, H, K)
    g = -5 * torch.sigmoid(x - 2) if gate == "bounded" else -4 * F.softplus(3 * x)
    return q, k, r(B, T, H, V), g, torch.sigmoid(r(B, T, H))


SHAPES = [(2, 100, 3, 16, 24), (1, 64, 2, 32, 32), (2, 130, 2, 8, 40), (1, 17, 4, 16, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_chunked_matches_naive(shape, gate):
    B, T, H, K, V = shape
    q, k, v, g, beta = inputs(*shape, gate=gate)
    S0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o1, s1 = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o2, s2 = chunk_kda_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert (o1 - o2).abs().max() < 1e-10 and (s1 - s2).abs().max() < 1e-10
    o3, s3 = chunk_kda_torch(*(x.float() for x in (q, k, v, g, beta)), initial_state=S0.float(), output_final_state=True)
    assert o3.dtype == torch.float32 and s3.dtype == torch.float32
    assert rms_rel(o3, o1) < 1e-5 and rms_rel(s3, s1) < 1e-5


def test_chunk_sizes_and_bf16_inputs():
    q, k, v, g, beta = inputs(2, 150, 2, 16, 16, seed=3)
    o1 = naive_recurrent_kda(q, k, v, g, beta)[0]
    for C in (16, 32, 128):
        assert (chunk_kda_torch(q, k, v, g, beta, chunk_size=C)[0] - o1).abs().max() < 1e-10
    o_bf = chunk_kda_torch(*(x.bfloat16() for x in (q, k, v, g, beta)))[0]
    assert o_bf.dtype == torch.bfloat16 and rms_rel(o_bf, o1) < 2e-2      # bf16 inputs, fp32 math inside
    S0 = torch.randn(2, 2, 16, 16, dtype=torch.float64)                   # an empty sequence returns its state
    o0, s0 = chunk_kda_torch(*(x[:, :0] for x in (q, k, v, g, beta)), initial_state=S0, output_final_state=True)
    assert o0.shape == (2, 0, 2, 16) and torch.equal(s0, S0)


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_gradients_match(gate):
    q, k, v, g, beta = inputs(1, 80, 2, 8, 12, seed=1, gate=gate)
    S0 = torch.randn(1, 2, 8, 12, dtype=torch.float64)
    w_o, w_s = torch.randn(1, 80, 2, 12, dtype=torch.float64), torch.randn(1, 2, 8, 12, dtype=torch.float64)

    def grads(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
        o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        return [x.grad for x in xs]

    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], grads(naive_recurrent_kda),
                          grads(chunk_kda_torch)):
        assert (a - b).abs().max() < 1e-10, name


def test_split_state_equals_one_pass():
    q, k, v, g, beta = inputs(2, 150, 2, 16, 16, seed=4)
    S0 = torch.randn(2, 2, 16, 16, dtype=torch.float64)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    for cut in (1, 64, 70):
        o_a, s_a = chunk_kda_torch(*(x[:, :cut] for x in (q, k, v, g, beta)), initial_state=S0, output_final_state=True)
        o_b, s_b = chunk_kda_torch(*(x[:, cut:] for x in (q, k, v, g, beta)), initial_state=s_a, output_final_state=True)
        assert (torch.cat([o_a, o_b], 1) - o).abs().max() < 1e-10 and (s_b - s).abs().max() < 1e-10


@pytest.mark.parametrize("fn", [chunk_kda_torch, naive_recurrent_kda])
def test_varlen_equals_separate_runs(fn):
    lens = [37, 130, 0, 1, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    q, k, v, g, beta = inputs(1, sum(lens), 2, 16, 8, seed=2)
    S0 = torch.randn(len(lens), 2, 16, 8, dtype=torch.float64)
    o, s = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, s_n = naive_recurrent_kda(*(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=S0[n:n + 1],
                                       output_final_state=True)
        assert torch.allclose(o[:, a:b], o_n, atol=1e-10, rtol=0) and torch.allclose(s[n], s_n[0], atol=1e-10, rtol=0)
    # varlen gradients flow like the batched ones
    xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    chunk_kda_torch(*xs, cu_seqlens=cu)[0].sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in xs)


def test_bad_inputs_get_clear_errors():
    q, k, v, g, beta = inputs(2, 20, 2, 8, 8)
    with pytest.raises(ValueError, match="B == 1"):
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10, 20]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda_torch(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 10, 19]))
    with pytest.raises(ValueError, match="initial_state"):
        naive_recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 8, 8))
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_torch(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="backend"):
        kda_op(q, k, v, g, beta, backend="cuda")


def test_triton_backend_missing_is_a_clear_error():
    try:
        import moe_book.kernels.kda_chunk  # noqa: F401
        pytest.skip("chapter 02's kernel module exists")
    except ImportError:
        pass
    q, k, v, g, beta = inputs(1, 16, 1, 8, 8)
    with pytest.raises(RuntimeError, match="kernels.kda_chunk"):
        kda_op(q, k, v, g, beta, backend="triton")
    assert torch.allclose(kda_op(q, k, v, g, beta)[0], chunk_kda_torch(q, k, v, g, beta)[0])   # auto -> torch on CPU


def test_score_paths_agree_and_wild_gates_stay_exact():
    q, k, v, g, beta = inputs(2, 128, 2, 16, 16, seed=5)
    to_chunks = lambda x: x.transpose(1, 2).reshape(2, 2, 2, 64, 16)
    G = to_chunks(g).cumsum(-2)
    for a, b in zip(intra_chunk_scores_pairwise(to_chunks(q), to_chunks(k), G),
                    intra_chunk_scores_factorised(to_chunks(q), to_chunks(k), G)):
        assert (a - b).abs().max() < 1e-12
    g_wild = -16 * F.softplus(20 * torch.randn_like(g))                # unbounded gate, huge values
    assert tile_spread(to_chunks(g_wild).cumsum(-2)) > FACTOR_EXP_LIMIT[torch.float32]
    o1 = naive_recurrent_kda(q, k, v, g_wild, beta)[0]
    xs = [x.float().requires_grad_() for x in (q, k, v, g_wild, beta)]
    o2 = chunk_kda_torch(*xs)[0]
    o2.sum().backward()
    assert rms_rel(o2, o1) < 1e-5 and all(torch.isfinite(x.grad).all() for x in xs)


# ------------------------------------------------------------------------------------------------- gates
def test_bounded_gate_range():
    x = torch.cat([torch.tensor([-math.inf, math.inf, -1e38, 1e38, -1e4, 1e4, 0.0]), 50 * torch.randn(10_000)])
    for g_min in (-6.0, -5.0, -4.5, -3.0):
        for dt in (torch.float32, torch.bfloat16, torch.float64):
            g = bounded_gate(x.to(dt), g_min)
            assert torch.isfinite(g).all() and (g >= g_min).all() and (g <= 0).all()
    # the old gate has no lower bound
    assert softplus_gate(torch.tensor([[[1e4]]]), torch.zeros(1)).item() <= -1e4


@pytest.mark.parametrize("bad", [-7.0, -6.01, -2.99, 0.0, 0.5, 3.0])
def test_g_min_validation(bad):
    with pytest.raises(ValueError, match="g_min"):
        check_g_min(bad)
    with pytest.raises(ValueError, match="g_min"):
        bounded_gate(torch.zeros(3), bad)
    with pytest.raises(ConfigError, match="g_min"):
        get_config("tiny", [f"model.kda.g_min={bad}"])
    cfg = get_config("tiny", ["model.mixer=kda"]).model
    cfg.kda.g_min = bad                                                # bypassing the config check
    with pytest.raises(ValueError, match="g_min"):
        KimiDeltaAttention(cfg, 0)


def test_bound_keeps_tile_factors_in_bf16():
    q, k, _, _, _ = inputs(1, 64, 2, 16, 16)
    for g_min in (-5.0, -6.0):                                          # the worst case: every gate at the bound
        r = tile_numerics(q.transpose(1, 2), k.transpose(1, 2), torch.full((1, 2, 64, 16), g_min), torch.bfloat16)
        assert r["overflow"] == 0 and r["underflow"] == 0 and r["bad_tiles"] == 0 and r["rms_rel_err"] < 1e-2
        assert r["max_abs_exponent"] == pytest.approx(8 * -g_min)


# ------------------------------------------------------------------------------------------------- layer
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_decode_equals_parallel(gate):
    torch.manual_seed(0)
    cfg = get_config("tiny", ["model.mixer=kda", f"model.kda.gate={gate}"]).model
    layer = KimiDeltaAttention(cfg, 0).double()
    x = torch.randn(2, 80, cfg.d_model, dtype=torch.float64)
    y = layer(x)
    cache = layer.new_cache(2, 80, None, torch.float64)
    y_steps = torch.cat([layer(x[:, t:t + 1], cache) for t in range(80)], 1)
    assert (y_steps - y).abs().max() < 1e-10 and cache.seen == 80
    cache = layer.new_cache(2, 80, None, torch.float64)                # prefill (2 pieces) then decode
    y_mixed = torch.cat([layer(x[:, :2], cache), layer(x[:, 2:67], cache)] + [layer(x[:, t:t + 1], cache) for t in range(67, 80)], 1)
    assert (y_mixed - y).abs().max() < 1e-10
    layer32 = layer.float()                                            # fp32 model, fp32 state
    cache = layer32.new_cache(2, 80, None, torch.float32)
    assert cache.state.dtype == torch.float32 and cache.state.shape == (2, cfg.kda.n_heads, cfg.kda.head_dim, cfg.kda.head_dim)
    y32 = torch.cat([layer32(x[:, :40].float(), cache)] + [layer32(x[:, t:t + 1].float(), cache) for t in range(40, 80)], 1)
    assert rms_rel(y32, y) < 1e-5
    with pytest.raises(ValueError, match="KDACache"):
        layer32(x[:, :1].float(), cache={"k": None})


def test_layer_in_model_trains():
    torch.manual_seed(0)
    cfg = get_config("tiny", ["model.mixer=kda", "model.global_mixer=attn", "model.d_model=64", "model.n_layers=2",
                              "model.global_every=2", "model.kda.n_heads=2", "model.kda.head_dim=16"]).model
    model = CausalLM(cfg)
    assert [b.mixer_type for b in model.layers] == ["kda", "attn"]
    assert model.layers[0].mixer.o_proj.is_residual_out
    idx = torch.randint(0, cfg.vocab_size, (2, 100))
    _, loss = model(idx, idx)
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "mixer" in n and "layers.0" in n]
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_references_on_cuda():
    "The torch references are device-agnostic: chunked == naive on CUDA (fp32), incl. varlen and bf16 inputs."
    dev = torch.device("cuda")
    q, k, v, g, beta = (x.float().to(dev) for x in inputs(1, 300, 4, 64, 64, seed=7))
    S0 = torch.randn(3, 4, 64, 64, device=dev)
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int64, device=dev)
    o1, s1 = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    o2, s2 = chunk_kda_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    assert rms_rel(o2, o1) < 1e-5 and rms_rel(s2, s1) < 1e-5
    o3 = chunk_kda_torch(*(x.bfloat16() for x in (q, k, v, g, beta)))[0]
    assert o3.dtype == torch.bfloat16 and rms_rel(o3, naive_recurrent_kda(q, k, v, g, beta)[0]) < 2e-2


@pytest.mark.gpu
def test_layer_decode_on_cuda():
    torch.manual_seed(0)
    cfg = get_config("tiny", ["model.mixer=kda", "model.kda.backend=torch"]).model
    layer = KimiDeltaAttention(cfg, 0).cuda()
    x = torch.randn(2, 70, cfg.d_model, device="cuda")
    with torch.no_grad():
        y = layer(x)
        cache = layer.new_cache(2, 70, "cuda", torch.float32)
        y_steps = torch.cat([layer(x[:, :50], cache)] + [layer(x[:, t:t + 1], cache) for t in range(50, 70)], 1)
    assert rms_rel(y_steps, y) < 1e-4                                  # TF32 / kernel choice may differ per shape


def test_prepare_matches_conv1d_reference():
    "kda_prepare spells the causal depthwise convolution out as shifted products: it must equal F.conv1d."
    from moe_book.layers.kda import kda_prepare
    import torch.nn.functional as F
    torch.manual_seed(0)
    B, T, H, K, W = 2, 37, 2, 8, 4
    q, k, v = (torch.randn(B, T, H * K, dtype=torch.float64) for _ in range(3))
    past = torch.randn(B, W - 1, 3 * H * K, dtype=torch.float64)
    conv_w = torch.randn(3 * H * K, 1, W, dtype=torch.float64)
    gl, gb, bl = torch.randn(B, T, H * K, dtype=torch.float64), torch.randn(H * K, dtype=torch.float64), torch.randn(B, T, H, dtype=torch.float64)
    qo, ko, vo, g, beta = kda_prepare(past, q, k, v, conv_w, gl, gb, bl, -5.0, None, H)
    seq = torch.cat([past, torch.cat([q, k, v], -1)], 1)
    ref = F.silu(F.conv1d(seq.transpose(1, 2), conv_w, groups=3 * H * K).transpose(1, 2)).view(B, T, 3, H, K)
    torch.testing.assert_close(vo.view(B, T, H, K), ref[:, :, 2], rtol=0, atol=1e-12)
    torch.testing.assert_close(qo.view(B, T, H, K), F.normalize(ref[:, :, 0], dim=-1, eps=1e-6), rtol=0, atol=1e-12)
    torch.testing.assert_close(ko.view(B, T, H, K), F.normalize(ref[:, :, 1], dim=-1, eps=1e-6), rtol=0, atol=1e-12)
    torch.testing.assert_close(g, -5.0 * torch.sigmoid(gl.view(B, T, H, K) + gb.view(H, K)), rtol=0, atol=1e-12)
    torch.testing.assert_close(beta, torch.sigmoid(bl), rtol=0, atol=1e-12)
