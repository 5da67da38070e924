import os
import sys
from pathlib import Path

import pytest
import torch

# On a machine without CUDA, Triton kernels can only run in Triton's interpreter, and the switch is read when a
# kernel is defined: set it before any test module imports triton (torch.compile's machinery imports it too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
torch_threads = int(os.environ.get("MOE_BOOK_TEST_THREADS", "2"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small real corpus (2 MB of stdlib text, 1024-token BPE), prepared once per test session."""
    from moe_book.config import get_config
    from moe_book.data import prepare
    root = tmp_path_factory.mktemp("data")
    cfg = get_config("tiny", ["model.vocab_size=1024", f"data.dir={root}", "data.max_corpus_mb=2",
                              "data.tokenizer_sample_mb=2", "data.long_doc_min_tokens=20000"])
    return cfg, prepare(cfg, log=lambda *a: None)
