"""Real text that is already on every machine with the venv (the Python standard library, pydoc topics, installed
packages), a byte-level BPE tokenizer trained on it, and memmap token shards with a manifest that is checked on load."""
import hashlib
import json
import os
import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np


from moe_book.config import Config, DataConfig

EOT = "<|endoftext|>"
PAD = "<|pad|>"
# Reserved now so the agentic-RL chapter can add tool use without retraining the tokenizer.
TOOL_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool_call|>", "<|/tool_call|>",
               "<|tool_result|>", "<|/tool_result|>"] + [f"<|reserved_{i}|>" for i in range(9)]
SPECIAL_TOKENS = [EOT, PAD] + TOOL_TOKENS
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "test", "tests", "idle_test", "_vendor"}
MAX_FILE_BYTES = 1_000_000  # generated tables and minified blobs are not the text we want to learn


class DataError(RuntimeError):
    """Missing, corrupt or mismatched data; the message names the file and the fix."""


# ----------------------------------------------------------------------------------------------------- corpus
def _sources():
    """(package, root) pairs: stdlib modules (the same on every machine with this Python), then installed
    packages; each group in a fixed hash order, so any size budget takes a mix of packages, not just a..c."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    for root in (stdlib, purelib):
        if not root.is_dir():
            continue
        for entry in sorted(root.iterdir(), key=lambda e: (zlib.crc32(e.name.encode()), e.name)):
            name = entry.name[:-3] if entry.name.endswith(".py") else entry.name
            if entry.name in SKIP_DIRS or name.startswith((".", "_distutils_hack")) or ".dist-info" in name:
                continue
            if entry.is_dir() or entry.suffix == ".py":
                yield name, entry


def _package_files(entry: Path):
    "The package's .py files (and docs) in path order, so a package reads as one long document."
    if entry.is_file():
        yield entry
        return
    for dirpath, dirnames, filenames in os.walk(entry):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith((".py", ".md", ".rst", ".txt")):
                yield Path(dirpath) / f


def _read(path: Path):
    if path.stat().st_size > MAX_FILE_BYTES:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def is_heldout(package: str, percent: float) -> bool:
    "Held-out split by package name (a stable hash), so no evaluation file shares a package with training."
    return zlib.crc32(package.encode()) % 1000 < percent * 10


def iter_documents(cfg: DataConfig):
    "Yield {text, package, path, split} for every document, stopping once max_corpus_mb of text is read."
    budget = int(cfg.max_corpus_mb * 1e6)
    seen = 0
    try:
        import pydoc_data.topics as topics
        for key in sorted(topics.topics):
            text = topics.topics[key]
            seen += len(text)
            yield {"text": text, "package": "pydoc_data", "path": f"pydoc_data/topics/{key}",
                   "split": "heldout" if is_heldout("pydoc_data", cfg.heldout_percent) else "train"}
    except ImportError:
        pass
    for package, entry in _sources():
        split = "heldout" if is_heldout(package, cfg.heldout_percent) else "train"
        for path in _package_files(entry):
            text = _read(path)
            if not text or not text.strip():
                continue
            rel = str(path.relative_to(entry.parent))
            seen += len(text)
            yield {"text": f"# {rel}\n{text}", "package": package, "path": rel, "split": split}
            if seen >= budget:
                return


def load_corpus(cfg: DataConfig):
    "The corpus as a `datasets.Dataset` (columns text, package, path, split)."
    import datasets
    datasets.disable_progress_bars()
    docs = list(iter_documents(cfg))
    if not docs:
        raise DataError("no corpus text found: the Python standard library was not readable from "
                        f"{sysconfig.get_paths()['stdlib']}; run with the project's venv python (make data)")
    return datasets.Dataset.from_list(docs)


# -------------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts, vocab_size: int):
    "Byte-level BPE (lossless on any UTF-8 text) with the document and tool special tokens."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(data_dir):
    "The tokenizer saved beside the shards, checked against the manifest's hash."
    from tokenizers import Tokenizer
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    path = data_dir / "tokenizer.json"
    if not path.exists():
        raise DataError(f"{path} is missing; rebuild the data with `python -m moe_book.data prepare` (or make data)")
    if sha256_file(path) != manifest["tokenizer"]["sha256"]:
        raise DataError(f"{path} does not match the tokenizer the shards in {data_dir} were made with (sha256 differs); "
                        f"delete {data_dir} and run `python -m moe_book.data prepare` to rebuild both together")
    return Tokenizer.from_file(str(path))


# ------------------------------------------------------------------------------------------------------ shards
def sha256_file(path, block=1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _write_tokens(path: Path, arr: np.ndarray) -> dict:
    tmp = path.with_suffix(".tmp")
    arr.tofile(tmp)
    os.replace(tmp, path)
    return {"file": path.name, "tokens": int(arr.size), "sha256": sha256_file(path)}


def data_dir_for(cfg: Config) -> Path:
    "Where a config's data lives: one folder per corpus and vocabulary, so presets never mix shards."
    return Path(cfg.data.dir) / f"{cfg.data.name}-v{cfg.model.vocab_size}"


def prepare(cfg: Config, force: bool = False, log=print) -> Path:
    """Build corpus -> tokenizer -> shards + manifest under data_dir_for(cfg). Idempotent: an intact existing
    build is kept. Writes the manifest last, so an interrupted build is never mistaken for a finished one."""
    out = data_dir_for(cfg)
    if not force and (out / "manifest.json").exists():
        try:
            verify(out)
            return out
        except DataError as e:
            log(f"data: rebuilding {out}: {e}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    dc = cfg.data
    log(f"data: reading up to {dc.max_corpus_mb:g} MB of Python sources and docs from this machine")
    ds = load_corpus(dc)
    train_ds = ds.filter(lambda s: s == "train", input_columns="split")
    budget = int(dc.tokenizer_sample_mb * 1e6)

    def sample():
        seen = 0
        for text in train_ds["text"]:
            yield text
            seen += len(text)
            if seen >= budget:
                return

    log(f"data: {len(ds)} documents, {sum(map(len, ds['text'])) / 1e6:.1f} MB; training a {cfg.model.vocab_size}-token BPE")
    tok = train_tokenizer(sample(), cfg.model.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    dtype = token_dtype(cfg.model.vocab_size)

    def encode(batch):
        return {"ids": [e.ids for e in tok.encode_batch(batch["text"])]}

    ds = ds.map(encode, batched=True, batch_size=256)
    manifest = {"version": 1, "vocab_size": tok.get_vocab_size(), "model_vocab_size": cfg.model.vocab_size,
                "dtype": np.dtype(dtype).name, "eot_id": eot,
                "tokenizer": {"file": "tokenizer.json", "sha256": sha256_file(out / "tokenizer.json")},
                "shards": [], "long_docs": [], "packages": {"train": [], "heldout": []},
                "corpus": {"documents": len(ds), "max_corpus_mb": dc.max_corpus_mb}}
    for split in ("train", "heldout"):
        part = ds.filter(lambda s: s == split, input_columns="split")
        manifest["packages"][split] = sorted(set(part["package"]))
        ids = part["ids"]
        # Every document ends with <|endoftext|>, so packing never glues two files together unmarked.
        flat = np.fromiter((t for doc in ids for t in (*doc, eot)), dtype=dtype)
        if flat.size == 0:
            raise DataError(f"the {split} split is empty; raise data.max_corpus_mb or change data.heldout_percent")
        for i, start in enumerate(range(0, flat.size, dc.shard_tokens)):
            entry = _write_tokens(out / f"{split}_{i:03d}.bin", flat[start:start + dc.shard_tokens])
            manifest["shards"].append({"split": split, **entry})
        # Long documents for the curriculum: one package, its files concatenated in path order.
        by_pkg = {}
        for pkg, doc in zip(part["package"], ids):
            by_pkg.setdefault(pkg, []).append(doc)
        longs = [(p, np.fromiter((t for d in docs for t in (*d, eot)), dtype=dtype)) for p, docs in by_pkg.items()]
        longs = [(p, a) for p, a in longs if a.size >= dc.long_doc_min_tokens]
        if longs:
            offset, arrays = 0, []
            for pkg, arr in longs:
                manifest["long_docs"].append({"split": split, "package": pkg, "offset": offset, "tokens": int(arr.size)})
                offset += arr.size
                arrays.append(arr)
            entry = _write_tokens(out / f"long_{split}.bin", np.concatenate(arrays))
            manifest["shards"].append({"split": f"long_{split}", **entry})
        log(f"data: {split}: {flat.size:,} tokens from {len(manifest['packages'][split])} packages, "
            f"{len(longs)} long documents")
    train_tokens = np.concatenate([np.fromfile(out / s["file"], dtype=dtype) for s in manifest["shards"] if s["split"] == "train"])
    manifest["unigram_entropy_nats"] = unigram_entropy(train_tokens, tok.get_vocab_size())
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")
    return out


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    "Cross-entropy (nats/token) of predicting every token from corpus frequencies alone: the bar a model must beat."
    p = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def read_manifest(data_dir) -> dict:
    path = Path(data_dir) / "manifest.json"
    if not path.exists():
        raise DataError(f"{path} not found: the data has not been prepared; run `python -m moe_book.data prepare` "
                        f"(make data), or just `make train`, which prepares it")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); delete {Path(data_dir)} and run `python -m moe_book.data prepare`") from None


def verify(data_dir, check_hash: bool = True) -> dict:
    "Check every shard's presence, size and sha256 against the manifest; raise DataError naming the bad file."
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    fix = f"delete {data_dir} and run `python -m moe_book.data prepare` to rebuild it"
    for s in manifest["shards"]:
        path = data_dir / s["file"]
        if not path.exists():
            raise DataError(f"shard {path} is missing; {fix}")
        if path.stat().st_size != s["tokens"] * itemsize:
            raise DataError(f"shard {path} is truncated or corrupt: {path.stat().st_size} bytes, manifest says "
                            f"{s['tokens'] * itemsize}; {fix}")
        if check_hash and sha256_file(path) != s["sha256"]:
            raise DataError(f"shard {path} is corrupt: its sha256 does not match the manifest; {fix}")
    if (data_dir / "tokenizer.json").exists() and sha256_file(data_dir / "tokenizer.json") != manifest["tokenizer"]["sha256"]:
        raise DataError(f"{data_dir / 'tokenizer.json'} does not match the manifest (sha256 differs); {fix}")
    return manifest


def load_split(data_dir, split: str, vocab_size: int = None) -> np.ndarray:
    "All tokens of a split as one read-only memmap (or a concatenation of them), after verifying the shards."
    data_dir = Path(data_dir)
    manifest = verify(data_dir)
    if vocab_size is not None and manifest["vocab_size"] > vocab_size:
        raise DataError(f"the tokenizer in {data_dir} has {manifest['vocab_size']} tokens but the model's vocab_size is "
                        f"{vocab_size}; use model.vocab_size={manifest['vocab_size']} or rebuild the data")
    files = [s for s in manifest["shards"] if s["split"] == split]
    if not files:
        raise DataError(f"no {split!r} shards in {data_dir}; choose one of {sorted({s['split'] for s in manifest['shards']})}")
    arrays = [np.memmap(data_dir / s["file"], dtype=manifest["dtype"], mode="r") for s in files]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


class TokenBatches:
    """Random (seq_len + 1)-token windows. Batch `step` depends only on (seed, step), so the data position in a
    checkpoint is just the step number and a resumed run sees exactly the batches it would have seen."""
    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
        if tokens.size <= seq_len + 1:
            raise DataError(f"split has {tokens.size} tokens, fewer than one window of seq_len+1={seq_len + 1}")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed

    def get(self, step: int):
        import torch
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.batch_size)
        win = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        win = torch.from_numpy(win)
        return win[:, :-1], win[:, 1:]


def main(argv=None):
    import argparse
    from moe_book.config import get_config
    p = argparse.ArgumentParser(prog="python -m moe_book.data", description=__doc__)
    p.add_argument("command", choices=["prepare", "info"])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--force", action="store_true", help="rebuild even if intact shards exist")
    p.add_argument("overrides", nargs="*", help="config key=value overrides")
    a = p.parse_args(argv)
    cfg = get_config(a.preset, a.overrides)
    if a.command == "prepare":
        out = prepare(cfg, force=a.force)
        print(f"data: ready in {out}")
    else:
        print(json.dumps({k: v for k, v in verify(data_dir_for(cfg)).items() if k != "packages"}, indent=1))


if __name__ == "__main__":
    try:
        main()
    except DataError as e:
        sys.exit(f"error: {e}")
