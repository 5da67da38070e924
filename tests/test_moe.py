"""Chapter 05: Latent MoE, grouped experts, balancers and monitoring (CPU; GPU tests marked `gpu`)."""
import json
import math

import pytest
import torch

from moe_book.config import ConfigError, MoEConfig, get_config
from moe_book.layers.moe import (BALANCERS, GroupedExperts, LatentMoE, MaxVioAlert, Router, experts_reference,
                                 expert_counts, grouped_mm_works, load_stats, make_balancer, maxvio_summary,
                                 moe_panel, quantile_bias, router_logits, situ_glu, split_weight, swiglu, worst_maxvio)

# The tiny preset now runs every piece; these tests start from tiny with a plain residual, MoE in every layer and
# no latent projection, and add only what each test names.
BASE = ["model.first_dense=0", "model.residual=plain", "model.moe.latent_dim=0"]


def tiny_config(overrides=()):
    return get_config("tiny", BASE + list(overrides))


def rms_rel(a, b):
    return ((a - b).double().pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt().clamp_min(1e-30)).item()


def moe_model_cfg(**moe):
    cfg = tiny_config(["model.ffn=moe"]).model
    for k, v in moe.items():
        setattr(cfg.moe, k, v)
    return cfg


def routing_with_idle_experts(n_tok, n_experts, top_k, n_used, seed=0):
    "Each token picks top_k distinct experts among the first n_used; the rest get no tokens."
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n_used, generator=g)[:top_k] for _ in range(n_tok)])


# ----------------------------------------------------------------------------------------------- grouped experts
BACKENDS = ["loop"] + (["grouped_mm"] if grouped_mm_works(torch.device("cpu"), torch.float32) else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ["situ", "swiglu"])
def test_grouped_experts_match_per_token_loop(backend, act):
    "Dropless grouped path == per-token loop in fp32 (1e-5 RMS-relative), outputs and all gradients, idle experts included."
    torch.manual_seed(0)
    n, k, N, d_in, h, d_out = 8, 3, 40, 32, 16, 24
    ex = GroupedExperts(n, d_in, h, d_out, act=act, std=0.3, down_std=0.3)
    x = torch.randn(N, d_in, requires_grad=True)
    idx = routing_with_idle_experts(N, n, k, n_used=5)
    w = torch.rand(N, k, requires_grad=True)
    gy = torch.randn(N, d_out)
    inputs = (x, w, ex.gate_up, ex.down)
    fast = ex(x, idx, w, backend=backend)
    ref = experts_reference(x, idx, w, ex.gate_up, ex.down, act)
    assert rms_rel(fast, ref) < 1e-5
    for gf, gr in zip(torch.autograd.grad(fast, inputs, gy), torch.autograd.grad(ref, inputs, gy)):
        assert rms_rel(gf, gr) < 1e-5
    assert expert_counts(idx, n)[5:].sum() == 0
    g_up = torch.autograd.grad(ex(x, idx, w, backend=backend), ex.gate_up, gy)[0]
    assert g_up[5:].abs().max() == 0        # idle experts get exactly zero gradient


def test_grouped_mm_cpu_support_is_what_we_claim():
    "torch's CPU grouped_mm: fp32 works here (torch >= 2.13) and fp64 does not, so fp64 takes the loop path."
    assert not grouped_mm_works(torch.device("cpu"), torch.float64)
    ex = GroupedExperts(4, 8, 4, 8, std=0.3, down_std=0.3).double()
    x = torch.randn(10, 8, dtype=torch.float64)
    idx = routing_with_idle_experts(10, 4, 2, 3)
    w = torch.rand(10, 2, dtype=torch.float64)
    assert rms_rel(ex(x, idx, w), experts_reference(x, idx, w, ex.gate_up, ex.down)) < 1e-12


def test_unaligned_widths_fall_back_to_loop():
    "A hidden width whose rows are not 16-byte aligned (fp32 width 5) still works (auto picks the loop)."
    torch.manual_seed(0)
    ex = GroupedExperts(4, 6, 5, 7, std=0.3, down_std=0.3)
    x, idx, w = torch.randn(12, 6), routing_with_idle_experts(12, 4, 2, 4), torch.rand(12, 2)
    assert rms_rel(ex(x, idx, w), experts_reference(x, idx, w, ex.gate_up, ex.down)) < 1e-5


def test_situ_glu_definition_and_bound():
    x = torch.linspace(-50, 50, 1001)
    gate = 4.0 * torch.tanh(x / 4.0) * torch.sigmoid(x)
    up = 25.0 * torch.tanh(x.flip(0) / 25.0)
    assert torch.equal(situ_glu(x, x.flip(0)), gate * up)
    assert situ_glu(x * 1e3, x * 1e3).abs().max() <= 100.0 + 1e-4
    small = torch.linspace(-1e-2, 1e-2, 11)
    assert torch.allclose(situ_glu(small, small), swiglu(small, small), rtol=1e-3, atol=1e-9)


