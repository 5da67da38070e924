"""Chapter 03: Gated MLA (absorbed decode == expanded attention), the hybrid stack's incremental generation, cache
accounting and cache misuse errors, and the decode benchmark at toy size on CPU."""
import importlib.util
import json

import pytest
import torch

from moe_book.config import ConfigError, get_config
from moe_book.generate import cache_nbytes, generate, new_caches, sample_next
from moe_book.layers.mla import GatedMLA, MLACache, gated_mla_reference
from moe_book.model import CausalLM

HAVE_KDA = importlib.util.find_spec("moe_book.layers.kda") is not None
needs_kda = pytest.mark.skipif(not HAVE_KDA, reason="moe_book/layers/kda.py (chapter 01) is not exported yet; "
                                                    "the hybrid tests need model.mixer=kda")
HYBRID = ["model.mixer=kda", "model.global_mixer=mla"]
ALL_MLA = ["model.mixer=mla", "model.global_mixer=mla"]
POSITIONAL = {"no decoupled part": ["model.mla.qk_rope=0"],
              "NoPE decoupled part": ["model.mla.qk_rope=16"],
              "RoPE decoupled part": ["model.mla.qk_rope=16", "model.mla.rope=true"]}
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def rms_rel(a, b):
    return ((a - b).double().norm() / b.double().norm()).item()


def mla_layer(overrides=(), dtype=torch.float64, layer=3, std=0.1):
    "A layer with weights larger than the init, so every term (gate, rope part, q_lora) matters in the output."
    m = GatedMLA(get_config("tiny", list(overrides)).model, layer).to(dtype)
    torch.manual_seed(1)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0.0, std)
    return m


# ---------------------------------------------------------------------------------------- the layer, two paths
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("positional", list(POSITIONAL))
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
def test_absorbed_decode_equals_expanded_at_every_position(gate, positional, dtype):
    m = mla_layer([f"model.mla.gate={gate}", *POSITIONAL[positional]], dtype)
    torch.manual_seed(2)
    x = torch.randn(2, 20, 128, dtype=dtype)
    with torch.no_grad():
        full = m(x)                                          # expanded K/V + SDPA
        cache = m.new_cache(2, 20)
        steps = [m(x[:, t:t + 1], cache=cache) for t in range(20)]   # absorbed, from an empty cache
    for t, y in enumerate(steps):
        assert rms_rel(y[:, 0], full[:, t]) < TOL[dtype], f"position {t}"


@pytest.mark.parametrize("q_lora", [0, 24])
@pytest.mark.parametrize("positional", list(POSITIONAL))
def test_expanded_equals_readable_reference(positional, q_lora):
    m = mla_layer(["model.mla.gate=channel", f"model.mla.q_lora={q_lora}", *POSITIONAL[positional]])
    x = torch.randn(2, 17, 128, dtype=torch.float64)
    with torch.no_grad():
        assert rms_rel(m(x), gated_mla_reference(m, x)) < 1e-10


def test_absorbed_and_expanded_agree_on_whole_sequences_with_offsets():
    "Both attention paths called directly, for a query block that starts in the middle of the context."
    m = mla_layer(["model.mla.rope=true", "model.mla.gate=head"])
    x = torch.randn(2, 16, 128, dtype=torch.float64)
    with torch.no_grad():
        q_nope, q_rope = m.queries(x[:, 9:])
        c_kv, k_rope = m.latents(x)
        a = m.attend_expanded(q_nope, q_rope, c_kv, k_rope, offset=9)
        b = m.attend_absorbed(q_nope, q_rope, c_kv, k_rope, offset=9)
    assert rms_rel(b, a) < 1e-10


def test_chunked_prefill_then_decode_equals_full_forward():
    m = mla_layer(["model.mla.rope=true", "model.mla.q_lora=24"])
    x = torch.randn(3, 24, 128, dtype=torch.float64)
    cache = m.new_cache(3, 24)
    bounds = [0, 5, 6, 9, 13, 14, 24]
    with torch.no_grad():
        chunked = torch.cat([m(x[:, a:b], cache=cache) for a, b in zip(bounds, bounds[1:])], dim=1)
        assert rms_rel(chunked, m(x)) < 1e-10
    assert cache.pos == 24


def test_gate_variants_shapes_and_recording():
    for gate, width in (("head", 4), ("channel", 4 * 32)):
        m = mla_layer([f"model.mla.gate={gate}"], torch.float32)
        m.record_gate = True
        m(torch.randn(2, 5, 128))
        assert m.last_gate.shape == (2, 5, width) and 0 <= m.last_gate.min() and m.last_gate.max() <= 1
    assert mla_layer(["model.mla.gate=none"]).gate_proj is None


