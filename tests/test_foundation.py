"""Chapter 00's claims: data pipeline integrity, config errors and presets, the FLOPs count behind MFU, checkpoints
that survive SIGKILL, and rollbacks that skip a bad batch."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_book.config import ConfigError, get_config, total_steps
from moe_book.data import DataError, load_split, load_tokenizer, read_manifest, verify

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------------- data
def test_tokenizer_roundtrips_heldout_text(tiny_data):
    cfg, data_dir = tiny_data
    tok = load_tokenizer(data_dir)
    manifest = read_manifest(data_dir)
    heldout = load_split(data_dir, "heldout")
    # decode a held-out window back to text, then the text must encode-decode to itself exactly
    text = tok.decode(heldout[:2000].tolist())
    assert len(text) > 1000
    assert tok.decode(tok.encode(text).ids) == text
    # arbitrary unicode and code survive too (byte-level BPE is lossless)
    sample = "def f(x):\n\treturn x ** 2  # ünïcödé ✓ 漢字\n"
    assert tok.decode(tok.encode(sample).ids) == sample
    assert manifest["vocab_size"] <= cfg.model.vocab_size
    assert not set(manifest["packages"]["train"]) & set(manifest["packages"]["heldout"]), "split must be by package"


def test_manifest_counts_and_hashes_match_the_shards(tiny_data):
    _, data_dir = tiny_data
    manifest = verify(data_dir)
    for s in manifest["shards"]:
        arr = np.fromfile(data_dir / s["file"], dtype=manifest["dtype"])
        assert arr.size == s["tokens"]
        assert arr.max() < manifest["vocab_size"]
    assert {s["split"] for s in manifest["shards"]} >= {"train", "heldout"}
    assert 0 < manifest["unigram_entropy_nats"] < np.log(manifest["vocab_size"])


def _copy_data(src: Path, dst: Path):
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_corrupt_truncated_and_mismatched_data_give_one_clear_error(tiny_data, tmp_path):
    _, data_dir = tiny_data
    d = _copy_data(data_dir, tmp_path / "d")
    shard = d / "train_000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train_000\.bin is corrupt.*prepare"):
        load_split(d, "train")
    shard.write_bytes(bytes(raw[:-10]))
    with pytest.raises(DataError, match=r"train_000\.bin is truncated"):
        load_split(d, "train")
    d2 = _copy_data(data_dir, tmp_path / "d2")
    tokenizer = d2 / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"<|pad|>"', '"<|PAD|>"'))
    with pytest.raises(DataError, match="tokenizer.json does not match"):
        load_tokenizer(d2)
    with pytest.raises(DataError, match="manifest.json not found.*prepare"):
        load_split(tmp_path / "nowhere", "train")
    with pytest.raises(DataError, match="vocab_size"):
        load_split(data_dir, "train", vocab_size=10)


def test_data_cli_takes_overrides_after_an_option(tiny_data, capsys):
    "`python -m moe_book.data info --preset tiny data.dir=...`: key=value overrides may follow --preset."
    from moe_book.data import main
    cfg, data_dir = tiny_data
    main(["info", "--preset", "tiny", f"data.dir={cfg.data.dir}", "model.vocab_size=1024",
          f"data.max_corpus_mb={cfg.data.max_corpus_mb}", f"data.tokenizer_sample_mb={cfg.data.tokenizer_sample_mb}",
          f"data.long_doc_min_tokens={cfg.data.long_doc_min_tokens}"])
    info = json.loads(capsys.readouterr().out)
    assert info == {k: v for k, v in verify(data_dir).items() if k != "packages"}


# ----------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("override, pattern", [
    ("model.d_modle=64", "unknown config key 'model.d_modle'"),
    ("n_heads=2", "ambiguous"),
    ("train.lr=fast", "expected float"),
    ("model.n_layers=2.5", "whole number"),
    ("model.mixer=rnn", "model.mixer='rnn': choose one of"),
    ("model.kda.g_min=-9", r"g_min=-9.0: must lie in \[-6, -3\]"),
    ("model.moe.top_k=99", "top_k=99"),
    ("model.moe.balancer=quantil", r"model.moe.balancer='quantil': choose one of \(.*'quantile'"),
    ("train.ckpt_every=-1", "train.ckpt_every=-1: must be >= 0"),
    ("train.spike_zscore=-1", "train.spike_zscore=-1.0: must be >= 0"),
    ("train.max_minutes=-5", "train.max_minutes=-5.0: must be >= 0"),
    ("train.seq_len=100000", "exceeds model.max_seq_len"),
    ("lr", "not key=value"),
])
def test_bad_config_is_one_clear_error(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        get_config("tiny", [override])


def test_balancer_names_match_chapter_05():
    from moe_book.config import BALANCER_TYPES
    from moe_book.layers.moe import BALANCERS
    assert sorted(BALANCER_TYPES) == sorted(BALANCERS)
    for name in BALANCER_TYPES:
        assert get_config("tiny", [f"model.moe.balancer={name}"]).model.moe.balancer == name


def test_presets_turn_every_piece_on():
    for preset in ("tiny", "small"):
        m = get_config(preset).model
        mixers = [m.mixer_of(i) for i in range(m.n_layers)]
        ffns = [m.ffn_of(i) for i in range(m.n_layers)]
        assert mixers == ["kda", "kda", "kda", "mla"] * (m.n_layers // 4), (preset, mixers)
        assert ffns == ["mlp"] + ["moe"] * (m.n_layers - 1), (preset, ffns)
        assert m.residual == "block_attnres" and m.moe.balancer == "quantile" and m.moe.act == "situ"
        assert 0 < m.moe.latent_dim < m.d_model and m.moe.n_shared == 1
    t, s = get_config("tiny").model, get_config("small").model
    assert (t.n_layers, t.attnres_block, t.moe.n_experts, t.moe.top_k) == (4, 2, 8, 2)
    assert (s.n_layers, s.d_model, s.attnres_block, s.d_ff_dense, s.moe.n_experts, s.moe.top_k, s.moe.d_expert,
            s.moe.latent_dim) == (16, 1024, 4, 2816, 128, 8, 256, 512)
    # the tie-breaker on the picking scores: on for the small preset (chapter 05's GPU balance run used it), off for the CPU toy
    assert s.moe.selection_jitter == 0.01 and t.moe.selection_jitter == 0
    b = get_config("tiny", BASELINE).model
    assert {b.mixer_of(i) for i in range(4)} == {"attn"} and {b.ffn_of(i) for i in range(4)} == {"mlp"}
    assert b.residual == "plain"


def test_overrides_reach_nested_fields_and_budget():
    cfg = get_config("tiny", ["model.kda.g_min=-4", "lr=1e-3", "train.tokens=20480", "train.batch_size=4"])
    assert cfg.model.kda.g_min == -4.0 and cfg.train.lr == 1e-3
    assert total_steps(cfg) == 20480 // (4 * 256)


def test_cli_reports_bad_config_without_traceback():
    r = subprocess.run([sys.executable, "-m", "moe_book.train", "--preset", "tiny", "model.d_modle=3"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0
    assert "error: unknown config key 'model.d_modle'" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------------ FLOPs
# The full system at a size small enough to count by hand: layer 0 = KDA + dense SwiGLU, layer 1 = Gated MLA +
# Latent MoE, Block AttnRes; vocabulary 64, d 32, sequences of 32 tokens.
FULL_SMALL = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.global_every=2",
              "model.attnres_block=1", "model.first_dense=1", "model.d_ff_dense=64",
              "model.kda.n_heads=2", "model.kda.head_dim=16", "model.kda.gate_rank=8", "model.kda.chunk_size=16",
              "model.mla.n_heads=2", "model.mla.kv_lora=16", "model.mla.qk_nope=8", "model.mla.qk_rope=8",
              "model.mla.v_head=8", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.d_expert=16",
              "model.moe.latent_dim=16"]


def test_model_flops_per_token_hand_computed():
    from moe_book.model import flops_breakdown, model_flops_per_token
    cfg = get_config("tiny", FULL_SMALL + ["train.seq_len=32"]).model
    d, T = 32, 32
    kda = (3 * d * 32            # q, k, v projections (2 heads x 16)
           + 3 * 32 * 4          # depthwise short convolution, kernel 4, on q, k, v channels
           + d * 2               # beta, one per head
           + d * 8 + 8 * 32      # low-rank decay gate d -> 8 -> 32
           + d * 16 + 16 * 32    # low-rank output gate d -> head_dim -> 32
           + 32 * d)             # output projection
    dense = d * 2 * 64 + 64 * d  # SwiGLU of width 64 (gate and up fused, down)
    mla = (d * 2 * (8 + 8)       # queries: 2 heads x (qk_nope + qk_rope)
           + d * (16 + 8)        # down to [c_kv | k_rope]
           + 16 * 2 * (8 + 8)    # c_kv up to per-head k_nope and v
           + d * 2               # per-head output gate
           + 2 * 8 * d)          # output projection
    moe = (d * 4                 # router
           + 2 * d * 16          # latent down and up
           + 2 * (3 * 16 * 16)   # 2 of the 4 routed experts, each gate/up 16 -> 2x16, down 16 -> 16, in the latent
           + 3 * d * 16)         # the shared expert at full width, hidden 16
    head = 64 * d                # tied LM head (the embedding lookup itself is not a matmul)
    assert (kda, dense, mla, moe, head) == (6080, 6144, 2880, 4224, 2048)
    active = kda + dense + mla + moe + head
    attention = 3 * T * 2 * (8 + 8 + 8)                             # MLA: causal T/2 keys x (d_qk + d_v) x 2 x 3
    C, K, V = 16, 16, 16
    kda_flops = 3 * 2 * (3 * C * K + 2 * C * V + 6 * K * V)          # chunked KDA per token, 2 heads, x3 fwd+bwd
    f = flops_breakdown(cfg, T)
    assert f["active_params"] == active == 21376
    assert (f["attention"], f["kda"]) == (attention, kda_flops) == (4608, 16896)
    assert model_flops_per_token(cfg, T) == f["total"] == 6 * 21376 + 4608 + 16896 == 149760
    # softmax attention, untied head: 2 layers of qkv + out (2 heads x 16) and a SwiGLU of 64, plus the head
    base = get_config("tiny", ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                               "model.head_dim=16", "model.d_ff=64", "model.tie_embeddings=false"] + BASELINE).model
    per_layer = d * 3 * 32 + 32 * d + d * 2 * 64 + 64 * d
    assert flops_breakdown(base, T) == {"active_params": 2 * per_layer + 64 * d, "matmul": 6 * (2 * per_layer + 64 * d),
                                        "attention": 2 * 3 * T * 2 * (16 + 16), "kda": 0,
                                        "total": 6 * 22528 + 12288}


def test_mfu_needs_a_known_peak():
    from moe_book.model import mfu, peak_flops
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("cpu") is None and peak_flops("NVIDIA GeForce RTX 4090") is None
    assert mfu(1e9, 247_250, 989e12) == pytest.approx(0.25)
    assert mfu(1e9, 247_250, None) is None


# ---------------------------------------------------------------------------------------------------- resume
BASELINE = ["model.mixer=attn", "model.global_mixer=attn", "model.ffn=mlp", "model.residual=plain", "model.first_dense=0"]
TRAIN_FAST = ["train.seq_len=32", "train.batch_size=4", "train.steps=12", "train.ckpt_every=4", "train.log_every=4",
              "train.eval_every=6", "train.eval_batches=2", "train.warmup_steps=3", "train.live=off", "train.keep_ckpts=5"]
FAST = BASELINE + ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.head_dim=16", "model.d_ff=64"] + TRAIN_FAST
# every piece on (KDA, Gated MLA, Block AttnRes, dense first layer, Latent MoE with Quantile Balancing), tiny widths
FULL_FAST = [o for o in FULL_SMALL if not o.startswith("model.vocab_size")] + TRAIN_FAST

# A child process that trains and, through a patched hook, SIGKILLs itself at a chosen moment.
CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    torch.set_num_threads(1)
    import moe_book.train as T
    import torch.distributed.checkpoint as dcp
    mode, at = sys.argv[1], int(sys.argv[2])
    real_save, real_dcp_save = T.Checkpointer.save, dcp.save
    def save_then_die(self, state, step):
        path = real_save(self, state, step)
        if mode == "after_ckpt" and step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    def die_while_writing(state, checkpoint_id, **kw):
        if mode == "during_ckpt" and checkpoint_id.endswith(f"step_{at:08d}.tmp"):
            real_dcp_save(state, checkpoint_id=checkpoint_id, **kw)   # files written, rename not yet done
            os.kill(os.getpid(), signal.SIGKILL)
        return real_dcp_save(state, checkpoint_id=checkpoint_id, **kw)
    T.Checkpointer.save = save_then_die
    dcp.save = die_while_writing
    cfg = T.get_config("tiny", sys.argv[4:])
    T.train(cfg, resume=sys.argv[3] == "resume", verbose=False)
""")