# --------------------------------------------------------------------------------------------------- the layer
def test_latent_identity_reduces_to_plain_moe():
    "latent_dim = d with identity projections == the ordinary MoE (latent_dim = 0) with the same weights."
    torch.manual_seed(0)
    lat = LatentMoE(moe_model_cfg(latent_dim=128, d_expert=64, balancer="none"), 0)
    flat = LatentMoE(moe_model_cfg(latent_dim=0, d_expert=64, balancer="none"), 0)
    flat.load_state_dict({k: v for k, v in lat.state_dict().items() if not k.startswith("latent_")})
    with torch.no_grad():
        lat.latent_down.weight.copy_(torch.eye(128))
        lat.latent_up.weight.copy_(torch.eye(128))
        lat.experts.down.mul_(30)
        flat.experts.down.mul_(30)
    x = torch.randn(3, 10, 128)
    assert rms_rel(lat(x), flat(x)) < 1e-6


def test_layer_matches_composed_reference_with_grads():
    torch.manual_seed(1)
    layer = LatentMoE(moe_model_cfg(latent_dim=64, d_expert=32, n_experts=8, top_k=2, balancer="none"), 0)
    x = torch.randn(30, 128, requires_grad=True)

    def reference(x):
        s, i, w = layer.router(x)
        h = layer.latent_down(x)
        y = experts_reference(h, i, w, layer.experts.gate_up, layer.experts.down, layer.experts.act)
        return layer.latent_up(y) + layer.shared(x)
    params = [x] + list(layer.parameters())
    for a, b in zip(torch.autograd.grad(layer(x).square().sum(), params),
                    torch.autograd.grad(reference(x).square().sum(), params)):
        assert rms_rel(a, b) < 1e-5


def test_latent_and_shared_projections_in_one_gemm():
    """With a latent projection and a shared expert, LatentMoE projects x for both in one stacked GEMM: the same
    output and gradients as latent_down(x) and the shared expert's own gate_up (fp64)."""
    torch.manual_seed(0)
    layer = LatentMoE(moe_model_cfg(latent_dim=32, n_shared=1), 0).double().eval()   # eval: no selection jitter
    x = torch.randn(40, layer.router.proj.in_features, dtype=torch.float64, requires_grad=True)
    h, shared_in = layer.in_projections(x)
    assert torch.allclose(h, layer.latent_down(x), rtol=1e-12, atol=1e-12)
    assert torch.allclose(shared_in, layer.shared.gate_up(x), rtol=1e-12, atol=1e-12)
    y = layer(x)
    params = [x, layer.latent_down.weight, layer.shared.gate_up.weight]
    g_fused = torch.autograd.grad(y.square().sum(), params)
    scores = layer.router.score(x)
    idx, wts = layer.router.select(scores)
    y_ref = layer.latent_up(layer.experts(layer.latent_down(x), idx, wts)) + layer.shared(x)
    g_ref = torch.autograd.grad(y_ref.square().sum(), params)
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(g_fused, g_ref))
    flat = LatentMoE(moe_model_cfg(latent_dim=0, n_shared=1), 0)
    assert flat.in_projections(x.float())[1] is None                   # no latent: nothing to stack with


def test_residual_out_and_init():
    cfg = moe_model_cfg(latent_dim=64)
    layer = LatentMoE(cfg, 0)
    assert layer.latent_up.is_residual_out and layer.shared.down.is_residual_out
    flat = LatentMoE(moe_model_cfg(latent_dim=0), 0)
    assert flat.experts.down_std == pytest.approx(cfg.init_std / math.sqrt(2 * cfg.n_layers))


# ------------------------------------------------------------------------------------------------------- router
def test_router_scores_fp32_gradients_in_the_autocast_dtype():
    """The router's logits are fp32 with or without autocast (they pick the experts); under autocast the backward
    runs in its dtype and saves x in it. Outside autocast it is the plain fp32 linear map."""
    torch.manual_seed(0)
    r = Router(64, 16, 4)
    x = torch.randn(300, 64, requires_grad=True)
    gs = torch.randn(300, 16)

    def grads(autocast):
        x.grad = r.proj.weight.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                s = r.score(x)
        s.backward(gs)
        return s, x.grad.clone(), r.proj.weight.grad.clone(), saved

    s32, dx32, dw32, saved32 = grads(False)
    x2, w2 = x.detach().clone().requires_grad_(), r.proj.weight.detach().clone().requires_grad_()
    ref = torch.sigmoid(torch.nn.functional.linear(x2, w2))
    ref.backward(gs)
    assert torch.equal(s32, ref) and rms_rel(dx32, x2.grad) < 1e-6 and rms_rel(dw32, w2.grad) < 1e-6
    assert torch.bfloat16 not in saved32
    s16, dx16, dw16, saved16 = grads(True)
    assert s16.dtype == torch.float32 and torch.equal(s16, s32)     # selection sees the same fp32 scores
    assert torch.bfloat16 in saved16 and dx16.dtype == torch.float32 and dw16.dtype == torch.float32
    # each product in the backward carries up to three bf16 roundings (unit roundoff 2^-9 ~ 2e-3 each)
    assert rms_rel(dx16, dx32) < 1e-2 and rms_rel(dw16, dw32) < 1e-2
    assert rms_rel(dx16, dx32) > 0                                   # it really ran in bf16