def test_rope_without_positional_part_is_a_config_error():
    with pytest.raises(ConfigError, match="qk_rope"):
        GatedMLA(get_config("tiny", ["model.mla.rope=true", "model.mla.qk_rope=0"]).model, 3)


# -------------------------------------------------------------------------------------- caches: size and errors
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cache_size_matches_formula(dtype):
    cfg = get_config("small", ALL_MLA).model
    m = GatedMLA(cfg, 3)
    cache = m.new_cache(batch_size=3, max_len=1000, dtype=dtype)
    per_token = (cfg.mla.kv_lora + cfg.mla.qk_rope) * torch.empty((), dtype=dtype).element_size()
    assert m.cache_bytes_per_token(dtype) == per_token
    assert cache.nbytes == cache_nbytes(cache) == 3 * 1000 * per_token
    mha = 2 * cfg.n_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    assert per_token / mha == pytest.approx((256 + 32) / (2 * 8 * 128))    # the chapter's table: 0.14 of MHA


@needs_kda
def test_hybrid_cache_accounting():
    """MLA layers grow linearly with max_len by the formula; KDA layers do not grow at all."""
    cfg = get_config("tiny", HYBRID).model
    model = CausalLM(cfg)
    short, long = new_caches(model, 2, 16), new_caches(model, 2, 1040)
    for i, (a, b) in enumerate(zip(short, long)):
        if cfg.mixer_of(i) == "mla":
            per_token = model.layers[i].mixer.cache_bytes_per_token(torch.float32)
            assert cache_nbytes(a) == 2 * 16 * per_token and cache_nbytes(b) == 2 * 1040 * per_token
        else:
            assert cache_nbytes(a) == cache_nbytes(b) > 0
    assert cache_nbytes(long) - cache_nbytes(short) == 2 * (1040 - 16) * 4 * (64 + 16)


def test_decode_beyond_max_len_is_a_clear_error():
    m = mla_layer()
    cache = m.new_cache(1, 6)
    x = torch.randn(1, 7, 128, dtype=torch.float64)
    m(x[:, :5], cache=cache)
    m(x[:, 5:6], cache=cache)
    with pytest.raises(ValueError, match=r"beyond the cache.*max_len=6"):
        m(x[:, 6:7], cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        m(x, cache=m.new_cache(1, 6))                       # a prefill that does not fit


def test_cache_of_another_layer_config_or_type_is_a_clear_error():
    m = mla_layer(layer=3)
    x = torch.randn(2, 1, 128, dtype=torch.float64)
    with pytest.raises(ValueError, match="different config or layer"):
        m(x, cache=mla_layer(layer=7).new_cache(2, 8))
    with pytest.raises(ValueError, match="different config or layer"):
        m(x, cache=mla_layer(["model.mla.kv_lora=32"], layer=3).new_cache(2, 8))
    with pytest.raises(ValueError, match="was given a dict"):
        m(x, cache={"c_kv": None})
    with pytest.raises(ValueError, match="batch_size=3"):
        m(x, cache=m.new_cache(3, 8))
    if HAVE_KDA:
        kda_model = CausalLM(get_config("tiny", HYBRID).model)
        with pytest.raises(ValueError, match="KDACache"):
            m(x, cache=new_caches(kda_model, 2, 8)[0])


class NoCacheMixer(torch.nn.Module):
    "A mixer that can run a full forward but offers no decode cache (like the chapter-00 attention baseline)."
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_mixers_without_a_cache_get_a_clear_error():
    model = CausalLM(get_config("tiny", ALL_MLA).model)
    model.layers[1].mixer = NoCacheMixer(model.layers[1].mixer)
    with pytest.raises(ValueError, match="layer 1 .*no decode cache.*use_cache=False"):
        generate(model, [1, 2, 3], max_new_tokens=2)
    out = generate(model, [1, 2, 3], max_new_tokens=2, temperature=0, use_cache=False)   # the fallback works
    assert len(out.new_tokens[0]) == 2


# ------------------------------------------------------------------------------------------ hybrid generation
def _check_incremental_equals_full(overrides, dtype, tol):
    torch.manual_seed(0)
    model = CausalLM(get_config("tiny", overrides).model).to(dtype)
    # rows cross the prefill/decode boundary at different steps: the common prefix is 4 tokens
    prompts = [torch.randint(0, 4096, (n,)).tolist() for n in (9, 4, 6)]
    gen = generate(model, prompts, max_new_tokens=7, temperature=1.0, top_p=0.9, seed=3, return_logits=True)
    assert [len(s) for s in gen.sequences] == [16, 11, 13]
    with torch.no_grad():
        for b, seq in enumerate(gen.sequences):
            full = model(torch.tensor([seq[:-1]]))[0][0]
            assert gen.logits[b].shape == full.shape
            for t in range(full.shape[0]):                   # every step, prompt positions included
                assert rms_rel(gen.logits[b][t], full[t]) < tol, f"row {b} position {t}"


@needs_kda
def test_hybrid_incremental_logits_equal_full_forward():
    _check_incremental_equals_full(HYBRID, torch.float32, TOL[torch.float32])


def test_all_mla_incremental_logits_equal_full_forward_fp64():
    _check_incremental_equals_full(ALL_MLA + ["model.mla.rope=true"], torch.float64, TOL[torch.float64])


@needs_kda
def test_hybrid_greedy_with_cache_equals_recompute_and_batch_equals_single():
    torch.manual_seed(0)
    model = CausalLM(get_config("tiny", HYBRID).model)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [42, 43], [7, 7, 7, 7]]
    cached = generate(model, prompts, max_new_tokens=4, temperature=0)
    recomputed = generate(model, prompts, max_new_tokens=4, temperature=0, use_cache=False)
    alone = [generate(model, [p], max_new_tokens=4, temperature=0).sequences[0] for p in prompts]
    assert cached.sequences == recomputed.sequences == alone


