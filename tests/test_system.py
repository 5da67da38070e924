"""Chapter 09: safetensors export (round trip, tied embeddings, every mismatch refused by name), loading an export
for generation, the system benchmark's plumbing at toy size (ours; HF when transformers is installed), and the
long-sequence benchmark's activation checkpointing (same loss and gradients) and out-of-memory bookkeeping."""
import json
import shutil

import pytest
import torch

from moe_book.bench import longseq, system
from moe_book.bench.system import EVERY_PIECE, every_piece, hf_config, param_counts
from moe_book.export import (CONFIG, TOKENIZER, WEIGHTS, ExportError, export_model, load_export, load_weights,
                             same_logits, split_tied)
from moe_book.model import CausalLM

torch.set_num_threads(2)


def tiny_model(overrides=(), seed=0):
    cfg = every_piece("tiny", list(overrides))
    torch.manual_seed(seed)
    model = CausalLM(cfg.model)
    with torch.no_grad():        # router biases and the balancer window away from zero, so losing them would show
        for name, buf in model.named_buffers():
            if buf.is_floating_point() and buf.numel():
                buf.normal_(0, 0.1)
    return cfg, model.eval()


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    "A small BPE tokenizer (fewer tokens than the tiny model's vocab), trained in a moment on a few lines."
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "import os, sys\nprint(os.getcwd())\n"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer_file):
    cfg, model = tiny_model()
    out = export_model(model, cfg, tmp_path_factory.mktemp("export") / "tiny", tokenizer_file)
    return cfg, model, out


# ----------------------------------------------------------------------------------------------------- export
def test_export_round_trip_same_logits(exported):
    cfg, model, out = exported
    assert {p.name for p in out.iterdir()} == {WEIGHTS, CONFIG, TOKENIZER}
    loaded = load_export(out)
    assert loaded.cfg == cfg and loaded.tokenizer is not None
    x = torch.randint(0, cfg.model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    assert same_logits(model, loaded.model, x) == 0.0
    got, want = loaded.model.state_dict(), model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)   # buffers too (router bias)
    assert json.loads((out / CONFIG).read_text())["model"]["moe"]["latent_dim"] == cfg.model.moe.latent_dim


