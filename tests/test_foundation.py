"""Chapter 00's claims: data pipeline integrity, config errors, and checkpoints that survive SIGKILL."""
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


# ----------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("override, pattern", [
    ("model.d_modle=64", "unknown config key 'model.d_modle'"),
    ("n_heads=2", "ambiguous"),
    ("train.lr=fast", "expected float"),
    ("model.n_layers=2.5", "whole number"),
    ("model.mixer=rnn", "model.mixer='rnn': choose one of"),
    ("model.kda.g_min=-9", r"g_min=-9.0: must lie in \[-6, -3\]"),
    ("model.moe.top_k=99", "top_k=99"),
    ("train.seq_len=100000", "exceeds model.max_seq_len"),
    ("lr", "not key=value"),
])
def test_bad_config_is_one_clear_error(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        get_config("tiny", [override])


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


# ---------------------------------------------------------------------------------------------------- resume
FAST = ["model.mixer=attn", "model.global_mixer=attn", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.head_dim=16", "model.d_ff=64",
        "train.seq_len=32", "train.batch_size=4", "train.steps=12", "train.ckpt_every=4", "train.log_every=4",
        "train.eval_every=6", "train.eval_batches=2", "train.warmup_steps=3", "train.live=off", "train.keep_ckpts=5"]

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


def test_resume_after_sigkill_is_bitwise_identical(tiny_data, tmp_path):
    cfg, _ = tiny_data
    data = [f"data.dir={cfg.data.dir}", "model.vocab_size=1024", "data.max_corpus_mb=2",
            "data.tokenizer_sample_mb=2", "data.long_doc_min_tokens=20000"]
    runs = {}
    for name in ("straight", "killed"):
        out = tmp_path / name
        out.mkdir()
        ov = FAST + data + [f"train.out_dir={out}"]
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


def test_kill_during_checkpoint_write_keeps_previous_checkpoint(tiny_data, tmp_path):
    cfg, _ = tiny_data
    out = tmp_path / "run"
    ov = FAST + [f"data.dir={cfg.data.dir}", "model.vocab_size=1024", "data.max_corpus_mb=2",
                 "data.tokenizer_sample_mb=2", "data.long_doc_min_tokens=20000", f"train.out_dir={out}"]
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
