"""Llama-architecture language models (``transformers.LlamaForCausalLM``): build, train, save.

Used for the target and for the standalone draft of ``bench-pair``, which is distilled from the
frozen target (soft cross-entropy against the target's next-token distribution).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from phasegraph.train.loop import Deadline, StageLog, autocast, stage_generator, train_on_windows
from phasegraph.train.presets import LMSpec, TrainSpec

__all__ = [
    "build_lm",
    "eval_lm",
    "llama_config",
    "save_lm",
    "soft_cross_entropy",
    "train_lm",
]

_INIT_OFFSET = {"target": 11, "draft": 12}


def llama_config(spec: LMSpec, vocab_size: int, eos_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.context,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
    )


def build_lm(spec: LMSpec, vocab_size: int, eos_id: int, seed: int, role: str) -> LlamaForCausalLM:
    """A freshly initialised model, on CPU, in fp32; weights depend only on (spec, seed, role)."""
    config = llama_config(spec, vocab_size, eos_id)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1000 + _INIT_OFFSET[role])
        model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    return model.float()


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``-sum_v softmax(teacher)_v * log_softmax(logits)_v`` (fp32)."""
    target = torch.softmax(teacher_logits.float(), dim=-1)
    return -(target * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def _logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def train_lm(
    model: LlamaForCausalLM,
    train_stream: torch.Tensor,
    valid_stream: torch.Tensor,
    spec: TrainSpec,
    device: torch.device,
    seed: int,
    stage: str,
    teacher: LlamaForCausalLM | None = None,
    deadline: Deadline | None = None,
    progress: bool = True,
) -> StageLog:
    """Next-token training on random windows; with ``teacher``, distillation on its logits."""

    def batch_loss(w: torch.Tensor) -> torch.Tensor:
        x, y = w[:, :-1], w[:, 1:]
        with autocast(device):
            logits = _logits(model, x)
            if teacher is None:
                return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            with torch.no_grad():
                t_logits = _logits(teacher, x)
            return soft_cross_entropy(logits, t_logits)

    def valid_loss(valid: torch.Tensor) -> float:
        return eval_lm(model, valid, device, spec.batch_size, teacher=teacher)["loss"]

    return train_on_windows(
        stage, model, spec, train_stream, valid_stream, stage_generator(seed, stage), device,
        batch_loss, valid_loss, deadline=deadline, progress=progress,
    )


@torch.no_grad()
def eval_lm(
    model: LlamaForCausalLM,
    windows: torch.Tensor,
    device: torch.device,
    batch_size: int,
    teacher: LlamaForCausalLM | None = None,
) -> dict[str, float]:
    """Mean next-token loss over ``windows [n, T+1]`` (every position of every window counts).

    With ``teacher``: ``loss`` is the soft cross-entropy against the teacher and ``agreement``
    the top-1 agreement with the teacher's argmax; ``data_loss`` is the corpus loss either way.
    """
    was_training = model.training
    model.eval()
    total = {"data_loss": 0.0, "loss": 0.0, "agreement": 0.0, "accuracy": 0.0}
    n_rows = 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i : i + batch_size].to(device)
        x, y = w[:, :-1], w[:, 1:]
        with autocast(device):
            logits = _logits(model, x).float()
            t_logits = _logits(teacher, x).float() if teacher is not None else None
        rows = y.numel()
        data_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        total["data_loss"] += float(data_loss)
        total["accuracy"] += float((logits.argmax(-1) == y).sum())
        if t_logits is None:
            total["loss"] += float(data_loss)
        else:
            total["loss"] += float(soft_cross_entropy(logits, t_logits)) * rows
            total["agreement"] += float((logits.argmax(-1) == t_logits.argmax(-1)).sum())
        n_rows += rows
    model.train(was_training)
    out = {k: v / n_rows for k, v in total.items()}
    if teacher is None:
        del out["agreement"]
    return out


def save_lm(model: LlamaForCausalLM, out_dir: Path, dtype: torch.dtype) -> None:
    """``save_pretrained`` (safetensors, tied weights stored once) of a ``dtype`` copy; the
    in-memory model is left unchanged."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to("cpu", dtype).save_pretrained(out_dir)