def _run(mode, at, resume, overrides):
    return subprocess.run([sys.executable, "-c", CHILD, mode, str(at), resume, *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def _losses(out_dir):
    rows = [json.loads(l) for l in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "event" not in r}


def _final_params(out_dir):
    from moe_book.model import CausalLM
    from moe_book.train import Checkpointer
    cfg = get_config("tiny", json.loads((Path(out_dir) / "cli.json").read_text()))
    model = CausalLM(cfg.model)
    state = {"model": model.state_dict()}
    Checkpointer(out_dir).load(state)
    return state["model"]


def _data(cfg):
    "Overrides that point a run at the session's prepared test corpus."
    return [f"data.dir={cfg.data.dir}", "model.vocab_size=1024", "data.max_corpus_mb=2",
            "data.tokenizer_sample_mb=2", "data.long_doc_min_tokens=20000"]


@pytest.mark.parametrize("model", ["baseline", "full"])
def test_resume_after_sigkill_is_bitwise_identical(tiny_data, tmp_path, model):
    cfg, _ = tiny_data
    runs = {}
    for name in ("straight", "killed"):
        out = tmp_path / name
        out.mkdir()
        ov = (FAST if model == "baseline" else FULL_FAST) + _data(cfg) + [f"train.out_dir={out}"]
        (out / "cli.json").write_text(json.dumps(ov))
        runs[name] = (out, ov)
    r = _run("none", 0, "fresh", runs["straight"][1])
    assert r.returncode == 0, r.stderr
    r = _run("after_ckpt", 4, "fresh", runs["killed"][1])
    assert r.returncode == -signal.SIGKILL, "the child must have been killed mid-run"
    assert max(_losses(runs["killed"][0])) < 12
    r = _run("none", 0, "resume", runs["killed"][1])
    assert r.returncode == 0, r.stderr
    straight, resumed = _losses(runs["straight"][0]), _losses(runs["killed"][0])
    assert sorted(straight) == sorted(resumed) == list(range(1, 13))
    assert all(straight[s] == resumed[s] for s in straight), "losses after resume must be bitwise identical"
    a, b = _final_params(runs["straight"][0]), _final_params(runs["killed"][0])
    assert all(torch.equal(a[k], b[k]) for k in a)
    if model == "full":   # the MoE selection biases and balancer windows are buffers: checkpointed and reproduced
        biases = [k for k in a if k.endswith("router.bias")]
        assert biases and any(k.endswith("balancer.window") for k in a)
        assert all(a[k].abs().sum() > 0 for k in biases), "the quantile balancer must have moved the biases"


def test_kill_during_checkpoint_write_keeps_previous_checkpoint(tiny_data, tmp_path):
    cfg, _ = tiny_data
    out = tmp_path / "run"
    ov = FAST + _data(cfg) + [f"train.out_dir={out}"]
    r = _run("during_ckpt", 8, "fresh", ov)
    assert r.returncode == -signal.SIGKILL
    from moe_book.train import Checkpointer
    ck = Checkpointer(out)
    assert (out / "ckpt" / "step_00000008.tmp").exists(), "the interrupted write is left as .tmp"
    assert ck.latest().name == "step_00000004"
    (out / "cli.json").write_text(json.dumps(ov))
    params = _final_params(out)        # loads step 4 without error
    assert len(params) > 0
    r = _run("none", 0, "resume", ov)  # and training continues from it to the end
    assert r.returncode == 0, r.stderr
    assert ck.latest().name == "step_00000012"
    assert not (out / "ckpt" / "step_00000008.tmp").exists()


def test_make_train_on_cpu_picks_tiny_and_trains(tmp_path):
    r = subprocess.run(["make", "train", f"ARGS=train.steps=6 train.log_every=3 train.eval_every=6 "
                        f"train.eval_batches=1 train.out_dir={tmp_path / 'run'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preset 'tiny' (no CUDA device found" in r.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 6 and np.isfinite(summary["heldout_loss"])


def test_fresh_run_keeps_its_own_checkpoints_beside_an_older_runs(tmp_path):
    from moe_book.train import Checkpointer
    old = Checkpointer(tmp_path, keep=2)
    old.save({"w": torch.zeros(3), "step": 100}, 100)          # an earlier run got further
    new = Checkpointer(tmp_path, keep=2)
    for step in (4, 8, 12):
        new.save({"w": torch.full((3,), float(step)), "step": step}, step)
    assert new.latest().name == "step_00000012"
    assert sorted(p.name for p in new.complete()) == ["step_00000008", "step_00000012"]
    state = {"w": torch.empty(3), "step": 0}
    new.load(state)
    assert state["step"] == 12 and torch.equal(state["w"], torch.full((3,), 12.0))


# -------------------------------------------------------------------------------------------------- rollbacks
def test_guard_flags_non_finite_values_and_loss_spikes():
    from moe_book.train import Guard
    g = Guard(get_config("tiny", ["train.spike_zscore=6", "train.spike_window=20"]).train)
    noise = 5 + 0.1 * np.random.default_rng(0).standard_normal(20)
    assert all(g.check(float(v), 1.0) is None for v in noise)
    assert g.check(5.3, 1.0) is None, "ordinary noise is not a spike"
    assert g.check(7.0, 1.0).startswith("loss spike: 7.0000 is")
    assert g.check(float("nan"), 1.0) == "non-finite loss (nan)"
    assert g.check(5.0, float("inf")) == "non-finite gradient norm (inf)"
    off = Guard(get_config("tiny", ["train.spike_zscore=0", "train.spike_window=20"]).train)
    assert all(off.check(float(v), 1.0) is None for v in noise) and off.check(100.0, 1.0) is None
    g.skip(5); g.skip(3)
    assert [g.batch_index(s) for s in range(6)] == [0, 1, 2, 4, 6, 7], "skipped batches are never drawn"


def _rows(out_dir):
    return [json.loads(l) for l in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def test_nan_rolls_back_skips_the_batch_and_continues_like_a_run_without_it(tiny_data, tmp_path, monkeypatch):
    import moe_book.train as T
    cfg, _ = tiny_data
    over = FULL_FAST + _data(cfg) + ["train.log_every=2"]
    # Batch 6 (step 7) turns the loss into NaN. Checks run every 2 steps, so it is found at step 8 and the run
    # goes back to the checkpoint of step 4 and replays steps 5, 6 before drawing batch 7 for step 7.
    monkeypatch.setenv("MOE_BOOK_INJECT_NAN", "6")
    s = T.train(get_config("tiny", over + [f"train.out_dir={tmp_path / 'nan'}"]), verbose=False)
    monkeypatch.delenv("MOE_BOOK_INJECT_NAN")
    assert s["skipped_batches"] == [6] and len(s["rollbacks"]) == 1
    rb = s["rollbacks"][0]
    assert (rb["step"], rb["batch"], rb["restored_step"], rb["loss"]) == (7, 6, 4, "nan")
    rows = _rows(tmp_path / "nan")
    assert [r["event"] for r in rows if r.get("event") not in (None, "log")] == ["rollback"]
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 13)), "every step once: the replayed ones replace the lost ones"
    assert [r["batch"] for r in steps] == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]
    # The reference: the same config on a data stream that never had batch 6.
    monkeypatch.setattr(T.Guard, "batch_index", lambda self, step: step if step < 6 else step + 1)
    ref = T.train(get_config("tiny", over + [f"train.out_dir={tmp_path / 'ref'}"]), verbose=False)
    assert ref["rollbacks"] == []
    assert [r["loss"] for r in steps] == [r["loss"] for r in _rows(tmp_path / "ref") if "event" not in r]
    assert s["heldout_loss"] == ref["heldout_loss"]
    (tmp_path / "nan" / "cli.json").write_text(json.dumps(over))
    (tmp_path / "ref" / "cli.json").write_text(json.dumps(over))
    a, b = _final_params(tmp_path / "nan"), _final_params(tmp_path / "ref")
    assert all(torch.equal(a[k], b[k]) for k in a), "weights and MoE buffers identical to the run without the batch"


def test_repeated_nans_stop_with_advice_and_leave_checkpoints_loadable(tiny_data, tmp_path):
    cfg, _ = tiny_data
    out = tmp_path / "run"
    ov = FULL_FAST + _data(cfg) + [f"train.out_dir={out}", "train.log_every=2", "train.max_rollbacks=2"]
    # batches 5, 6, 7 are all bad: two rollbacks skip 5 and 6, then batch 7 ends the run
    r = subprocess.run([sys.executable, "-m", "moe_book.train", "--preset", "tiny", *ov], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "MOE_BOOK_INJECT_NAN": "5,6,7"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "error: training diverged at step 6: non-finite loss (nan), after 2 rollbacks (train.max_rollbacks=2)" in r.stderr
    assert "lower learning rate" in r.stderr and "--resume" in r.stderr
    assert r.stdout.count("rolled back to step 4") == 2
    events = [row["event"] for row in _rows(out) if row.get("event") not in (None, "log")]
    assert events == ["rollback", "rollback", "diverged"]
    from moe_book.train import Checkpointer
    assert Checkpointer(out).latest().name == "step_00000004"
    (out / "cli.json").write_text(json.dumps(ov))
    params = _final_params(out)
    assert all(torch.isfinite(v).all() for v in params.values() if v.is_floating_point())


def test_cli_summary_and_final_only_checkpoint(tiny_data, tmp_path, capsys):
    from moe_book.train import Checkpointer, main
    cfg, _ = tiny_data
    out, path = tmp_path / "run", tmp_path / "results" / "summary.json"
    main(["--preset", "tiny", "--summary", str(path), *FULL_FAST, *_data(cfg), f"train.out_dir={out}",
          "train.ckpt_every=0"])
    assert f"summary written to {path}" in capsys.readouterr().out
    s = json.loads(path.read_text())
    assert (s["steps"], s["tokens"]) == (12, 12 * 4 * 32)
    for key in ("train_loss", "heldout_loss", "tokens_per_s"):
        assert np.isfinite(s[key]) and s[key] > 0, key
    assert s["mfu"] is None and s["peak_mem_gib"] is None, "no MFU or CUDA memory on a CPU"
    assert s["flops_per_token"] > 6 * s["active_params"] > 0
    assert set(s["maxvio_final"]) == {"L1"} and s["maxvio_worst_final"] == s["maxvio_final"]["L1"] >= 0
    assert s["command"].startswith("python -m moe_book.train --preset tiny --summary")
    assert s["rollbacks"] == [] and s["skipped_batches"] == [] and s["stopped_by_time_limit"] is False
    assert [p.name for p in Checkpointer(out).complete()] == ["step_00000012"], "train.ckpt_every=0: final only"
    # the loss curves and the expert-load heatmap of the one MoE layer, beside the summary
    assert path.with_suffix(".png").stat().st_size > 0 and (path.parent / "summary_loads.png").stat().st_size > 0


def test_time_limit_ends_the_run_with_a_checkpoint_and_resume_finishes_it(tiny_data, tmp_path):
    from moe_book.train import Checkpointer, train
    cfg, _ = tiny_data
    over = [*FULL_FAST, *_data(cfg), f"train.out_dir={tmp_path / 'run'}", "train.ckpt_every=0", "train.live=off"]
    # a cap already passed after the first step: the run stops there as if interrupted
    s = train(get_config("tiny", over + ["train.max_minutes=1e-9"]), verbose=False)
    assert s["stopped_by_time_limit"] is True and s["steps"] == 1 < s["budget_steps"] == 12
    assert s["heldout_loss"] is not None and [p.name for p in Checkpointer(tmp_path / "run").complete()] == ["step_00000001"]
    done = train(get_config("tiny", over), resume=True, verbose=False)
    assert done["resumed_from"] == 1 and done["steps"] == 12 and done["stopped_by_time_limit"] is False


def test_live_panel_shows_mfu_and_worst_layer_maxvio(tmp_path):
    from rich.console import Console
    from moe_book.layers.moe import moe_panel
    from moe_book.train import Monitor
    mon = Monitor(get_config("tiny", ["train.live=off"]), tmp_path, steps=100, start=0, verbose=False)
    row = {"step": 10, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 123456.0, "mfu": 0.287, "mem_gib": 40.0, "rollbacks": 1,
           "moe/L1/maxvio": 0.04, "moe/L1/load": [9, 11], "moe/L3/maxvio": 0.31, "moe/L3/load": [13, 7]}
    row.update(moe_panel(row))
    console = Console(width=100, record=True)
    console.print(mon._panel(row))
    text = console.export_text()
    mon.close()
    for expected in ("MFU", "28.7%", "123,456", "MaxVio worst (L3)", "0.310", "rollbacks", "40.0 GiB"):
        assert expected in text, expected