def test_split_weight_logits_match_fp64():
    """The CUDA router's logits: x (bf16, exact) times the stacked [w_hi; w_lo] with fp32 accumulation. Emulated
    here with fp64 products of the exact bf16 parts (what a tensor core computes before its fp32 sum): the split
    alone is within 2^-17 of |w| per weight, and the logits within 2^-16 of their terms' size (measured ~1e-6), more
    than 100x closer than a single bf16 weight gets (~7e-4)."""
    torch.manual_seed(0)
    n, d = 16, 256
    w = torch.randn(n, d) / d ** 0.5
    hi, lo = split_weight(w).double().split(n)
    assert ((hi + lo) - w.double()).abs().max() <= 2 ** -17 * w.abs().max()
    x = torch.randn(500, d).bfloat16()
    ref = x.double() @ w.double().T
    split = x.double() @ hi.T + x.double() @ lo.T
    scale = (x.double().abs() @ w.double().abs().T).mean()
    assert (split - ref).abs().max() / scale < 2 ** -16
    one_bf16 = x.double() @ w.bfloat16().double().T                 # what the split's second half buys
    assert (one_bf16 - ref).abs().max() > 100 * (split - ref).abs().max()
    assert torch.equal(router_logits(x, w), torch.nn.functional.linear(x.float(), w))   # CPU: the fp32 GEMM


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_logits_cuda_split_gemm():
    "On CUDA a bf16 x takes the split GEMM: within 2^-15 of fp64 (fp32 GEMM's own error included), same top-8 rows."
    torch.manual_seed(0)
    w = (torch.randn(128, 1024) / 32).cuda()
    x = torch.randn(32768, 1024).cuda().bfloat16()
    z = router_logits(x, w)
    ref = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T).mean()
    assert z.dtype == torch.float32 and (z.double() - ref).abs().max() / scale < 2 ** -15
    picks = torch.topk(z, 8).indices.sort(-1).values
    ref_picks = torch.topk(ref, 8).indices.sort(-1).values
    assert (picks != ref_picks).any(-1).float().mean() < 1e-3


def test_bias_has_no_gradient_and_does_not_change_weights():
    torch.manual_seed(0)
    r = Router(16, 8, 2, route_scale=2.0)
    x = torch.randn(200, 16)
    s0, i0, w0 = r(x)
    r.bias.copy_(torch.randn(8))
    s1, i1, w1 = r(x)
    assert not r.bias.requires_grad and "bias" not in dict(r.named_parameters())
    assert (i0 != i1).any()                                  # the bias does change the selection ...
    expect = s1.gather(1, i1) / s1.gather(1, i1).sum(-1, keepdim=True) * 2.0
    assert torch.equal(w1, expect)                           # ... but weights are the unbiased scores, renormalised
    same = (i0 == i1).all(-1)
    assert same.any() and torch.equal(w0[same], w1[same])
    w1.sum().backward()
    assert r.bias.grad is None and r.proj.weight.grad is not None


def test_ties_are_handled():
    "All scores equal (zero router): k distinct experts, equal weights, finite quantile bias and a runnable step."
    cfg = moe_model_cfg(n_experts=8, top_k=3, balancer="quantile")
    layer = LatentMoE(cfg, 0).train()
    with torch.no_grad():
        layer.router.proj.weight.zero_()
    x = torch.randn(64, 128)
    scores, idx, w = layer.router(x)
    assert all(len(set(row)) == 3 for row in idx.tolist())
    assert torch.allclose(w, torch.full_like(w, 1.0 / 3))
    b = quantile_bias(scores, layer.router.bias, 3)
    assert torch.isfinite(b).all() and abs(b.sum().item()) < 1e-6
    layer(x).sum().backward()
    layer.post_step()
    assert torch.isfinite(layer.router.bias).all()
    # duplicated tokens: ties inside each expert's margins; the quantile solve still balances the batch
    torch.manual_seed(0)
    base = torch.sigmoid(torch.randn(256, 16) + torch.linspace(-1.5, 1.5, 16))
    assert _fixed_batch_updates_to(base.repeat(4, 1), 16, 4, 0.05, 10) is not None


