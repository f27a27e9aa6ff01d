"""Tiny random checkpoints in every format the runtime loads, for tests (CPU, seconds).

Targets are written in the Hugging Face layout (``config.json`` + ``model.safetensors``, or
shards + ``model.safetensors.index.json``; tied embeddings omit ``lm_head.weight``). Draft heads
are written in their public layouts (see the ``eagle1``, ``eagle3``, ``mtp`` modules), sized to
a given target. Weights are random with a fixed seed and norm weights are ``1 + noise``, so a
misplaced norm cannot hide behind all-ones weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from phasegraph.runtime.models.draft_base import building
from phasegraph.runtime.models.eagle1 import Eagle1Head
from phasegraph.runtime.models.eagle3 import Eagle3Head
from phasegraph.runtime.models.loading import SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_BIN_FILE
from phasegraph.runtime.models.mtp import MTPHead

TARGET_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")
# mixture-of-experts defaults: few small experts, two per token; Qwen3-MoE's layer 1 stays dense
# (``mlp_only_layers``) so that MoE layer indices and decoder layer indices differ
MOE_DEFAULTS = {
    "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


def tiny_target_config(model_type: str = "llama", **overrides) -> PretrainedConfig:
    """A small config of ``model_type`` (llama, qwen2, qwen3, mistral, qwen3_moe, mixtral)."""
    values = dict(TINY)
    if model_type == "qwen3":
        values["head_dim"] = 16
    values.update(MOE_DEFAULTS.get(model_type, {}))
    if model_type == "mistral":
        values["sliding_window"] = 4096  # wider than the tests' contexts unless they narrow it
    values.update(overrides)
    return AutoConfig.for_model(model_type, **values)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Fresh random floating parameters: norms (1-D ``*weight``) ~ 1 + noise, others ~ noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * std
            if param.ndim == 1 and name.endswith("weight"):
                noise += 1.0
            param.copy_(noise.to(param.dtype))


def _save_tensors(
    directory: Path, state: dict[str, torch.Tensor], *, fmt: str = "safetensors", shards: int = 1
) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if fmt == "bin":
        torch.save(state, directory / TORCH_BIN_FILE)
        return
    if fmt != "safetensors":
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    if shards <= 1:
        save_file(state, str(directory / SAFETENSORS_FILE), metadata={"format": "pt"})
        return
    keys = sorted(state)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = keys[i::shards]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))


def _write_config(directory: Path, config: PretrainedConfig, **extra) -> None:
    values = json.loads(config.to_json_string(use_diff=False))
    values.pop("_attn_implementation_autoset", None)
    values.update(extra)
    (directory / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True))


def write_hf_target(
    directory: str | Path,
    model_type: str = "llama",
    *,
    seed: int = 0,
    shards: int = 1,
    **overrides,
) -> Path:
    """A random HF causal LM checkpoint (``shards > 1`` writes an index + shard files)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_target_config(model_type, **overrides)
    with building("cpu", init=True):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    _randomize(model, seed)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _write_config(directory, config)
    _save_tensors(directory, state, shards=shards)
    return directory


def target_config_of(target: str | Path | PretrainedConfig) -> PretrainedConfig:
    if isinstance(target, PretrainedConfig):
        return target
    return AutoConfig.from_pretrained(str(target))