def test_tied_embedding_stored_once_and_tied_again(exported):
    from safetensors import safe_open
    cfg, model, out = exported
    assert cfg.model.tie_embeddings
    with safe_open(str(out / WEIGHTS), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert "embed.weight" in keys and "lm_head.weight" not in keys
    assert json.loads(meta["tied"]) == {"lm_head.weight": "embed.weight"}
    loaded = load_export(out).model
    assert loaded.lm_head.weight is loaded.embed.weight


def test_split_tied_untied_model_keeps_both():
    cfg, model = tiny_model(["model.tie_embeddings=false"])
    tensors, tied = split_tied(model.state_dict())
    assert tied == {} and "lm_head.weight" in tensors


def test_bf16_export_is_half_size_and_close(exported, tmp_path, tokenizer_file):
    cfg, model, out = exported
    small = export_model(model, cfg, tmp_path / "bf16", tokenizer_file, dtype=torch.bfloat16)
    assert (small / WEIGHTS).stat().st_size < 0.55 * (out / WEIGHTS).stat().st_size
    x = torch.randint(0, cfg.model.vocab_size, (1, 32))
    with torch.no_grad():
        ref = model(x)[0]
        rel = ((load_export(small).model(x)[0] - ref).norm() / ref.norm()).item()
    assert rel < 2e-2


def test_requested_config_mismatch_names_the_key(exported):
    _, _, out = exported
    with pytest.raises(ExportError, match=r"model\.d_model: export has 128, requested 256"):
        load_export(out, cfg=every_piece("tiny", ["model.d_model=256"]))
    with pytest.raises(ExportError, match=r"model\.vocab_size: export has 4096, requested 8192"):
        load_export(out, cfg=every_piece("tiny", ["model.vocab_size=8192"]))
    load_export(out, cfg=every_piece("tiny", ["train.lr=1e-4"]))     # train/data keys do not change the weights


@pytest.mark.parametrize("key,value", [("d_model", 256), ("vocab_size", 8192)])
def test_edited_config_json_is_refused(exported, tmp_path, key, value):
    _, _, out = exported
    copy = tmp_path / "edited"
    shutil.copytree(out, copy)
    c = json.loads((copy / CONFIG).read_text())
    c["model"][key] = value
    (copy / CONFIG).write_text(json.dumps(c))
    with pytest.raises(ExportError, match=rf"model\.{key} is {value} in config\.json but"):
        load_export(copy)


def test_weights_into_a_model_of_another_shape(exported):
    _, _, out = exported
    _, other = tiny_model(["model.moe.n_experts=16"])
    with pytest.raises(ExportError, match=r"experts\.gate_up: file has shape \(8, 256, 64\), the model expects \(16, 256, 64\)"):
        load_weights(other, out)
    _, fewer = tiny_model(["model.n_layers=3", "model.attnres_block=1"])
    with pytest.raises(ExportError, match=r"layers\.3\.\S+ .* is in the file but not in the model"):
        load_weights(fewer, out)


def test_tokenizer_whose_sha_differs_is_refused(exported, tmp_path):
    _, _, out = exported
    copy = tmp_path / "othertok"
    shutil.copytree(out, copy)
    tok = json.loads((copy / TOKENIZER).read_text())
    vocab = tok["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (copy / TOKENIZER).write_text(json.dumps(tok))
    with pytest.raises(ExportError, match=r"sha256 .* exported with tokenizer sha256"):
        load_export(copy)
    with pytest.raises(ExportError, match=r"exported with tokenizer sha256"):
        load_export(out, tokenizer_path=copy / TOKENIZER)     # someone else's tokenizer passed explicitly


def test_missing_files_and_foreign_safetensors(tmp_path, exported):
    with pytest.raises(ExportError, match=r"model\.safetensors not found"):
        load_export(tmp_path)
    from safetensors.torch import save_file
    _, _, out = exported
    shutil.copy(out / CONFIG, tmp_path / CONFIG)
    save_file({"w": torch.zeros(2)}, str(tmp_path / WEIGHTS))
    with pytest.raises(ExportError, match="not written by moe_book.export"):
        load_export(tmp_path)


def test_generate_cli_loads_an_export(exported, capsys):
    from moe_book.generate import main as generate_main
    _, _, out = exported
    generate_main(["--model", str(out), "--prompt", "def ", "--max-new-tokens", "5", "--seed", "0"])
    assert capsys.readouterr().out.startswith("def ")


def test_export_cli_from_a_trainer_run(tiny_data, tmp_path, capsys):
    "A 2-step run of the real trainer, exported by the CLI (which reloads and compares logits), then sampled."
    from moe_book.config import apply_overrides
    from moe_book.export import main as export_main
    from moe_book.train import train
    base, _ = tiny_data
    cfg = every_piece("tiny", [f"{k}={v}" for k, v in [("model.vocab_size", 1024), ("data.dir", base.data.dir),
                                                        ("data.max_corpus_mb", 2), ("data.tokenizer_sample_mb", 2),
                                                        ("data.long_doc_min_tokens", 20000)]])
    apply_overrides(cfg, ["train.steps=2", "train.batch_size=2", "train.seq_len=32", "train.eval_every=2",
                          "train.eval_batches=1", "train.log_every=1", "train.ckpt_every=2", "train.live=off",
                          f"train.out_dir={tmp_path / 'run'}", "train.warmup_steps=1"])
    train(cfg, verbose=False)
    export_main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "exp")])
    out = capsys.readouterr().out
    assert "max |diff| 0 (identical)" in out
    loaded = load_export(tmp_path / "exp")
    assert loaded.cfg.model == cfg.model and loaded.tokenizer.get_vocab_size() <= 1024


# ------------------------------------------------------------------------------------------------ bench system
def test_every_piece_builds_the_whole_system():
    cfg, model = tiny_model()
    assert type(model.residual).__name__ == "BlockAttnRes"
    assert [type(b.ffn).__name__ for b in model.layers] == ["SwiGLU"] + ["LatentMoE"] * (cfg.model.n_layers - 1)
    assert cfg.model.moe.latent_dim > 0 and cfg.model.moe.act == "situ" and cfg.model.moe.balancer == "quantile"
    lfl = every_piece("tiny", list(system.LIKE_FOR_LIKE))
    assert lfl.model.moe.latent_dim == 0 and lfl.model.residual == "plain"
    assert set(EVERY_PIECE) >= {"model.ffn=moe", "model.residual=block_attnres"}