# ---------------------------------------------------------------------------------------------------- balancers
def _fixed_batch_updates_to(scores, n, k, level, max_updates, rule="quantile", rate=1e-3):
    "Updates of `rule` on one fixed batch until its MaxVio < level (None if not within max_updates)."
    bal = make_balancer(MoEConfig(n_experts=n, top_k=k, balancer=rule, bias_update_rate=rate, balance_window=8))
    bias = torch.zeros(n)
    for u in range(max_updates + 1):
        idx = torch.topk(scores + bal.route_bias(scores, bias), k, dim=-1).indices
        load = expert_counts(idx, n)
        if load_stats(load)["maxvio"] < level:
            return u
        bal.observe(scores, idx, bias)
        bal.update(bias, load)
    return None


def _skewed_scores(N=4096, n=64, seed=0):
    torch.manual_seed(seed)
    return torch.sigmoid(torch.randn(N, n) + torch.linspace(-2, 2, n) + 0.5 * torch.randn(N, 1))


def test_quantile_balances_a_fixed_batch_in_a_few_updates():
    "Repeated quantile updates drive a skewed batch's MaxVio (> 2 at start) below 0.05 within a few updates."
    scores = _skewed_scores()
    assert load_stats(expert_counts(torch.topk(scores, 6, dim=-1).indices, 64))["maxvio"] > 2
    # solved after routing (like the step rules): measured 1 update with 8 sweeps, 4 with 1 sweep (window 8)
    n_lagged = _fixed_batch_updates_to(scores, 64, 6, 0.05, 6, rule="quantile_lagged")
    assert n_lagged is not None and n_lagged <= 3
    # solved in the forward: the first routing of the batch is already balanced
    assert _fixed_batch_updates_to(scores, 64, 6, 0.05, 6, rule="quantile") == 0
    # the sign rule at its default step is nowhere near after the same number of updates
    assert _fixed_batch_updates_to(scores, 64, 6, 0.05, 6, rule="sign_bias") is None


def test_quantile_sweeps_converge():
    "Repeated solves (Jacobi sweeps) on one batch: the misfit shrinks to < 0.05 within 4 sweeps from zero bias."
    scores = _skewed_scores(seed=1)
    bias, mv = torch.zeros(64), []
    for _ in range(6):
        bias = quantile_bias(scores, bias, 6)
        mv.append(load_stats(expert_counts(torch.topk(scores + bias, 6, dim=-1).indices, 64))["maxvio"])
    assert mv[3] < 0.05 and mv[-1] < 0.05 and mv[0] > mv[3]


def test_quantile_routes_in_forward_but_evaluates_with_stored_bias():
    torch.manual_seed(0)
    layer = LatentMoE(moe_model_cfg(balancer="quantile", n_experts=8, top_k=2), 0)
    u = torch.nn.functional.normalize(torch.randn(128), dim=0)
    x = torch.randn(512, 128) + 2 * u
    with torch.no_grad():
        layer.router.proj.weight.add_(torch.linspace(-1, 1, 8)[:, None] * u)
        assert load_stats(expert_counts(layer.router(x)[1], 8))["maxvio"] > 1
    layer.train()
    layer(x)
    train_load = layer.step_load.clone()
    layer.post_step()
    assert load_stats(train_load)["maxvio"] < 0.05                       # the batch itself was balanced
    stored = layer.router.bias.clone()
    layer.eval()
    with torch.no_grad():
        y_eval = layer(x)
        _, idx, w = layer.router(x)                                      # stored bias, no solve
    assert torch.equal(layer.router.bias, stored) and layer.step_load.sum() == 0
    ref = experts_reference(x, idx, w, layer.experts.gate_up, layer.experts.down, "situ") + layer.shared(x)
    assert rms_rel(y_eval, ref) < 1e-5


def test_quantile_through_the_layer_and_post_step():
    "The same through LatentMoE: training forwards on one batch + post_step() drive step_metrics' MaxVio < 0.05."
    torch.manual_seed(0)
    layer = LatentMoE(moe_model_cfg(n_experts=16, top_k=2, balancer="quantile", d_expert=16, n_shared=0), 3).train()
    u = torch.nn.functional.normalize(torch.randn(128), dim=0)
    x = torch.randn(2048, 128) + 2 * u                       # a shared direction the router can be skewed along
    with torch.no_grad():
        layer.router.proj.weight.add_(torch.linspace(-1, 1, 16)[:, None] * u)
        assert load_stats(expert_counts(layer.router(x)[1], 16))["maxvio"] > 2     # badly skewed with no bias
    maxvio = []
    for _ in range(8):
        layer(x)
        layer.post_step()
        maxvio.append(layer.step_metrics()["moe/L3/maxvio"])
    # maxvio[u]: loads of the (u+1)-th forward, which starts its solve from the bias stored by u updates
    first = next(u for u, v in enumerate(maxvio) if v < 0.05)
    assert first <= 2 and max(maxvio[first:]) < 0.05      # measured: 0 (balanced in the first forward)