def test_stop_tokens_and_finish_reasons():
    torch.manual_seed(0)
    model = CausalLM(get_config("tiny", ALL_MLA).model)
    first = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=5, temperature=0)
    stop = first.new_tokens[0][2]
    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=5, temperature=0, stop_tokens=[stop])
    assert out.new_tokens[0] == first.new_tokens[0][:first.new_tokens[0].index(stop) + 1]
    assert out.finish_reason[0] == "stop"
    assert out.new_tokens[1] == first.new_tokens[1][:len(out.new_tokens[1])]


def test_sampling_settings():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    assert sample_next(logits, temperature=0).item() == 1
    g = torch.Generator().manual_seed(0)
    # top_p smaller than the best token's probability keeps only that token; top_k=2 never picks tokens 0 or 2
    assert all(sample_next(logits, 1.0, top_p=0.05, generator=g).item() == 1 for _ in range(20))
    assert {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(50)} <= {1, 3}
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, top_p=0.0)
    model = CausalLM(get_config("tiny", ALL_MLA).model)
    a = generate(model, [1, 2], max_new_tokens=4, seed=11).new_tokens
    assert a == generate(model, [1, 2], max_new_tokens=4, seed=11).new_tokens   # seeded sampling is reproducible
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], max_new_tokens=2)


# --------------------------------------------------------------------------------------------- GPU benchmark
def test_decode_bench_runs_at_toy_size(tmp_path):
    from moe_book.bench.decode import main
    stacks = HYBRID if HAVE_KDA else ALL_MLA
    out = tmp_path / "bench_decode.json"
    res = main(["--preset", "tiny", "--contexts", "32,96", "--batches", "2", "--steps", "1", "--warmup", "1",
                "--out", str(out)] + ([] if HAVE_KDA else ["model.mixer=mla"]))
    saved = json.loads(out.read_text())
    assert saved["summary"]["hybrid_over_all_mla_tokens_per_s"].keys() == {"ctx_32", "ctx_96"}
    assert (tmp_path / "bench_decode.png").exists()
    rows = {(r["stack"], r["batch"], r["ctx"]): r for r in res["rows"]}
    mla = GatedMLA(get_config("tiny", stacks).model, 3)
    # the all-MLA cache holds 4 layers of latents, the hybrid 1 (+ fixed KDA states)
    per_layer = 2 * (96 + 2) * mla.cache_bytes_per_token(torch.float32)
    assert rows[("all_mla", 2, 96)]["mla_cache_bytes"] == 4 * per_layer
    if HAVE_KDA:
        assert rows[("hybrid", 2, 96)]["mla_cache_bytes"] == per_layer


@pytest.mark.gpu
def test_absorbed_decode_bf16_on_gpu():
    m = mla_layer(["model.mla.rope=true"], torch.bfloat16, std=0.05).cuda()
    x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        full, cache = m(x), m.new_cache(4, 64)
        dec = torch.cat([m(x[:, t:t + 1], cache=cache) for t in range(64)], dim=1)
    assert rms_rel(dec, full) < 2e-2   # bf16 rounding of scores and latents
