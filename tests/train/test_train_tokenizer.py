"""The byte-level BPE tokenizer: determinism, special token, loading through transformers."""

from __future__ import annotations

import pytest

from phasegraph.train.tokenizer import (
    EOS_TOKEN,
    encode_stream,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))  # é ünïcode\n",
] * 20


def test_training_is_deterministic():
    a = train_tokenizer(TEXTS, 300)
    b = train_tokenizer(TEXTS, 300)
    assert a.to_str() == b.to_str()
    assert a.token_to_id(EOS_TOKEN) == 0


def test_stream_separates_documents_with_eos():
    tok = train_tokenizer(TEXTS, 300)
    stream = encode_stream(tok, TEXTS[:2])
    ids0 = tok.encode(TEXTS[0]).ids
    assert stream.tolist()[: len(ids0) + 1] == ids0 + [0]
    assert stream[-1] == 0
    assert int((stream == 0).sum()) == 2


def test_saved_tokenizer_loads_offline_with_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    tok = train_tokenizer(TEXTS, 300)
    save_tokenizer(tok, tmp_path, model_max_length=128)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "def f(x):\n        return x  # é\n"
    ids = tok.encode(text).ids
    assert hf(text)["input_ids"] == ids  # no BOS/EOS added
    assert fast(text)["input_ids"] == ids
    assert hf.decode(ids) == text
    assert hf.eos_token_id == hf.pad_token_id == hf.bos_token_id == 0
    assert load_tokenizer(tmp_path).to_str() == tok.to_str()
