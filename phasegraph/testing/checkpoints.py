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

TARGET_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

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
    """A small config of ``model_type`` (llama, qwen2, qwen3, mistral)."""
    values = dict(TINY)
    if model_type == "qwen3":
        values["head_dim"] = 16
    if model_type == "mistral":
        values["sliding_window"] = 4096  # exact below the window; phasegraph attends in full
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
    if model_type == "qwen3":
        values["head_dim"] = 16
    values.update(overrides)
    return write_hf_target(directory, model_type, seed=seed, **values)