def test_quantile_window_mean_and_warm_start():
    "The stored bias is the mean of the last balance_window solutions; a training forward starts from the newest."
    W = 4
    bal = make_balancer(MoEConfig(n_experts=3, top_k=1, balancer="quantile", balance_window=W))
    bal.sweeps = 0                                   # no solve: route_bias returns the point the solve starts from
    scores, bias = torch.rand(10, 3), torch.tensor([0.5, -0.5, 0.0])
    assert torch.equal(bal.route_bias(scores, bias), bias)            # nothing stored yet: the given bias
    for step in range(1, W + 3):
        bal.step_sum.copy_(torch.tensor([step, -step, 0.0]) * 2)
        bal._n_obs = 2                                                # two forwards this step
        bal.update(bias, torch.zeros(3))
        recent = torch.arange(max(1, step - W + 1), step + 1).float()
        assert torch.allclose(bias, torch.stack([recent.mean(), -recent.mean(), torch.tensor(0.0)])), step
        assert torch.equal(bal.route_bias(scores, bias), torch.tensor([step, -step, 0.0]).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quantile_layer_forward_never_waits_for_the_gpu():
    "A training forward and post_step of a quantile LatentMoE make no host sync (sync debug mode raises on one)."
    layer = LatentMoE(moe_model_cfg(n_experts=16, top_k=2, balancer="quantile", d_expert=16, n_shared=1), 0)
    layer = layer.cuda().train()
    x = torch.randn(512, 128, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x)                                     # first call: grouped_mm probe and Triton compiles may sync
        layer.post_step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = layer(x)
            layer.post_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(y).all()


def test_step_rules():
    cfg = MoEConfig(n_experts=4, top_k=1, bias_update_rate=0.1)
    load = torch.tensor([10, 30, 20, 20])
    for rule, expect in [("sign_bias", [0.1, -0.1, 0.0, 0.0]),
                         ("proportional", [0.05, -0.05, 0.0, 0.0]),
                         ("quantile_step", [0.1, -0.1, 0.0, 0.0]),
                         ("none", [0.0, 0.0, 0.0, 0.0])]:
        cfg.balancer = rule
        bias = torch.zeros(4)
        make_balancer(cfg).update(bias, load)
        assert torch.allclose(bias, torch.tensor(expect)), (rule, bias)


def test_aux_loss_only_in_training_and_only_for_aux_balancer():
    torch.manual_seed(0)
    x = torch.randn(50, 128)
    for bal in BALANCERS:
        layer = LatentMoE(moe_model_cfg(balancer=bal, aux_loss_coef=0.01), 0).train()
        layer(x)
        assert (layer.aux_loss is not None) == (bal == "aux_loss")
        layer.eval()
        with torch.no_grad():
            layer(x)
        assert layer.aux_loss is None
    layer = LatentMoE(moe_model_cfg(balancer="aux_loss", aux_loss_coef=0.01, n_experts=8, top_k=2), 0).train()
    layer(x)
    s, i, _ = layer.router(x)
    f = expert_counts(i, 8).float() / i.numel()
    p = (s / s.sum(-1, keepdim=True)).mean(0)
    assert layer.aux_loss.item() == pytest.approx(0.01 * 8 * (f * p).sum().item(), rel=1e-5)
    layer.aux_loss.backward()
    assert layer.router.proj.weight.grad.abs().sum() > 0


def test_model_integration_metrics_and_checkpoint_state():
    "CausalLM with ffn=moe: aux loss reaches the loss, post_step moves biases, step_metrics has every layer."
    from moe_book.model import CausalLM
    cfg = tiny_config(["model.ffn=moe", "model.moe.balancer=quantile", "model.n_layers=2"]).model
    model = CausalLM(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (2, 64))
    _, loss = model(idx, idx)
    loss.backward()
    assert model.step_metrics() == {}                 # nothing completed yet
    model.post_step()
    m = model.step_metrics()
    for layer in range(2):
        assert sum(m[f"moe/L{layer}/load"]) == 2 * 64 * cfg.moe.top_k
        assert {f"moe/L{layer}/{k}" for k in ("maxvio", "dead", "entropy", "bias_spread")} <= m.keys()
    sd = model.state_dict()
    assert any(k.endswith("router.bias") for k in sd) and any(k.endswith("balancer.window") for k in sd)
    assert not any(k.endswith("router.bias") for k, _ in model.named_parameters())
    # the aux_loss balancer's term is part of the model loss
    cfg_aux = tiny_config(["model.ffn=moe", "model.moe.balancer=aux_loss", "model.n_layers=2"]).model
    torch.manual_seed(0)
    m_aux = CausalLM(cfg_aux).train()
    _, l_aux = m_aux(idx, idx)
    aux = sum(mod.aux_loss for mod in m_aux.modules() if isinstance(mod, LatentMoE))
    m_aux.eval()
    with torch.no_grad():
        _, l_plain = m_aux(idx, idx)
    assert l_aux.item() == pytest.approx(l_plain.item() + aux.item(), rel=1e-5)


# ------------------------------------------------------------------------------------------------------ errors
def test_config_errors_are_clear():
    with pytest.raises(ConfigError, match="top_k"):
        tiny_config(["model.ffn=moe", "model.moe.top_k=9"])
    with pytest.raises(ConfigError, match="latent_dim"):
        tiny_config(["model.ffn=moe", "model.moe.latent_dim=256"])
    with pytest.raises(ConfigError, match="quantile_sweeps"):
        tiny_config(["model.ffn=moe", "model.moe.quantile_sweeps=0"])
    # the module repeats the checks for configs built by hand (no validate())
    for field, value, match in [("top_k", 9, "top_k"), ("latent_dim", 256, "latent_dim"),
                                ("balancer", "quantiles", "balancer.*choose one of"), ("act", "gelu", "act"),
                                ("quantile_sweeps", 0, "quantile_sweeps")]:
        cfg = moe_model_cfg(**{field: value})
        with pytest.raises(ConfigError, match=match):
            LatentMoE(cfg, 0)
    assert make_balancer(MoEConfig(quantile_sweeps=3)).sweeps == 3     # the key reaches the solve
    with pytest.raises(ValueError, match="balancer"):       # ConfigError is a ValueError
        make_balancer(MoEConfig(balancer="nope"))


# -------------------------------------------------------------------------------------------------- monitoring
def test_monitoring_helpers():
    m = {"moe/L0/maxvio": 0.2, "moe/L5/maxvio": 0.7, "moe/L0/load": [1, 3], "moe/L5/load": [0, 4], "loss": 1.0}
    assert worst_maxvio(m) == (0.7, 5)
    panel = moe_panel(m)
    assert panel["panel/MaxVio worst (L5)"] == 0.7 and panel["panel/expert load min/mean"] == 0.0
    alert = MaxVioAlert(threshold=0.5, patience=2)
    out = [alert.check(s, m) for s in range(4)] + [alert.check(4, {"moe/L0/maxvio": 0.1})] + \
          [alert.check(s, m) for s in range(5, 7)]
    assert [o is not None for o in out] == [False, True, False, False, False, False, True]
    st = load_stats([0, 2, 2, 4])
    assert st == {"maxvio": 1.0, "dead": 1, "entropy": pytest.approx(-(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5)) / math.log(4))}
    hist = [{"step": s, "moe/L0/maxvio": float(s), "moe/L1/maxvio": 2.0 * s} for s in range(10)]
    assert maxvio_summary(hist) == {"maxvio": pytest.approx((8 * 1.5 + 9 * 1.5) / 2), "maxvio_worst": pytest.approx(17.0)}