def test_param_counts_by_hand():
    cfg, model = tiny_model()
    m = cfg.model
    n = param_counts(model, m.moe.n_experts, m.moe.top_k)
    per_expert = 3 * m.moe.d_expert * m.moe.latent_dim
    assert n["routed"] == (m.n_layers - m.first_dense) * m.moe.n_experts * per_expert
    assert n["total"] == model.num_params() and n["embedding"] == 0          # tied: counted once, as the head
    assert n["active"] == n["total"] - n["routed"] + n["routed"] * m.moe.top_k // m.moe.n_experts
    from moe_book.model import flops_breakdown      # chapter 00's count leaves out vectors (no matmul): the only gap
    assert n["active"] - flops_breakdown(m, 256)["active_params"] == sum(p.numel() for p in model.parameters() if p.dim() < 2)


def test_bench_system_toy_ours(tmp_path):
    out = tmp_path / "bs.json"
    res = system.main(["--toy", "--systems", "ours,ours_like_for_like", "--warmup", "1", "--steps", "1", "--profile",
                       "--out", str(out)])
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert res["toy"] and set(rows) == {"ours", "ours_like_for_like"}
    for r in rows.values():
        assert "error" not in r and r["tokens_per_s"] > 0 and r["params"]["active"] < r["params"]["total"]
    assert rows["ours_like_for_like"]["params"]["total"] != rows["ours"]["params"]["total"]
    assert res["summary"]["speedup_vs_hf"] is None and res["summary"]["errors"] == {}
    top = rows["ours"]["profile_top"]                     # --profile: the top ops of (a), by self time
    assert top and "profile_top" not in rows["ours_like_for_like"] and all(k["self_ms_per_step"] >= 0 for k in top)


