"""Training the EAGLE-3 head against a frozen target (training-time test, soft labels).

Row ``p`` of a window: input token ``t_{p+1}``, feature ``f_p``; its label at every unroll step
is the frozen target's next-token distribution at position ``p+1`` (what the target would say
after ``t_{p+1}``), so the head learns the target, not the corpus. The loss is the soft
cross-entropy against it, weighted ``step_weight**j`` per unroll step ``j`` and taken over the
rows ``p >= j`` that have a chain base. Agreement = the head's argmax (mapped to target ids)
equals the target's argmax.

Tokens fed at unroll steps ``j >= 1`` (``HeadSpec.ttt_tokens``):

- ``"data"`` (default): the window's own tokens. The label at row ``p`` is the target's
  distribution given exactly that prefix, so every example is self-consistent; whenever the
  data token equals the target's greedy token (the only chains that matter for acceptance), it
  is precisely the inference-time input.
- ``"greedy"``: the target's argmax at ``p`` (``g_{p+1}``). Matches inference on the first
  draft step, but where ``g_{p+1} != t_{p+1}`` the label (conditioned on ``t_{p+1}``) no longer
  belongs to the input. In a small CPU ablation (width 128, 150 steps) it lowered agreement at
  steps >= 2 from 0.24 to 0.15 and the simulated chain tau from 1.60 to 1.49.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from phasegraph.train.eagle3_head import (
    Eagle3Config,
    Eagle3Head,
    eagle3_aux_layers,
    load_eagle3_head,
)
from phasegraph.train.loop import Deadline, StageLog, autocast, stage_generator, train_on_windows
from phasegraph.train.presets import HeadSpec, LMSpec, TrainInputError, TrainSpec, head_dims

__all__ = [
    "FrozenTarget",
    "build_head",
    "draft_vocab_ids",
    "eval_head",
    "head_batch",
    "train_head",
    "warm_head",
]


class FrozenTarget:
    """The target as the head sees it: EAGLE-3 features, logits and input embeddings."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.aux_layers = eagle3_aux_layers(model.config.num_hidden_layers)
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids [B, T]`` -> features ``[B, T, 3Ht]``, logits ``[B, T, V]`` (fp32)."""
        out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        feats = torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1)
        return feats, out.logits.float()

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)


def draft_vocab_ids(stream: torch.Tensor, vocab: int, draft_vocab: int) -> torch.Tensor:
    """The ``draft_vocab`` most frequent token ids of ``stream`` (ties: lower id), ascending."""
    counts = torch.bincount(stream.cpu(), minlength=vocab).to(torch.float64)
    counts -= torch.arange(vocab, dtype=torch.float64) / (2 * vocab)  # tie-break on id
    return torch.topk(counts, draft_vocab).indices.sort().values


def _head_config(spec: HeadSpec, target_spec: LMSpec, vocab: int, eos_id: int) -> Eagle3Config:
    heads, kv_heads, head_dim = head_dims(spec, target_spec)
    draft_vocab = spec.draft_vocab_size or vocab
    return Eagle3Config(
        hidden_size=target_spec.hidden_size,
        target_hidden_size=target_spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        eagle_aux_layers=eagle3_aux_layers(target_spec.num_layers),
        rope_theta=float(target_spec.rope_theta),
        rms_norm_eps=target_spec.rms_norm_eps,
        max_position_embeddings=target_spec.context,
        eos_token_id=eos_id,
    )


def build_head(
    spec: HeadSpec,
    target_spec: LMSpec,
    target: LlamaForCausalLM,
    vocab: int,
    eos_id: int,
    seed: int,
    train_stream: torch.Tensor,
) -> Eagle3Head:
    cfg = _head_config(spec, target_spec, vocab, eos_id)
    draft_vocab = cfg.draft_vocab_size
    ids = draft_vocab_ids(train_stream, vocab, draft_vocab) if draft_vocab < vocab else None
    head = Eagle3Head(cfg, draft_to_target=ids)
    head.init_weights(stage_generator(seed, "init"))
    if spec.init_from_target:
        _init_from_target(head, target, ids)
    return head


def warm_head(path, spec: HeadSpec, target_spec: LMSpec, vocab: int, eos_id: int) -> Eagle3Head:
    """A head saved by :func:`~phasegraph.train.eagle3_head.save_eagle3_head`, in float32, to
    train on from where it stopped (its draft vocabulary kept). :class:`TrainInputError` when it
    is not the head ``spec`` builds for this target, naming the first field that differs."""
    try:
        head = load_eagle3_head(path)
    except FileNotFoundError as exc:
        raise TrainInputError(f"init head {path}: no {Path(exc.filename or '').name or 'such file'}") from None
    except Exception as exc:  # a foreign or damaged checkpoint: whatever the loader raises
        raise TrainInputError(f"init head {path}: not a saved EAGLE-3 head ({type(exc).__name__}: {exc})") from None
    want = _head_config(spec, target_spec, vocab, eos_id)
    for field in dataclasses.fields(want):
        got, expected = getattr(head.cfg, field.name), getattr(want, field.name)
        if isinstance(expected, float):  # config.json holds them as float32 values
            same = math.isclose(got, expected, rel_tol=1e-6)
        else:
            same = tuple(got) == tuple(expected) if isinstance(expected, tuple) else got == expected
        if not same:
            raise TrainInputError(f"init head {path}: {field.name} is {got}, the preset and target give {expected}")
    return head.float().train()


def _init_from_target(head: Eagle3Head, target: LlamaForCausalLM, ids: torch.Tensor | None):
    """``lm_head`` and ``norm`` start as the target's (rows of the kept ids)."""
    with torch.no_grad():
        w = target.get_output_embeddings().weight.detach().cpu()
        head.lm_head.weight.copy_(w if ids is None else w[ids])
        head.norm.weight.copy_(target.model.norm.weight.detach().cpu())


