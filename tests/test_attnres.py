"""Chapter 04: Attention Residuals. Full AttnRes (reference) vs Block AttnRes, the documented init and normalisation,
gradients, memory, and the model with every mixer that exists."""
import importlib

import pytest
import torch

from moe_book.config import get_config
from moe_book.layers.attnres import AttnRes, BlockAttnRes, rms_normalize
from moe_book.model import CausalLM, MIXERS, PlainResidual

# The tiny preset now runs every piece (MoE, Block AttnRes); these tests study the residual alone, so they start
# from tiny with a dense feed-forward and a plain residual and add only what each test names.
BASE = ["model.ffn=mlp", "model.first_dense=0", "model.residual=plain"]


def tiny_config(overrides=()):
    return get_config("tiny", BASE + list(overrides))


def model_cfg(n_layers=4, d=16, block=2, eps=1e-6, **kw):
    over = [f"model.n_layers={n_layers}", f"model.d_model={d}", f"model.attnres_block={block}", f"model.norm_eps={eps}"]
    return tiny_config(over + [f"model.{k}={v}" for k, v in kw.items()]).model


def drive(res, e, outs):
    "The model's residual protocol with given sublayer outputs: (reads, end, most state vectors held)."
    state, reads, most = res.begin(e), [], 1
    for i, o in enumerate(outs):
        reads.append(res.read(state, i))
        state = res.write(state, i, o)
        if hasattr(res, "state_vectors"):
            most = max(most, res.state_vectors(state))
    return reads, res.end(state), most