def _draft_llama_config(target: PretrainedConfig, num_layers: int, **overrides) -> LlamaConfig:
    hidden = target.hidden_size
    values = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=target.vocab_size,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def write_eagle1_draft(
    directory: str | Path,
    target: str | Path | PretrainedConfig,
    *,
    seed: int = 1,
    fmt: str = "safetensors",
    **overrides,
) -> Path:
    """A random EAGLE-1 head (cnets1 layout) sized to ``target``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = _draft_llama_config(target_config_of(target), 1, **overrides)
    with building("cpu", init=True):
        head = Eagle1Head(config)
    _randomize(head, seed)
    _write_config(directory, config, architectures=["LlamaForCausalLM"], bias=True)
    _save_tensors(directory, head.state_dict(), fmt=fmt)
    return directory


def write_eagle3_draft(
    directory: str | Path,
    target: str | Path | PretrainedConfig,
    *,
    draft_vocab_size: int | None = None,
    seed: int = 2,
    fmt: str = "safetensors",
    **overrides,
) -> Path:
    """A random EAGLE-3 head sized to ``target``; ``d2t``/``t2d`` when the draft vocab is smaller."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target_config = target_config_of(target)
    config = _draft_llama_config(target_config, 1, **overrides)
    vocab = config.vocab_size
    draft_vocab = draft_vocab_size or vocab
    with_maps = draft_vocab < vocab
    with building("cpu", init=True):
        head = Eagle3Head(
            config,
            target_hidden_size=target_config.hidden_size,
            draft_vocab_size=draft_vocab,
            with_d2t=with_maps,
            with_t2d=with_maps,
        )
    _randomize(head, seed)
    if with_maps:
        gen = torch.Generator().manual_seed(seed + 1000)
        kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # [Vd]
        head.d2t.copy_(kept - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[kept] = True
    _write_config(
        directory,
        config,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_config.hidden_size,
    )
    _save_tensors(directory, head.state_dict(), fmt=fmt)
    return directory


def write_mtp_draft(
    directory: str | Path,
    target: str | Path | PretrainedConfig,
    *,
    num_layers: int = 2,
    seed: int = 3,
    fmt: str = "safetensors",
    **overrides,
) -> Path:
    """Random chained MTP layers (phasegraph layout, see ``mtp.py``) sized to ``target``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = _draft_llama_config(target_config_of(target), num_layers, **overrides)
    with building("cpu", init=True):
        head = MTPHead(config)
    _randomize(head, seed)
    _write_config(directory, config, architectures=["PhasegraphMTP"])
    _save_tensors(directory, head.state_dict(), fmt=fmt)
    return directory


def write_standalone_draft(
    directory: str | Path,
    target: str | Path | PretrainedConfig,
    model_type: str = "llama",
    *,
    seed: int = 4,
    **overrides,
) -> Path:
    """A small random HF causal LM with the target's vocabulary."""
    values = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=target_config_of(target).vocab_size,
    )
    values.update(overrides)  # tiny_target_config fills in the rest (qwen3's head_dim among it)
    return write_hf_target(directory, model_type, seed=seed, **values)


# -- the public draft-head layouts, tensor names written out (not taken from the runtime's modules,
# so a misnamed module would fail to load them) ------------------------------------------------

PUBLIC_DRAFT_LAYOUTS = {
    # name: what it reproduces
    "eagle1-llama3": "Yuhuili's EAGLE-1 LLaMA-3 heads: bias false, no fc.bias",
    "eagle1-bias": "EAGLE-1 (cnets1) with fc.bias, bias absent (default true), .bin + embedding",
    "eagle1-qwen2": "EAGLE-1 Qwen2 heads: qkv_bias true (q/k/v biases, o_proj none)",
    "eagle3-fc_norm": "EAGLE 3.1 (SpecForge / vLLM): fc_norm and norm_output true",
    "eagle3-norm_before_residual": "vLLM / speculators: norm_before_residual true",
    "eagle3-midlayers": "SpecForge multi-layer: midlayers.{0,1}",
    "eagle3-layers": "vLLM multi-layer: layers.{0,1}, norm_before_fc with input_norm",
    "eagle3-no-lm_head": "an EAGLE-3 head without lm_head (the target's is used)",
    "eagle3-wide": "draft hidden size != target hidden size: its own embed_tokens",
    "speculators-eagle3": "vllm-project/speculators eagle3: nested configs, layers.0, embed copy",
    "speculators-eagle": "vllm-project/speculators eagle (HASS): layernorms, fusion_bias",
    "nextn": "DeepSeek-V3 / MiMo style next-n layer at model.layers.{num_hidden_layers}",
}