def head_batch(
    head: Eagle3Head,
    target: FrozenTarget,
    window: torch.Tensor,
    spec: HeadSpec,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss, per-step agreement counts ``[U]`` and per-step row counts ``[U]`` on
    ``window [B, T+1]`` (the head runs on rows ``0..T-1``)."""
    with autocast(device):
        feats, t_logits = target(window)
        tokens_in = window[:, 1:]
        emb = target.embed(tokens_in)
        emb_later = None
        if spec.ttt_tokens == "greedy":
            emb_later = target.embed(t_logits[:, :-1].argmax(-1))
        elif spec.ttt_tokens != "data":
            raise ValueError(f"ttt_tokens must be 'data' or 'greedy', not {spec.ttt_tokens!r}")
        label_logits = t_logits[:, 1:]  # target at p+1: the distribution of t_{p+2}
        target_top1 = label_logits.argmax(-1)
        kept = head.target_ids()
        if kept is not None:
            label_logits = label_logits[..., kept]
        probs = torch.softmax(label_logits, dim=-1)
        outs = head.ttt_forward(feats[:, :-1], emb, spec.unroll, emb_later)
        total = torch.zeros((), device=device)
        weights = 0.0
        agree, rows = [], []
        for j, out in enumerate(outs):
            logits = head.logits(out[:, j:]).float()
            ce = torch.logsumexp(logits, -1) - (probs[:, j:] * logits).sum(-1)
            w = spec.step_weight**j
            total = total + w * ce.mean()
            weights += w
            pred = head.to_target_ids(logits.detach().argmax(-1))
            agree.append((pred == target_top1[:, j:]).sum())
            rows.append(torch.tensor(pred.numel(), device=device))
    return total / weights, torch.stack(agree), torch.stack(rows)


@torch.no_grad()
def eval_head(
    head: Eagle3Head,
    target: FrozenTarget,
    windows: torch.Tensor,
    spec: HeadSpec,
    device: torch.device,
    batch_size: int,
) -> dict:
    """Loss and top-1 agreement with the target per unroll step on ``windows [n, T+1]``."""
    was_training = head.training
    head.eval()
    loss, agree, rows, n = 0.0, None, None, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i : i + batch_size].to(device)
        batch_loss, a, r = head_batch(head, target, w, spec, device)
        loss += float(batch_loss) * w.shape[0]
        agree = a if agree is None else agree + a
        rows = r if rows is None else rows + r
        n += w.shape[0]
    head.train(was_training)
    per_step = (agree.double() / rows.double()).tolist()
    return {"loss": loss / n, "agreement_by_step": per_step, "rows": int(rows[0])}


def train_head(
    head: Eagle3Head,
    target: FrozenTarget,
    train_stream: torch.Tensor,
    valid_stream: torch.Tensor,
    spec: HeadSpec,
    train_spec: TrainSpec,
    device: torch.device,
    seed: int,
    pool: torch.Tensor | None = None,
    deadline: Deadline | None = None,
    progress: bool = True,
) -> StageLog:
    def batch_loss(w: torch.Tensor) -> torch.Tensor:
        return head_batch(head, target, w, spec, device)[0]

    def valid_loss(valid: torch.Tensor) -> float:
        return eval_head(head, target, valid, spec, device, train_spec.batch_size)["loss"]

    return train_on_windows(
        "eagle3-head", head, train_spec, train_stream, valid_stream, stage_generator(seed, "head"),
        device, batch_loss, valid_loss, deadline=deadline, progress=progress,
        pool=pool, pool_fraction=spec.selfgen_fraction,
    )