# --------------------------------------------------------------------------------------------------- benchmarks
def test_bench_moe_toy(tmp_path):
    from moe_book.bench.moe import main
    out = tmp_path / "bench_moe.json"
    r = main(["--toy", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["summary"]["fraction_of_grouped_mm"] > 0 and "speedup_vs_hf_experts" in saved["summary"]
    assert {row["name"] for row in r["rows"]} >= {"bare grouped_mm (expert GEMMs)", "our GroupedExperts (swiglu)"}
    assert saved["shapes"]["tokens"] == 256


def test_bench_balance_toy(tmp_path):
    from moe_book.bench.balance import main
    out = tmp_path / "balance.json"
    r = main(["--preset", "tiny", "--tokens", "128", "--balancers", "none,quantile", "--out", str(out),
              "--runs-dir", str(tmp_path / "runs"), "--quiet",
              "model.d_model=32", "model.n_layers=1", "model.first_dense=0", "model.moe.latent_dim=0",
              "model.n_heads=2", "model.head_dim=16", "model.moe.d_expert=16",
              "train.batch_size=2", "train.seq_len=32", "train.eval_batches=1", "train.warmup_steps=1"])
    s = json.loads(out.read_text())["summary"]
    assert set(s) == {"none", "quantile"}
    assert all(math.isfinite(v["heldout_loss"]) and v["maxvio"] is not None for v in s.values())
    assert out.with_suffix(".png").exists() and not (tmp_path / "runs" / "tiny_none" / "ckpt").exists()


# --------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_grouped_mm_bf16_matches_loop():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    assert grouped_mm_works(dev, torch.bfloat16)
    ex = GroupedExperts(16, 256, 128, 256, std=0.05, down_std=0.05).to(dev)
    x = torch.randn(1024, 256, device=dev, requires_grad=True)
    idx = routing_with_idle_experts(1024, 16, 4, 14).to(dev)
    w = torch.rand(1024, 4, device=dev)
    gy = torch.randn(1024, 256, device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = ex(x, idx, w, backend="grouped_mm")
    g_fast = torch.autograd.grad(fast, (x, ex.gate_up, ex.down), gy.to(fast.dtype))
    ref = experts_reference(x.double().cpu(), idx.cpu(), w.double().cpu(), ex.gate_up.double().cpu(),
                            ex.down.double().cpu(), "situ")
    assert rms_rel(fast.cpu(), ref) < 2e-2
    xs = x.detach().double().cpu().requires_grad_()
    gu, dn = ex.gate_up.detach().double().cpu().requires_grad_(), ex.down.detach().double().cpu().requires_grad_()
    g_ref = torch.autograd.grad(experts_reference(xs, idx.cpu(), w.double().cpu(), gu, dn, "situ"), (xs, gu, dn),
                                gy.double().cpu())
    for a, b in zip(g_fast, g_ref):
        assert rms_rel(a.cpu(), b) < 2e-2


@pytest.mark.gpu
def test_gpu_layer_trains_under_autocast():
    from moe_book.model import CausalLM
    cfg = tiny_config(["model.ffn=moe", "model.moe.latent_dim=64"]).model
    model = CausalLM(cfg).cuda().train()
    idx = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    model.post_step()
    assert torch.isfinite(loss) and "moe/L0/maxvio" in model.step_metrics()


@pytest.mark.gpu
def test_gpu_bench_moe_toy(tmp_path):
    from moe_book.bench.moe import main
    r = main(["--toy", "--out", str(tmp_path / "b.json")])
    assert r["summary"]["fraction_of_grouped_mm"] > 0


def test_quantile_sweeps_diverge_when_over_relaxed():
    "Chapter 05's claim: repeating the solve converges; stepping twice as far as each solve (factor 2) does not."
    from moe_book.layers.moe import quantile_sweep, row_topk
    gen = torch.Generator().manual_seed(0)
    N, n, k = 8192, 64, 4
    x, w = torch.randn(N, 64, generator=gen), torch.randn(n, 64, generator=gen) / 8
    scores = torch.sigmoid(x @ w.T + 0.5 * torch.randn(n, generator=gen))

    def maxvio_after(factor, sweeps=8):
        b = torch.zeros(n)
        for _ in range(sweeps):
            b = b + factor * (quantile_sweep(scores, b, k) - b)
            b = b - b.mean()
        return load_stats(expert_counts(row_topk(scores + b, k)[1], n))["maxvio"]
    plain, over = maxvio_after(1.0), maxvio_after(2.0)
    assert plain < 0.02 and over > 1.0, (plain, over)


def test_anderson_step_lands_on_the_fixed_point_of_a_scaled_map():
    """For F(b) = lam*b + c the residuals of b0 and b1 = F(b0) are parallel to b - b*, so one extrapolation along the
    last two solves is exact: b* = c / (1 - lam) (mean zero, like every solve)."""
    from moe_book.layers.moe import anderson_extrapolate
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(16, generator=gen, dtype=torch.float64)
    c -= c.mean()
    lam = 0.7
    F = lambda b: lam * b + c
    b0 = torch.randn(16, generator=gen, dtype=torch.float64)
    b0 -= b0.mean()
    b1 = F(b0)
    b2 = anderson_extrapolate(b1, F(b1), b0, b1)
    assert torch.allclose(b2, c / (1 - lam), atol=1e-12)
    assert (b1 - c / (1 - lam)).abs().max() > 0.1                    # where a plain step would still be


def test_anderson_step_without_movement_returns_the_solve():
    "d = 0 (the residual did not change): gamma is 0 and the step is the plain solve, not NaN."
    from moe_book.layers.moe import anderson_extrapolate
    b, f = torch.zeros(8), torch.linspace(-1, 1, 8)
    out = anderson_extrapolate(b, f, b, f)
    assert torch.equal(out, f - f.mean())


def test_accelerated_solves_leave_less_misfit_at_low_rank():
    """Chapter 05's measurement, one batch of it: rank-4 scores (8K tokens, 128 experts, top-8), 4 and 8 solves
    from zero with and without the extrapolation (0.127 -> 0.057 and 0.016 -> 0.014 when written)."""
    gen = torch.Generator().manual_seed(4)
    X, W = torch.randn(8192, 4, generator=gen), torch.randn(4, 128, generator=gen) / 2
    scores = torch.sigmoid(3.0 * X @ W + 0.5 * torch.randn(128, generator=gen))
    mv = lambda b: load_stats(expert_counts(torch.topk(scores + b, 8, dim=-1).indices, 128))["maxvio"]
    for n in (4, 8):
        plain = mv(quantile_bias(scores, torch.zeros(128), 8, n, anderson=False))
        fast = mv(quantile_bias(scores, torch.zeros(128), 8, n, anderson=True))
        assert fast < plain, (n, fast, plain)
    assert make_balancer(MoEConfig(quantile_anderson=False)).anderson is False     # the key reaches the solve


def _combine_both_ways(y0, w0, g, order, rank):
    "(out, dy, dw) of _Combine and of the two-step combine it replaced (gather to token order, weighted_slot_sum)."
    from moe_book.layers.moe import _Combine, weighted_slot_sum
    N, k = w0.shape
    outs = []
    for fused_path in (True, False):
        y, w = y0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = _Combine.apply(y, order, rank, w) if fused_path else \
            weighted_slot_sum.eager(y.index_select(0, rank).view(N, k, -1), w)
        out.backward(g)
        outs.append((out, y.grad, w.grad))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_equals_gather_then_weighted_sum(dtype):
    """_Combine (chapter 05) is the old two-step combine — gather the expert-ordered rows back to (token, slot) order,
    then weighted_slot_sum — in one step each way: the same output and gradients, bit for bit on the CPU (the same
    fp32 products and sums in the same order)."""
    gen = torch.Generator().manual_seed(0)
    N, k, d = 37, 4, 24
    flat = torch.randint(0, 6, (N * k,), generator=gen)
    order = torch.sort(flat, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(N * k))
    y0 = torch.randn(N * k, d, generator=gen).to(dtype)
    w0 = torch.rand(N, k, generator=gen)
    g = torch.randn(N, d, generator=gen).to(dtype)
    outs = _combine_both_ways(y0, w0, g, order, rank)
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_combine_matches_eager():
    """On CUDA the combine's forward and backward are compiled (one gather-and-reduce kernel each); fp32 rows: the
    same values up to the order of fp32 sums over k = 8 slots and d = 512 columns (rtol, atol 1e-5)."""
    gen = torch.Generator().manual_seed(0)
    N, k, d = 4096, 8, 512
    order = torch.sort(torch.randint(0, 128, (N * k,), generator=gen), stable=True).indices.cuda()
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(N * k, device="cuda"))
    y0, w0 = torch.randn(N * k, d, generator=gen).cuda(), torch.rand(N, k, generator=gen).cuda()
    g = torch.randn(N, d, generator=gen).cuda()
    outs = _combine_both_ways(y0, w0, g, order, rank)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_selection_jitter_is_a_fixed_uniform_tie_breaker():
    from moe_book.layers.moe import selection_jitter
    a, b = selection_jitter(4096, 64, 1e-2, "cpu"), selection_jitter(4096, 64, 1e-2, "cpu")
    assert a.shape == (4096, 64) and a.dtype == torch.float32 and torch.equal(a, b)   # same numbers every call
    assert 0 <= a.min() and a.max() < 1e-2
    assert abs(a.mean().item() - 5e-3) < 1e-4 and abs(a.std().item() - 1e-2 / 12 ** 0.5) < 1e-4   # uniform
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[:, 0], a[:, 1])          # rows and experts differ


def test_jitter_lets_the_solve_split_identical_tokens():
    """1000 copies of one token among 7192 others (each expert's share is 512): no bias can split identical rows,
    so the quantile solve cannot balance them (8 solves left MaxVio 1.58 when written); with a tie-breaker of 3e-2
    on the scores that pick, it can (0.047; 1e-2 needs ~32 solves). The combine weights stay the scores' own."""
    from moe_book.layers.moe import selection_jitter
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(8192, 16, generator=gen)
    X[:1000] = X[0]
    scores = torch.sigmoid(3.0 * X @ (torch.randn(16, 128, generator=gen) / 4) + 0.5 * torch.randn(128, generator=gen))
    jit = selection_jitter(8192, 128, 3e-2, "cpu")
    mv = lambda s, b: load_stats(expert_counts(torch.topk(s + b, 8, dim=-1).indices, 128))["maxvio"]
    assert mv(scores, quantile_bias(scores, torch.zeros(128), 8, 8)) > 1.0
    assert mv(scores + jit, quantile_bias(scores + jit, torch.zeros(128), 8, 8)) < 0.1
    router = Router(16, 128, 8)
    idx, w = router.select(scores, torch.zeros(128), jit)
    picked = scores.gather(1, idx)
    assert torch.equal(w, picked / picked.sum(-1, keepdim=True))


def test_jitter_only_in_training_forwards():
    "The tie-breaker picks experts in training forwards only; evaluation routes by scores + stored bias."
    cfg = tiny_config(["model.moe.selection_jitter=0.5"]).model
    layer = LatentMoE(cfg, layer=1)
    x = torch.randn(64, cfg.d_model)
    seen = []
    orig = layer.router.select
    layer.router.select = lambda s, b=None, j=None: seen.append(j) or orig(s, b, j)
    layer.train()
    layer(x)
    layer.eval()
    with torch.no_grad():
        layer(x)
    assert seen[0] is not None and seen[0].shape == (64, cfg.moe.n_experts) and seen[1] is None
    with pytest.raises(ConfigError, match="selection_jitter"):
        tiny_config(["model.moe.selection_jitter=1.5"])