def randomize(res, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in res.queries:
            q.copy_(torch.randn(q.shape, generator=g, dtype=q.dtype) * scale)
    return res


def inputs(n_sub, B=2, T=5, d=16, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(B, T, d, generator=g, dtype=dtype).requires_grad_(requires_grad)
    outs = [(torch.randn(B, T, d, generator=g, dtype=dtype) * (1 + i)).requires_grad_(requires_grad) for i in range(n_sub)]
    return e, outs


@pytest.mark.parametrize("two_phase", [False, True])
def test_zero_queries_give_uniform_mean(two_phase):
    cfg = model_cfg()
    e, outs = inputs(8)
    full = AttnRes(cfg).double()
    full.queries[3].data.fill_(1.0)
    full.init_weights()                     # the hook zeroes them again
    reads, end, _ = drive(full, e, outs)
    for k, h in enumerate(reads + [end]):
        torch.testing.assert_close(h, torch.stack([e] + outs[:k]).mean(0), rtol=0, atol=1e-13)
    for S in (1, 2, 3, 4, 8):
        blk = BlockAttnRes(cfg, block_sublayers=S, two_phase=two_phase).double()
        reads, end, _ = drive(blk, e, outs)
        for k, h in enumerate(reads + [end]):
            done = [e] + [sum(outs[j:j + S]) for j in range(0, S * (k // S), S)]
            part = outs[S * (k // S):k]
            want = torch.stack(done + ([sum(part)] if part else [])).mean(0)
            torch.testing.assert_close(h, want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("two_phase", [False, True])
@pytest.mark.parametrize("n_layers", [1, 3, 4])
def test_block_size_one_sublayer_is_full_attnres(n_layers, two_phase):
    cfg = model_cfg(n_layers=n_layers)
    e, outs = inputs(2 * n_layers, seed=n_layers)
    full = randomize(AttnRes(cfg).double(), seed=1)
    blk = BlockAttnRes(cfg, block_sublayers=1, two_phase=two_phase).double()
    blk.load_state_dict(full.state_dict())
    rf, ef, mf = drive(full, e, outs)
    rb, eb, mb = drive(blk, e, outs)
    for a, b in zip(rf + [ef], rb + [eb]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert mf == mb == 2 * n_layers + 1


def test_block_size_one_in_the_model_matches_full_attnres():
    torch.manual_seed(0)
    cfg = model_cfg(d=32, n_heads=2, vocab_size=256, residual="attnres")
    m_full = CausalLM(cfg)
    randomize(m_full.residual, seed=5, scale=0.3)
    m_blk = CausalLM(cfg)
    m_blk.residual = BlockAttnRes(cfg, block_sublayers=1)
    m_blk.load_state_dict(m_full.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        a, b = m_full(idx)[0], m_blk(idx)[0]
    assert ((a - b).norm() / a.norm()).item() < 1e-5


@pytest.mark.parametrize("two_phase", [False, True])
def test_one_block_over_whole_depth_is_plain_up_to_half(two_phase):
    "Documented normalisation: with zero queries read k = x_k / 2 (k >= 1), read 0 = e, end = x_2L / 2."
    cfg = model_cfg(n_layers=3)
    e, outs = inputs(6)
    for S in (6, 7, 100):                  # any block at least as long as the depth
        one = BlockAttnRes(cfg, block_sublayers=S, two_phase=two_phase).double()
        r1, e1, most = drive(one, e, outs)
        rp, ep, _ = drive(PlainResidual(cfg), e, outs)
        torch.testing.assert_close(r1[0], rp[0], rtol=0, atol=0)
        for a, b in zip(r1[1:] + [e1], rp[1:] + [ep]):
            torch.testing.assert_close(a, b / 2, rtol=0, atol=1e-13)
        assert most == 2
    # with learned queries: a per-token gate between the embedding and the running sum of outputs
    randomize(one, seed=2)
    r1, _, _ = drive(one, e, outs)
    for k in range(1, 6):
        p = sum(outs[:k])
        a = torch.sigmoid((rms_normalize(e, cfg.norm_eps) - rms_normalize(p, cfg.norm_eps)) @ one.query(k))[..., None]
        torch.testing.assert_close(r1[k], a * e + (1 - a) * p, rtol=0, atol=1e-12)


def test_one_block_model_equals_plain_model_with_eps_zero():
    over = ["model.d_model=64", "model.n_heads=2", "model.norm_eps=0", "model.vocab_size=512"]
    torch.manual_seed(0)
    m_plain = CausalLM(tiny_config(over).model)
    m_one = CausalLM(tiny_config(over + ["model.residual=block_attnres", "model.attnres_block=4"]).model)
    missing, unexpected = m_one.load_state_dict(m_plain.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("residual.queries") for k in missing)
    idx = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        lp, lo = m_plain(idx)[0], m_one(idx)[0]
    assert ((lp - lo).norm() / lp.norm()).item() < 1e-5


@pytest.mark.parametrize("kind", ["block2", "block3", "block2_two_phase", "block3_two_phase", "full"])
def test_gradcheck_reads_and_output(kind):
    cfg = model_cfg(n_layers=2, d=6)
    res = {"block2": lambda: BlockAttnRes(cfg, block_sublayers=2), "block3": lambda: BlockAttnRes(cfg, block_sublayers=3),
           "block2_two_phase": lambda: BlockAttnRes(cfg, block_sublayers=2, two_phase=True),
           "block3_two_phase": lambda: BlockAttnRes(cfg, block_sublayers=3, two_phase=True),
           "full": lambda: AttnRes(cfg)}[kind]().double()
    randomize(res, seed=3)
    e, outs = inputs(4, B=1, T=3, d=6, requires_grad=True)
    qs = [q.detach().clone().requires_grad_() for q in res.queries]
    params = list(res.queries)

    def run(e, *args):
        for k, q in enumerate(args[:len(qs)]):
            res.queries._parameters[str(k)] = q
        try:
            reads, end, _ = drive(res, e, list(args[len(qs):]))
            return torch.stack(reads + [end])
        finally:
            for k, p in enumerate(params):
                res.queries._parameters[str(k)] = p

    assert torch.autograd.gradcheck(run, (e, *qs, *outs), fast_mode=True)


@pytest.mark.parametrize("residual", ["block_attnres", "attnres"])
def test_gradients_reach_every_pseudo_query(residual):
    torch.manual_seed(0)
    model = CausalLM(tiny_config(["model.d_model=64", "model.n_heads=2", "model.vocab_size=512",
                                  f"model.residual={residual}", "model.attnres_block=1"]).model)
    assert len(model.residual.queries) == 2 * model.cfg.n_layers
    assert all((q == 0).all() for q in model.residual.queries)   # zero init through the init_weights hook
    idx = torch.randint(0, 512, (2, 32))

    def grads():
        model.zero_grad()
        model(idx, idx)[1].backward()
        return torch.stack([q.grad.norm() for q in model.residual.queries])

    g0 = grads()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    assert all((q != 0).all() for q in model.residual.queries)   # the step moved every query off zero
    g1 = grads()
    assert (g0 > 0).all() and (g1 > 0).all()


def test_pseudo_queries_are_vectors_so_no_weight_decay():
    model = CausalLM(tiny_config(["model.residual=block_attnres"]).model)
    assert all(q.dim() == 1 for q in model.residual.queries)     # the trainer decays p.dim() >= 2 only


def test_state_grows_with_blocks_not_layers():
    for L in (2, 4, 8, 16):
        cfg = model_cfg(n_layers=L, d=8)
        e, outs = inputs(2 * L, d=8, dtype=torch.float32)
        for n_blocks in (1, 2):
            blk = BlockAttnRes(cfg, block_sublayers=2 * L // n_blocks)
            assert blk.n_blocks == n_blocks
            assert drive(blk, e, outs)[2] == n_blocks + 1
        assert drive(AttnRes(cfg), e, outs)[2] == 2 * L + 1


def _saved_state_bytes_at_block_boundaries(res, e, outs):
    """Bytes of distinct storage referenced by the residual state whenever a block closes: what a layer-checkpointed
    model keeps between blocks, or a pipeline stage sends on."""
    most, state = 0, res.begin(e)
    for i, o in enumerate(outs):
        res.read(state, i)
        state = res.write(state, i, o)
        tensors = state if isinstance(state, list) else [*state.blocks] + ([state.partial] if state.partial is not None else [])
        most = max(most, sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()))
    return most


def test_saved_tensor_bytes_grow_with_blocks_not_layers():
    """What the depth mixing saves for the backward beyond per-sublayer activations: the completed blocks, each saved
    once as the tensor the state holds (#blocks + 1 of them at every depth), and never a stacked copy of them."""
    for L in (4, 8, 16):
        cfg = model_cfg(n_layers=L, d=64)
        e, outs = inputs(2 * L, B=2, T=4, d=64, dtype=torch.float32, requires_grad=True)
        for two_phase in (False, True):
            blk = BlockAttnRes(cfg, block_sublayers=L, two_phase=two_phase)          # 2 blocks at every depth
            saved = {}

            def pack(t):
                if t.dim() >= 3:               # activations, not the (d, Q) stack of queries
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            state = blk.begin(e)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                for i, o in enumerate(outs):
                    blk.read(state, i)
                    state = blk.write(state, i, o)
                blk.end(state)
            blocks = {b.untyped_storage().data_ptr() for b in state.blocks}
            assert len(blocks) == blk.n_blocks + 1 == 3 and blocks <= saved.keys()
            assert max(saved.values()) <= e.numel() * 4 * (blk.block_sublayers + 1)     # no (B, T, n, d) stack...
            if not two_phase:
                assert max(saved.values()) == e.numel() * 4                            # ... nor anything over one vector
        assert _saved_state_bytes_at_block_boundaries(blk, e, outs) == 3 * e.numel() * 4     # e + 2 blocks
        assert _saved_state_bytes_at_block_boundaries(AttnRes(cfg), e, outs) == (2 * L + 1) * e.numel() * 4


def test_bad_block_size_is_a_clear_error():
    with pytest.raises(ValueError, match="block_sublayers"):
        BlockAttnRes(model_cfg(), block_sublayers=0)


def test_out_of_order_calls_are_a_clear_error():
    cfg = model_cfg()
    e, outs = inputs(8, dtype=torch.float32)
    for res in (BlockAttnRes(cfg), AttnRes(cfg)):
        state = res.begin(e)
        with pytest.raises(ValueError, match="out of order"):
            res.read(state, 1)
        state = res.write(state, 0, outs[0])
        with pytest.raises(ValueError, match="out of order"):
            res.end(state)


def test_depth_weights_are_recorded():
    torch.manual_seed(0)
    model = CausalLM(tiny_config(["model.d_model=32", "model.n_heads=2", "model.vocab_size=256",
                                  "model.residual=block_attnres", "model.attnres_block=1"]).model)
    model.residual.record = True
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 16)))
    W = model.residual.depth_weights()
    assert W.shape == (2 * 4 + 1, 4 + 1)                    # readers x (embedding + 4 blocks)
    rows = torch.nan_to_num(W).sum(1)
    torch.testing.assert_close(rows, torch.ones_like(rows))  # each reader's weights sum to 1


def _mixer_available(name):
    module, cls = MIXERS[name][0].split(":")
    try:
        return hasattr(importlib.import_module(module), cls)
    except ImportError:
        return False


@pytest.mark.parametrize("residual", ["block_attnres", "attnres"])
@pytest.mark.parametrize("mixer", ["attn", "kda", "mla"])
def test_model_forward_backward_with_every_mixer(mixer, residual):
    if not _mixer_available(mixer):
        pytest.skip(f"mixer {mixer!r} is not exported yet")
    torch.manual_seed(0)
    cfg = tiny_config([f"model.residual={residual}", f"model.mixer={mixer}", f"model.global_mixer={mixer}"]).model
    model = CausalLM(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 64))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 64, cfg.vocab_size) and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(q.grad.norm() > 0 for q in model.residual.queries)


def test_block_attnres_under_bf16_autocast_keeps_fp32_stream():
    torch.manual_seed(0)
    cfg = tiny_config(["model.residual=block_attnres", "model.attnres_block=1", "model.d_model=32",
                       "model.n_heads=2", "model.vocab_size=256"]).model
    model = CausalLM(cfg)
    res, seen = model.residual, []
    read = res.read

    def spy(state, i):
        h = read(state, i)
        seen.append(h.dtype)
        return h
    res.read = spy
    idx = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    assert set(seen) == {torch.float32} and torch.isfinite(loss)
    assert all(q.grad is not None and q.grad.dtype == torch.float32 for q in res.queries)


def test_fusable_mix_equals_eager_mix():
    "block_mix_fusable (what torch.compile fuses on the GPU) is the same math as the eager block_mix."
    from moe_book.layers.attnres import block_mix, block_mix_fusable
    g = torch.Generator().manual_seed(0)
    for n in (1, 3):
        for partial in (None, torch.randn(2, 5, 8, generator=g, dtype=torch.float64)):
            s = torch.randn(2, 5, n, generator=g, dtype=torch.float64)
            blocks = [torch.randn(2, 5, 8, generator=g, dtype=torch.float64) for _ in range(n)]
            w = torch.randn(8, generator=g, dtype=torch.float64)
            for a, b in zip(block_mix(s, blocks, partial, w, 1e-6), block_mix_fusable(s, blocks, partial, w, 1e-6)):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_fusable_open_mixes_equal_eager_open_mixes():
    "block_open_mixes_fusable (the unrolled sum torch.compile fuses on the GPU) is the same math as the batched matmul."
    from moe_book.layers.attnres import block_open_mixes, block_open_mixes_fusable
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5):
        logits = torch.randn(2, 5, n, 4, generator=g, dtype=torch.float64)
        blocks = [torch.randn(2, 5, 8, generator=g, dtype=torch.float64) for _ in range(n)]
        for a, b in zip(block_open_mixes(logits, blocks), block_open_mixes_fusable(logits, blocks)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("two_phase", [False, True])
def test_fused_read_path_matches_eager_on_cuda(two_phase):
    """The compiled depth mixing (one read at a time, or two-phase) against the eager one, on CUDA. Attention mixers
    and fp32 keep everything around the residual deterministic and exact up to summation order, so what is compared
    is the fusion alone: fp32 reductions in another order agree to ~1e-6 relative, and 1e-4 leaves room for the
    growth through 4 layers and the backward. (Under bf16 autocast the downstream bf16 matmuls round differently
    for the two paths, ~4e-3 per element, which says nothing about the fusion.) The mixes are kept in fp32 here: their
    bf16 storage, the GPU default, is a rounding of its own (tests/test_attnres_kernels.py bounds it)."""
    torch.manual_seed(0)
    cfg = tiny_config(["model.residual=block_attnres", "model.attnres_block=1", "model.mixer=attn",
                       "model.global_mixer=attn"]).model
    model = CausalLM(cfg).cuda()
    model.residual.mix_dtype = torch.float32
    randomize(model.residual, seed=1, scale=0.5)
    idx = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    out = {}
    for fused in (False, True):
        model.residual.fused = fused
        model.residual.two_phase = two_phase and fused     # reference: eager, one read at a time
        model.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        out[fused] = (loss.detach(), [q.grad.clone() for q in model.residual.queries],
                      [p.grad.clone() for p in model.layers[0].parameters()])
    (l0, q0, p0), (l1, q1, p1) = out[False], out[True]
    torch.testing.assert_close(l0, l1, rtol=1e-5, atol=0)
    for a, b in zip(q0 + p0, q1 + p1):
        assert ((a - b).norm() / a.norm().clamp_min(1e-12)).item() < 1e-4


@pytest.mark.parametrize("S", [1, 2, 3, 4, 8])
def test_two_phase_equals_one_read_at_a_time(S):
    "Precomputing each block's mixes when it opens and merging the partial later is the same softmax."
    cfg = model_cfg()
    e, outs = inputs(8, seed=S)
    a = randomize(BlockAttnRes(cfg, block_sublayers=S, two_phase=False).double(), seed=S)
    b = BlockAttnRes(cfg, block_sublayers=S, two_phase=True).double()
    b.load_state_dict(a.state_dict())
    a.record = b.record = True
    ra, ea, ma = drive(a, e, outs)
    rb, eb, mb = drive(b, e, outs)
    for x, y in zip(ra + [ea], rb + [eb]):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
    torch.testing.assert_close(a.depth_weights(), b.depth_weights(), rtol=0, atol=1e-12, equal_nan=True)
    assert ma == mb == a.n_blocks + 1                   # the carried state is the same; the cache is extra
    assert b.cache_vectors(b.begin(e)) == 0            # the first block's mixes are views of the embedding
    state = b.begin(e)
    for i in range(S):
        state = b.write(state, i, outs[i])
    assert b.cache_vectors(state) == min(S, len(outs) + 1 - S)   # one mix per reader of the second block
    assert a.cache_vectors(a.begin(e)) == 0


def test_two_phase_in_the_model_matches_and_trains():
    torch.manual_seed(0)
    cfg = tiny_config(["model.d_model=32", "model.n_heads=2", "model.vocab_size=256", "model.mixer=attn",
                       "model.global_mixer=attn", "model.residual=block_attnres", "model.attnres_block=1"]).model
    model = CausalLM(cfg)
    randomize(model.residual, seed=4, scale=0.3)
    idx = torch.randint(0, 256, (2, 16))
    out = {}
    for two_phase in (False, True):
        model.residual.two_phase = two_phase
        model.zero_grad()
        logits, loss = model(idx, idx)
        loss.backward()
        out[two_phase] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(out[False][0], out[True][0], rtol=1e-5, atol=1e-5)
    for ga, gb in zip(out[False][1], out[True][1]):
        assert ((ga - gb).norm() / ga.norm().clamp_min(1e-12)).item() < 1e-4


def test_fused_code_path_with_merge_and_norm_in_one_function(monkeypatch):
    """The CUDA path's Python (two-phase, the partial merged and the pre-norm applied by merge_partial_normed through
    read_normed) run on the CPU with torch.compile replaced by the eager function: the same logits, gradients and
    recorded depth weights as the eager one-read-at-a-time path. fp64, so only summation order differs."""
    import moe_book.layers.attnres as attnres
    monkeypatch.setattr(attnres, "compiled", lambda fn: fn)
    calls = []
    merge_normed = attnres.merge_partial_normed
    monkeypatch.setattr(attnres, "merge_partial_normed", lambda *a: calls.append(1) or merge_normed(*a))
    torch.manual_seed(0)
    cfg = tiny_config(["model.d_model=32", "model.n_heads=2", "model.vocab_size=256", "model.mixer=attn",
                       "model.global_mixer=attn", "model.residual=block_attnres", "model.attnres_block=1"]).model
    model = CausalLM(cfg).double()
    randomize(model.residual, seed=5, scale=0.3)
    idx = torch.randint(0, 256, (2, 16))
    out = {}
    for fused in (False, True):
        model.residual.fused = model.residual.two_phase = fused
        model.residual.record = True
        model.zero_grad()
        logits, loss = model(idx, idx)
        loss.backward()
        out[fused] = (logits.detach(), [p.grad.clone() for p in model.parameters()], model.residual.depth_weights())
    # attnres_block=1: blocks of 2 sublayers, so sublayers 1, 3, 5, ... merge their block's partial sum
    assert len(calls) == cfg.n_layers
    torch.testing.assert_close(out[False][0], out[True][0], rtol=0, atol=1e-10)
    for ga, gb in zip(out[False][1], out[True][1]):
        torch.testing.assert_close(ga, gb, rtol=0, atol=1e-10)
    torch.testing.assert_close(out[False][2], out[True][2], rtol=0, atol=1e-12, equal_nan=True)