class _Tensors:
    """Named random tensors (norm weights ~ 1 + noise), with a fixed seed."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.state: dict[str, torch.Tensor] = {}

    def add(self, name: str, *shape: int, norm: bool = False) -> None:
        noise = torch.randn(shape, generator=self.gen) * 0.1
        self.state[name] = noise + 1.0 if norm else noise

    def decoder_layer(self, prefix: str, cfg: dict, *, in_dim: int, input_norm: bool,
                      hidden_norm: bool = False, qkv_bias: bool = False, qk_norm: bool = False) -> None:
        hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        for name, rows in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
            self.add(f"{prefix}.self_attn.{name}_proj.weight", rows, in_dim)
            if qkv_bias:
                self.add(f"{prefix}.self_attn.{name}_proj.bias", rows)
        self.add(f"{prefix}.self_attn.o_proj.weight", hidden, heads * head_dim)
        if qk_norm:
            self.add(f"{prefix}.self_attn.q_norm.weight", head_dim, norm=True)
            self.add(f"{prefix}.self_attn.k_norm.weight", head_dim, norm=True)
        inter = cfg["intermediate_size"]
        self.add(f"{prefix}.mlp.gate_proj.weight", inter, hidden)
        self.add(f"{prefix}.mlp.up_proj.weight", inter, hidden)
        self.add(f"{prefix}.mlp.down_proj.weight", hidden, inter)
        self.add(f"{prefix}.post_attention_layernorm.weight", hidden, norm=True)
        if input_norm:
            self.add(f"{prefix}.input_layernorm.weight", hidden, norm=True)
        if hidden_norm:
            self.add(f"{prefix}.hidden_norm.weight", hidden, norm=True)


def _target_tensors(target: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(target).glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def _head_config(target_config: PretrainedConfig, **overrides) -> dict:
    values = json.loads(_draft_llama_config(target_config, 1).to_json_string(use_diff=False))
    values.pop("_attn_implementation_autoset", None)
    values.update(overrides)
    return values


def write_public_draft(directory: str | Path, target: str | Path, layout: str, *, seed: int = 5) -> Path:
    """A random draft head in one of the public layouts of :data:`PUBLIC_DRAFT_LAYOUTS`, sized to
    the target checkpoint directory ``target``: ``config.json`` keys and tensor names as the
    published checkpoints of that layout have them."""
    if layout not in PUBLIC_DRAFT_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(PUBLIC_DRAFT_LAYOUTS)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tcfg = target_config_of(target)
    ht, vocab = tcfg.hidden_size, tcfg.vocab_size
    t = _Tensors(seed)
    family = layout.split("-")[0]
    if family == "eagle1":
        qwen = layout == "eagle1-qwen2"
        cfg = _head_config(tcfg, architectures=["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
                           model_type="qwen2" if qwen else "llama")
        if layout == "eagle1-llama3":
            cfg["bias"] = False
        if qwen:
            cfg.pop("rope_parameters", None)  # the published files spell it as rope_theta
            cfg.update(qkv_bias=True, bias=True, rope_theta=1000000.0)
        t.add("fc.weight", ht, 2 * ht)
        if cfg.get("bias", True):
            t.add("fc.bias", ht)
        t.decoder_layer("layers.0", cfg, in_dim=ht, input_norm=False, qkv_bias=qwen)
        if layout == "eagle1-bias":  # SafeAILab's v1 files: pytorch_model.bin with the embedding
            t.state["embed_tokens.weight"] = _target_tensors(target)["model.embed_tokens.weight"].clone()
    elif family == "eagle3":
        hd = 48 if layout == "eagle3-wide" else ht
        draft_vocab = vocab if layout == "eagle3-no-lm_head" else vocab // 2
        cfg = _head_config(tcfg, hidden_size=hd, intermediate_size=2 * hd,
                           architectures=["LlamaForCausalLMEagle3"], target_hidden_size=ht)
        if layout != "eagle3-no-lm_head":
            cfg["draft_vocab_size"] = draft_vocab
        names = {"eagle3-midlayers": ["midlayers.0", "midlayers.1"], "eagle3-layers": ["layers.0", "layers.1"]}
        prefixes = names.get(layout, ["midlayer"])
        cfg["num_hidden_layers"] = len(prefixes)
        if layout == "eagle3-fc_norm":
            cfg.update(fc_norm=True, norm_output=True)
            for i in range(3):
                t.add(f"fc_norm.{i}.weight", ht, norm=True)
        if layout == "eagle3-norm_before_residual":
            cfg["norm_before_residual"] = True
        if layout == "eagle3-layers":
            cfg["eagle_config"] = {"norm_before_fc": True}
            t.add("input_norm.weight", 3 * ht, norm=True)
        t.add("fc.weight", hd, 3 * ht)
        for i, prefix in enumerate(prefixes):
            t.decoder_layer(prefix, cfg, in_dim=2 * hd if i == 0 else hd, input_norm=True, hidden_norm=i == 0)
        t.add("norm.weight", hd, norm=True)
        if layout == "eagle3-wide":
            t.add("embed_tokens.weight", vocab, hd)
        if layout != "eagle3-no-lm_head":
            t.add("lm_head.weight", draft_vocab, hd)
            _vocab_maps(t, vocab, draft_vocab, seed)
    elif layout == "speculators-eagle3":
        layer = _head_config(tcfg)
        layer.pop("architectures", None)
        cfg = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0", "draft_vocab_size": vocab // 2,
            "norm_before_residual": True, "target_hidden_size": None,
            "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": str(target), "architectures": list(tcfg.architectures or [])},
            },
        }
        t.state["embed_tokens.weight"] = _target_tensors(target)["model.embed_tokens.weight"].clone()
        t.add("fc.weight", ht, 3 * ht)
        t.decoder_layer("layers.0", layer, in_dim=2 * ht, input_norm=True, hidden_norm=True)
        t.add("norm.weight", ht, norm=True)
        t.add("lm_head.weight", vocab // 2, ht)
        _vocab_maps(t, vocab, vocab // 2, seed)
    elif layout == "speculators-eagle":
        layer = _head_config(tcfg)
        layer.pop("architectures", None)
        cfg = {
            "architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
            "speculators_version": "0.1.0", "layernorms": True, "fusion_bias": True,
            "transformer_layer_architecture": "LlamaDecoderLayer", "transformer_layer_config": layer,
            "speculators_config": {"algorithm": "eagle", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": str(target), "architectures": []}},
        }
        t.add("embedding_layernorm.weight", ht, norm=True)
        t.add("fusion_fc.weight", ht, 2 * ht)
        t.add("fusion_fc.bias", ht)
        t.decoder_layer("transformer", layer, in_dim=ht, input_norm=True)
        t.add("pre_lm_head_layernorm.weight", ht, norm=True)
    else:  # nextn: the whole target checkpoint plus its next-n layer
        cfg = json.loads((Path(target) / "config.json").read_text())
        cfg["num_nextn_predict_layers"] = 1
        n = cfg["num_hidden_layers"]
        prefix = f"model.layers.{n}"
        t.state.update(_target_tensors(target))
        t.state[f"{prefix}.embed_tokens.weight"] = t.state["model.embed_tokens.weight"].clone()
        t.add(f"{prefix}.enorm.weight", ht, norm=True)
        t.add(f"{prefix}.hnorm.weight", ht, norm=True)
        t.add(f"{prefix}.eh_proj.weight", ht, 2 * ht)
        t.decoder_layer(prefix, cfg, in_dim=ht, input_norm=True, qkv_bias=cfg["model_type"] == "qwen2",
                        qk_norm=cfg["model_type"] == "qwen3")
        t.add(f"{prefix}.shared_head.norm.weight", ht, norm=True)
        t.add(f"{prefix}.shared_head.head.weight", vocab, ht)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    _save_tensors(directory, t.state, fmt="bin" if layout == "eagle1-bias" else "safetensors")
    return directory


def _vocab_maps(t: _Tensors, vocab: int, draft_vocab: int, seed: int) -> None:
    """``d2t`` (draft id -> offset to its target id) and ``t2d`` (target ids kept) as trainers
    save them."""
    gen = torch.Generator().manual_seed(seed + 1000)
    kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t.state["d2t"] = kept - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    t.state["t2d"] = t2d