def test_bench_system_one_failure_keeps_the_other_rows(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("simulated build failure")
    monkeypatch.setattr(system, "build_hf", broken)
    monkeypatch.setattr(system, "hf_kernels", lambda: {"fla-core": "x", "causal-conv1d": None})
    res = system.main(["--toy", "--systems", "hf_kimi_linear,ours", "--warmup", "1", "--steps", "1",
                       "--out", str(tmp_path / "bs.json")])
    rows = {r["system"]: r for r in res["rows"]}
    assert rows["hf_kimi_linear"]["error"] == "RuntimeError: simulated build failure"
    assert rows["ours"]["tokens_per_s"] > 0
    assert res["summary"]["errors"] == {"hf_kimi_linear": "RuntimeError: simulated build failure"}


def test_bench_system_hf_toy(tmp_path):
    "HF KimiLinear at the tiny shape on CPU (its torch reference kernels: no fla here), when transformers is installed."
    pytest.importorskip("transformers", reason="transformers is not installed here; the GPU run covers the HF peer")
    try:
        from transformers import KimiLinearConfig  # noqa: F401
    except ImportError:
        pytest.skip("this transformers has no KimiLinear (needs transformers >= 5)")
    res = system.main(["--toy", "--systems", "hf_kimi_linear,hf_kimi_linear_bf16,ours", "--warmup", "1", "--steps", "1",
                       "--out", str(tmp_path / "bs.json")])
    rows = {r["system"]: r for r in res["rows"]}
    for name, dtype in (("hf_kimi_linear", "torch.float32"), ("hf_kimi_linear_bf16", "torch.bfloat16")):
        assert "error" not in rows[name], rows[name].get("error")
        assert rows[name]["hf_experts_implementation"] == "grouped_mm" and rows[name]["param_dtype"] == dtype
    s = res["summary"]
    assert s["hf_reference"] == max(system.HF_SYSTEMS, key=lambda n: rows[n]["tokens_per_s"])
    assert s["speedup_vs_hf"] == rows["ours"]["tokens_per_s"] / rows[s["hf_reference"]]["tokens_per_s"]
    lfl = every_piece("tiny", list(system.LIKE_FOR_LIKE))
    hc = hf_config(lfl.model)
    assert hc.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert hc.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert (hc.num_local_experts, hc.num_experts_per_tok, hc.moe_intermediate_size) == (8, 2, 128)


# ----------------------------------------------------------------------------------------------- bench longseq
def test_checkpointed_wrapper_same_loss_and_grads():
    cfg = every_piece("tiny", ["model.moe.balancer=none"])
    torch.manual_seed(0)
    model = CausalLM(cfg.model).double()
    idx = torch.randint(0, cfg.model.vocab_size, (2, 48))
    tgt = torch.roll(idx, -1, 1)

    def run(fn):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    l0, g0 = run(lambda: model(idx, tgt)[1])
    with longseq.checkpointed(model):
        assert "forward" in vars(model.layers[0].mixer)
        l1, g1 = run(lambda: longseq.chunked_loss(model, idx, tgt, chunk=20))
    assert "forward" not in vars(model.layers[0].mixer) and "forward" not in vars(model.layers[0].ffn)
    # the model takes the cross-entropy in fp32 (logits.float()), so both losses are fp32 sums in different orders
    assert set(g0) == set(g1) and abs(l0 - l1) < 1e-5
    for n in g0:
        assert ((g0[n] - g1[n]).norm() / g0[n].norm().clamp_min(1e-30)) < 1e-5, n


def test_saved_bytes_per_token_counts_what_autograd_keeps():
    "Checkpointing keeps at least the fp32 sublayer inputs and less than a plain step; nothing is saved without grad."
    cfg = every_piece("tiny")
    torch.manual_seed(0)
    model = CausalLM(cfg.model)
    idx = torch.randint(0, cfg.model.vocab_size, (1, 64))
    plain = longseq.saved_bytes_per_token(model, idx, idx, ckpt=False)
    ck = longseq.saved_bytes_per_token(model, idx, idx, ckpt=True)
    d, L = cfg.model.d_model, cfg.model.n_layers
    assert 2 * L * d * 4 <= ck < plain      # at least the fp32 sublayer inputs; less than without checkpointing
    with torch.no_grad():                   # nothing is saved without autograd
        assert longseq.saved_bytes_per_token(model, idx, idx, ckpt=False) == 0


def test_sweep_stops_a_mode_at_its_first_oom():
    calls = []

    def point(T, ckpt):
        calls.append((T, ckpt))
        if T > (256 if ckpt else 64):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return {"T": T, "checkpointed": ckpt, "ok": True, "loss": 1.0, "seconds": 0.0}
    freed = []
    rows = longseq.sweep([64, 128, 256, 512], [False, True], point, log=lambda *a: None, after_point=lambda: freed.append(1))
    assert longseq.summarize(rows) == {"max_trainable_T": 64, "max_trainable_T_checkpointed": 256}
    assert (256, False) not in calls and (512, False) not in calls           # skipped after the OOM at 128
    assert [r.get("oom") for r in rows if not r["ok"] and "skipped" not in r] == [True, True]
    assert len(freed) == len(calls)


def test_bench_longseq_toy(tmp_path):
    out = tmp_path / "ls.json"
    res = longseq.main(["--toy", "--lengths", "64,128", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["summary"] == {"max_trainable_T": 128, "max_trainable_T_checkpointed": 128}
    assert len(saved["rows"]) == 4 and all(r["ok"] for r in saved["rows"]) and res["toy"]
    assert out.with_suffix(".png").exists()


# --------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_full_system_matches_cpu_and_trains():
    """The tiny preset with every piece on, on CUDA (Triton KDA, grouped_mm experts, compiled Block AttnRes) under
    bf16 autocast: its loss matches the fp32 CPU model's to bf16 accuracy, and AdamW on one fixed batch lowers it."""
    cfg, model = tiny_model()
    model.train()
    t = torch.randint(0, cfg.model.vocab_size, (2, 257), generator=torch.Generator().manual_seed(3))
    x, y = t[:, :-1], t[:, 1:]
    with torch.no_grad():
        cpu_loss = model(x, y)[1].item()
    gpu = model.cuda()
    xg, yg = x.cuda(), y.cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        gpu_loss = gpu(xg, yg)[1].item()
    # bf16 operands carry ~3 significant digits; over 4 layers the loss (~ln vocab) agrees to about 1%
    assert abs(gpu_loss - cpu_loss) < 1e-2 * abs(cpu_loss), (gpu_loss, cpu_loss)
    opt = torch.optim.AdamW(gpu.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = gpu(xg, yg)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        gpu.post_step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses
