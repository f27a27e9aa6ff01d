"""Sizes and step counts of the training recipe, as frozen dataclasses, plus size/FLOP estimates.

Every number that changes the result lives in a :class:`Preset`, so a run is a function of
``(preset, seed)``. ``--set section.field=value`` on the command line replaces single fields
(see :func:`apply_overrides`); the effective preset is written into ``train_report.json``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

__all__ = [
    "CorpusSpec",
    "DISTILL_PRESETS",
    "DistillPreset",
    "DistillSpec",
    "EvalSpec",
    "HeadSpec",
    "LMSpec",
    "PRESETS",
    "Preset",
    "TrainInputError",
    "TrainSpec",
    "apply_overrides",
    "check_preset",
    "head_flops_per_row",
    "head_param_count",
    "lm_flops_per_token",
    "lm_param_count",
    "max_tree_nodes",
    "preset_to_dict",
]

H100_BF16_PEAK_FLOPS = 790e12  # dense bf16 figure the projections use


@dataclass(frozen=True)
class CorpusSpec:
    """Which part of the stdlib corpus a run reads (caps are per split, in bytes of source)."""

    max_train_bytes: int | None = None  # None = every train file
    max_valid_bytes: int | None = None
    max_heldout_bytes: int | None = None


@dataclass(frozen=True)
class LMSpec:
    """A Llama-architecture causal LM (the target, or the standalone draft of ``bench-pair``)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 64
    context: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True


@dataclass(frozen=True)
class TrainSpec:
    """One optimisation stage: AdamW, linear warm-up then cosine decay to ``min_lr_ratio * lr``."""

    steps: int
    batch_size: int
    seq_len: int  # tokens per window the loss is taken on
    lr: float
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 200  # validation every N steps; the best validation state is kept
    eval_windows: int = 64  # validation windows per evaluation


@dataclass(frozen=True)
class HeadSpec:
    """The EAGLE-3 head (hidden size = target hidden size) and its training-time-test setup."""

    intermediate_size: int
    num_heads: int | None = None  # None = the target's attention heads
    num_kv_heads: int | None = None  # None = num_heads (q/k/v all map 2Hd -> heads*D)
    draft_vocab_size: int | None = None  # None = the full target vocabulary (no d2t/t2d)
    unroll: int = 5  # TTT unroll steps U
    step_weight: float = 0.8  # loss weight of unroll step j is step_weight**j
    ttt_tokens: str = "data"  # "data" or "greedy": token fed at unroll steps j >= 1
    init_from_target: bool = True  # lm_head/norm start as the target's
    selfgen_seqs: int = 0  # target greedy continuations added to the head's data
    selfgen_prompt_len: int = 512  # their prompt (a random train window) length
    selfgen_fraction: float = 0.5  # share of each batch's rows drawn from that pool
    selfgen_batch: int = 512  # sequences generated at once


@dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation: windowed loss/agreement and a simulated speculative decode."""

    loss_windows: int = 256  # held-out windows for target loss / head agreement (cap)
    prompt_max_lines: int = 40
    max_prompts: int = 64  # 0: no simulated speculative decode (the bench measures τ itself)
    gen_tokens: int = 128  # greedy continuation length the acceptance is simulated on
    chain_steps: int = 3
    tree_topk: int = 4
    tree_steps: int = 4
    tree_nodes: int = 16


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    target: LMSpec
    target_train: TrainSpec
    head: HeadSpec
    head_train: TrainSpec
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    draft: LMSpec | None = None  # standalone draft model (distilled from the target)
    draft_train: TrainSpec | None = None
    eval: EvalSpec = field(default_factory=EvalSpec)
    save_dtype: str = "bfloat16"
    tokenizer_min_frequency: int = 2


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

# The GPU presets' self-generated head data: half of each batch from target greedy
# continuations of 512-token train windows, generated 1024 at a time.
_SELFGEN = dict(selfgen_prompt_len=512, selfgen_fraction=0.5, selfgen_batch=1024)

_DEMO = Preset(
    name="demo-pair",
    vocab_size=4096,
    # 7.70M params (tied embeddings) -> 14.7 MiB in bf16. Eight layers so that the EAGLE-3
    # feature layers (2, 4, 5) are distinct.
    target=LMSpec(
        hidden_size=320, num_layers=8, num_heads=5, num_kv_heads=1, intermediate_size=576
    ),
    # ~26M tokens (~11 passes over the ~2.4M train tokens): validation loss bottoms out near
    # step 600 of a 2400-step schedule and the model then memorises, so the schedule ends at
    # 800; the best validation state is kept.
    target_train=TrainSpec(
        steps=800, batch_size=32, seq_len=1024, lr=2e-3, warmup_steps=100, eval_every=100
    ),
    # 3.56M params -> 6.8 MiB in bf16. Half of each batch comes from target greedy
    # continuations of train windows (1.5M generated tokens): on a small CPU-scale ablation this
    # raised the simulated tau noticeably (chain 1.44 -> 1.60, tree 1.91 -> 2.17).
    head=HeadSpec(intermediate_size=1280, unroll=5, selfgen_seqs=3072, **_SELFGEN),
    # ~65M head rows (x5 unroll steps). The head is step-limited at small scale, and a higher
    # learning rate helped there (3e-3 -> 1e-2 at width 128); 3e-3 at width 320.
    # 1400 steps take ~170 s on an H200, inside the ~6-minute budget.
    head_train=TrainSpec(
        steps=1400, batch_size=32, seq_len=1023, lr=3e-3, warmup_steps=100, eval_every=200,
        eval_windows=48,
    ),
    eval=EvalSpec(gen_tokens=256),
)

_BENCH = Preset(
    name="bench-pair",
    vocab_size=8192,
    # ~96M params.
    target=LMSpec(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2560
    ),
    # Each stage's steps fit phasegraph bench's training budget on an H100 whole, so no stage is
    # cut on the clock and the pair (and the bench's τ) is the same in every run. The target's
    # validation loss was best near step 500 of longer schedules.
    target_train=TrainSpec(
        steps=450, batch_size=32, seq_len=1024, lr=6e-4, warmup_steps=100, eval_every=100
    ),
    # The target's attention shape (12 heads, 4 KV heads), as the published EAGLE-3 heads copy
    # their target's; 12 KV heads read 1.6M more weights in every draft forward.
    head=HeadSpec(intermediate_size=2560, num_kv_heads=4, unroll=5, selfgen_seqs=1024, **_SELFGEN),
    head_train=TrainSpec(
        steps=200, batch_size=32, seq_len=1023, lr=8e-4, warmup_steps=100, eval_every=100,
        eval_windows=48,
    ),
    # ~16M params, 4 layers, same tokenizer; distilled from the target's distributions.
    draft=LMSpec(
        hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1408
    ),
    draft_train=TrainSpec(
        steps=300, batch_size=32, seq_len=1024, lr=1.5e-3, warmup_steps=100, eval_every=100
    ),
    eval=EvalSpec(gen_tokens=256),
)

# Runs in well under a minute on a 2-core CPU: what the tests use.
_TINY = Preset(
    name="tiny",
    vocab_size=512,
    corpus=CorpusSpec(
        max_train_bytes=1_000_000, max_valid_bytes=60_000, max_heldout_bytes=120_000
    ),
    target=LMSpec(
        hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=128,
        head_dim=32, context=128,
    ),
    target_train=TrainSpec(
        steps=120, batch_size=8, seq_len=128, lr=1e-2, warmup_steps=10, eval_every=40,
        eval_windows=16,
    ),
    head=HeadSpec(
        intermediate_size=128, unroll=3, selfgen_seqs=16, selfgen_prompt_len=64,
        selfgen_fraction=0.25, selfgen_batch=16,
    ),
    head_train=TrainSpec(
        steps=60, batch_size=8, seq_len=127, lr=1e-2, warmup_steps=5, eval_every=30,
        eval_windows=8,
    ),
    eval=EvalSpec(
        loss_windows=32, prompt_max_lines=20, max_prompts=8, gen_tokens=24, chain_steps=3,
        tree_topk=2, tree_steps=3, tree_nodes=6,
    ),
)

PRESETS: dict[str, Preset] = {p.name: p for p in (_DEMO, _BENCH, _TINY)}


@dataclass(frozen=True)
class DistillSpec:
    """The self-distillation data: chat requests, and the frozen target's own responses to them
    (one greedy, ``samples`` sampled), generated with phasegraph's Engine."""

    stdlib_prompts: int = 4000  # requests from stdlib docstrings (besides HumanEval's train split)
    max_prompt_tokens: int = 512  # longer rendered requests are skipped
    max_new_tokens: int = 384
    samples: int = 1  # sampled responses per request, besides the greedy one
    temperature: float = 0.8
    top_p: float = 0.95
    batch_size: int = 256  # the generating engine's max_batch_size
    valid_fraction: float = 0.02  # share of the sequences kept for validation only


@dataclass(frozen=True)
class DistillPreset:
    """An EAGLE-3 head for an existing, frozen target (a HF directory or a GGUF file), trained on
    the target's own responses; its held-out evaluation runs the Engine on HumanEval's held-out
    problems (``eval`` gives the tree shapes and the tokens per problem)."""

    name: str
    distill: DistillSpec
    head: HeadSpec
    head_train: TrainSpec
    eval: EvalSpec = field(default_factory=EvalSpec)
    save_dtype: str = "bfloat16"


# SmolLM2-135M-Instruct (576 wide, 30 layers, vocabulary 49152). A draft vocabulary of 5120 and
# an MLP of 1280 keep the head at 7.6M parameters, 14.6 MiB in bf16 with its maps: one file under
# 16 MiB, which a device run can hand back whole. The target's attention shape (9 heads, 3 KV
# heads). Steps are an upper bound: with a time budget the head stage is fitted to what is left
# after generation.
_SMOLLM2 = DistillPreset(
    name="smollm2",
    distill=DistillSpec(),
    head=HeadSpec(intermediate_size=1280, num_kv_heads=3, draft_vocab_size=5120, unroll=5),
    head_train=TrainSpec(
        steps=3000, batch_size=16, seq_len=1023, lr=1e-3, warmup_steps=100, eval_every=250,
        eval_windows=32,
    ),
    eval=EvalSpec(max_prompts=41, gen_tokens=128),
)

# The whole pipeline in seconds on a CPU, for a tiny target (the tests).
_DISTILL_TINY = DistillPreset(
    name="distill-tiny",
    distill=DistillSpec(stdlib_prompts=24, max_prompt_tokens=200, max_new_tokens=24, samples=1,
                        batch_size=16, valid_fraction=0.1),
    head=HeadSpec(intermediate_size=64, draft_vocab_size=200, unroll=3),
    head_train=TrainSpec(steps=20, batch_size=4, seq_len=63, lr=5e-3, warmup_steps=4,
                         eval_every=10, eval_windows=4),
    eval=EvalSpec(max_prompts=3, gen_tokens=16, tree_topk=2, tree_steps=2, tree_nodes=4),
)

DISTILL_PRESETS: dict[str, DistillPreset] = {p.name: p for p in (_SMOLLM2, _DISTILL_TINY)}


class TrainInputError(ValueError):
    """A preset, override or run option the recipe refuses, named in its one-line message."""


def _field_type(cls: type, name: str) -> tuple[type, bool]:
    """``(type, optional)`` of a dataclass field: ``int | None`` is ``(int, True)``."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _parse_scalar(text: str, kind: type, optional: bool) -> object:
    if optional and text.lower() in ("none", "null"):
        return None
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"not a boolean: {text!r}")
        return text.lower() in ("true", "1")
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    if not text:
        raise ValueError("empty text")
    return text


# fields a run cannot have at zero (sizes, lengths, rates); every other number must be >= 0
POSITIVE_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
    "head_dim", "context", "rope_theta", "rms_norm_eps", "batch_size", "seq_len", "lr",
    "unroll", "eval_every", "eval_windows", "draft_vocab_size", "selfgen_prompt_len",
    "selfgen_batch", "loss_windows", "prompt_max_lines", "gen_tokens", "chain_steps",
    "tree_topk", "tree_steps", "tree_nodes", "max_prompt_tokens", "max_new_tokens",
    "temperature", "top_p",
})
INT_LIMIT = 2**63  # counts past int64 overflow inside torch
SAVE_DTYPES = ("bfloat16", "float16", "float32")
TTT_TOKENS = ("data", "greedy")


def _parsed(item: str, text: str, cls: type, name: str) -> object:
    """``text`` as the type of field ``name`` of ``cls``, in the field's range; a
    :class:`TrainInputError` names the override."""
    kind, optional = _field_type(cls, name)
    if dataclasses.is_dataclass(kind):
        if optional and text.strip().lower() in ("none", "null"):
            return None  # e.g. draft=none: no standalone draft
        fields = ", ".join(f.name for f in dataclasses.fields(kind))
        raise TrainInputError(
            f"override {item!r}: {name} is a section, not a value; set its fields "
            f"({name}.FIELD=VALUE, FIELD one of: {fields})"
        )
    try:
        value = _parse_scalar(text.strip(), kind, optional)
    except ValueError as exc:
        kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "text"}
        expected = kinds.get(kind, "a value") + (" or none" if optional else "")
        raise TrainInputError(f"override {item!r}: expected {expected}, got {text!r}") from exc
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise TrainInputError(f"override {item!r}: expected a finite number, got {text!r}")
        if name in POSITIVE_FIELDS and value <= 0:
            raise TrainInputError(f"override {item!r}: {name} must be greater than 0")
        if value < 0:
            raise TrainInputError(f"override {item!r}: {name} must be 0 or more")
        if isinstance(value, int) and value >= INT_LIMIT:
            raise TrainInputError(f"override {item!r}: {name} must be less than 2**63")
    return value


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def apply_overrides(preset: Preset | DistillPreset, overrides: list[str]) -> Preset | DistillPreset:
    """Replace fields from ``section.field=value`` (or ``field=value`` for top-level fields);
    a bad override, or a result :func:`check_preset` refuses, is a :class:`TrainInputError`.

    >>> apply_overrides(PRESETS["tiny"], ["target_train.steps=3"]).target_train.steps
    3
    """
    cls = type(preset)
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise TrainInputError(f"override {item!r} is not of the form key=value")
        if not key:
            raise TrainInputError(f"override {item!r} has no key: expected section.field=value")
        parts = key.split(".")
        if len(parts) == 1:
            if key not in _field_names(cls):
                raise TrainInputError(
                    f"unknown preset field {key!r} (top-level fields: "
                    f"{', '.join(_field_names(cls))})"
                )
            preset = dataclasses.replace(preset, **{key: _parsed(item, value, cls, key)})
            continue
        if len(parts) != 2:
            raise TrainInputError(f"override key {key!r} must be 'section.field'")
        section, name = parts
        kind = _field_type(cls, section)[0] if section in _field_names(cls) else None
        if kind is None or not dataclasses.is_dataclass(kind):
            sections = [n for n in _field_names(cls)
                        if dataclasses.is_dataclass(_field_type(cls, n)[0])]
            raise TrainInputError(
                f"unknown preset field {key!r} (sections: {', '.join(sections)})"
            )
        if name not in _field_names(kind):
            raise TrainInputError(
                f"unknown preset field {key!r} ({section} has: {', '.join(_field_names(kind))})"
            )
        sub = getattr(preset, section)
        if sub is None:
            raise TrainInputError(
                f"override {item!r}: preset {preset.name!r} has no {section} (bench-pair has one)"
            )
        sub = dataclasses.replace(sub, **{name: _parsed(item, value, kind, name)})
        preset = dataclasses.replace(preset, **{section: sub})
    check_preset(preset)
    return preset


def check_preset(preset: Preset | DistillPreset) -> None:
    """A :class:`TrainInputError` naming every field that contradicts another, or that the
    recipe would refuse only deep inside a run (each field's own range is checked where an
    override is parsed)."""
    if isinstance(preset, DistillPreset):
        _check_distill_preset(preset)
        return
    p, t, h, ht, ev = preset, preset.target, preset.head, preset.head_train, preset.eval
    bad = []
    if p.vocab_size < 257:
        bad.append(f"vocab_size {p.vocab_size} must be at least 257 (256 bytes and <|endoftext|>)")
    models = [("target", t, p.target_train)]
    if (p.draft is None) != (p.draft_train is None):
        bad.append("draft and draft_train must both be set or both be none")
    elif p.draft is not None:
        models.append(("draft", p.draft, p.draft_train))
        if p.draft.context >= p.draft_train.seq_len > t.context:  # the target teaches on them
            bad.append(f"draft_train.seq_len {p.draft_train.seq_len} must be at most "
                       f"target.context {t.context}")
    for name, spec, train in models:
        if spec.hidden_size % spec.num_heads:
            bad.append(f"{name}.hidden_size {spec.hidden_size} must be a multiple of "
                       f"{name}.num_heads {spec.num_heads}")
        if spec.num_heads % spec.num_kv_heads:
            bad.append(f"{name}.num_heads {spec.num_heads} must be a multiple of "
                       f"{name}.num_kv_heads {spec.num_kv_heads}")
        if spec.head_dim % 2:
            bad.append(f"{name}.head_dim {spec.head_dim} must be even (RoPE)")
        if train.seq_len > spec.context:
            bad.append(f"{name}_train.seq_len {train.seq_len} must be at most "
                       f"{name}.context {spec.context}")
    nh, nkv, _ = head_dims(h, t)
    if nh % nkv:
        bad.append(f"the head's {nh} attention heads (head.num_heads, else target.num_heads) must "
                   f"be a multiple of its {nkv} KV heads (head.num_kv_heads)")
    if ht.seq_len >= t.context:
        bad.append(f"head_train.seq_len {ht.seq_len} must be below target.context {t.context} "
                   "(a head window is seq_len + 1 target tokens)")
    if h.unroll > ht.seq_len:
        bad.append(f"head.unroll {h.unroll} must be at most head_train.seq_len {ht.seq_len}")
    if h.draft_vocab_size is not None and h.draft_vocab_size > p.vocab_size:
        bad.append(f"head.draft_vocab_size {h.draft_vocab_size} must be at most "
                   f"vocab_size {p.vocab_size}")
    if h.ttt_tokens not in TTT_TOKENS:
        bad.append(f"head.ttt_tokens must be one of {', '.join(TTT_TOKENS)}, not {h.ttt_tokens!r}")
    if h.selfgen_fraction > 1:
        bad.append(f"head.selfgen_fraction {h.selfgen_fraction} must be at most 1")
    for name, train in (("target_train", p.target_train), ("head_train", ht),
                        ("draft_train", p.draft_train)):
        if train is not None and train.beta2 >= 1:
            bad.append(f"{name}.beta2 {train.beta2} must be below 1")
        if train is not None and train.min_lr_ratio > 1:
            bad.append(f"{name}.min_lr_ratio {train.min_lr_ratio} must be at most 1")
    if p.save_dtype not in SAVE_DTYPES:
        bad.append(f"save_dtype must be one of {', '.join(SAVE_DTYPES)}, not {p.save_dtype!r}")
    if ev.max_prompts > 0:  # the simulated speculative decode (eval.max_prompts=0 skips it)
        if ev.gen_tokens > t.context - 2:
            bad.append(f"eval.gen_tokens {ev.gen_tokens} must be at most target.context - 2 "
                       f"({t.context - 2}): prompt and continuation share the context")
        for name, steps in (("chain_steps", ev.chain_steps), ("tree_steps", ev.tree_steps)):
            if steps >= ev.gen_tokens:
                bad.append(f"eval.{name} {steps} must be below eval.gen_tokens {ev.gen_tokens}")
        most = max_tree_nodes(ev.tree_topk, ev.tree_steps)
        if not 2 <= ev.tree_nodes <= most:
            bad.append(f"eval.tree_nodes {ev.tree_nodes} must be between 2 and {most} for "
                       f"tree_topk {ev.tree_topk}, tree_steps {ev.tree_steps}")
        if ev.tree_topk > (h.draft_vocab_size or p.vocab_size):
            bad.append(f"eval.tree_topk {ev.tree_topk} must be at most the draft vocabulary "
                       f"({h.draft_vocab_size or p.vocab_size})")
    if bad:
        raise TrainInputError(f"preset {p.name!r}: " + "; ".join(bad))


def _check_distill_preset(preset: DistillPreset) -> None:
    d, h, ht, ev = preset.distill, preset.head, preset.head_train, preset.eval
    bad = []
    if not 0 < d.valid_fraction < 1:
        bad.append(f"distill.valid_fraction {d.valid_fraction} must be between 0 and 1")
    if d.top_p > 1:
        bad.append(f"distill.top_p {d.top_p} must be at most 1")
    if h.unroll > ht.seq_len:
        bad.append(f"head.unroll {h.unroll} must be at most head_train.seq_len {ht.seq_len}")
    if h.ttt_tokens not in TTT_TOKENS:
        bad.append(f"head.ttt_tokens must be one of {', '.join(TTT_TOKENS)}, not {h.ttt_tokens!r}")
    if h.selfgen_seqs:
        bad.append("head.selfgen_seqs must be 0: the distilled head's data is all self-generated")
    if ht.beta2 >= 1 or ht.min_lr_ratio > 1:
        bad.append("head_train.beta2 must be below 1 and head_train.min_lr_ratio at most 1")
    if preset.save_dtype not in SAVE_DTYPES:
        bad.append(f"save_dtype must be one of {', '.join(SAVE_DTYPES)}, not {preset.save_dtype!r}")
    most = max_tree_nodes(ev.tree_topk, ev.tree_steps)
    if not 2 <= ev.tree_nodes <= most:
        bad.append(f"eval.tree_nodes {ev.tree_nodes} must be between 2 and {most} for "
                   f"tree_topk {ev.tree_topk}, tree_steps {ev.tree_steps}")
    if bad:
        raise TrainInputError(f"preset {preset.name!r}: " + "; ".join(bad))


def preset_to_dict(preset: Preset | DistillPreset) -> dict:
    return dataclasses.asdict(preset)


# ---------------------------------------------------------------------------------------------
# Sizes and FLOPs (used for the printed projection and by the tests' size checks)
# ---------------------------------------------------------------------------------------------


def _layer_matmul_params(spec: LMSpec) -> int:
    h, d = spec.hidden_size, spec.head_dim
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    return attn + 3 * h * spec.intermediate_size


def lm_param_count(spec: LMSpec, vocab: int) -> int:
    """Stored parameters (tied embeddings counted once)."""
    h = spec.hidden_size
    per_layer = _layer_matmul_params(spec) + 2 * h
    emb = vocab * h * (1 if spec.tie_embeddings else 2)
    return spec.num_layers * per_layer + emb + h


def lm_flops_per_token(spec: LMSpec, vocab: int, seq_len: int, train: bool = True) -> float:
    """Matmul FLOPs per token (forward ×3 when training), causal attention counted at half."""
    matmul = spec.num_layers * _layer_matmul_params(spec) + spec.hidden_size * vocab
    attn = spec.num_layers * 2 * seq_len * spec.num_heads * spec.head_dim  # QK^T and PV, causal
    fwd = 2 * matmul + attn
    return 3 * fwd if train else fwd


def max_tree_nodes(topk: int, steps: int) -> int:
    """1 + K + (S-1)·K²: the root and every candidate a draft tree of ``topk`` K and ``steps``
    S proposes (the simulated decode's bound; the engine's is ``phasegraph.phases.context``'s,
    which this torch-free module does not import)."""
    return 1 + topk + (steps - 1) * topk * topk


def head_dims(head: HeadSpec, target: LMSpec) -> tuple[int, int, int]:
    """(attention heads, KV heads, head dim) of the EAGLE-3 head ``head`` trains for ``target``."""
    nh = head.num_heads or target.num_heads
    nkv = head.num_kv_heads or nh
    return nh, nkv, target.head_dim


def head_param_count(head: HeadSpec, target: LMSpec, vocab: int) -> int:
    h = target.hidden_size
    nh, nkv, d = head_dims(head, target)
    vd = head.draft_vocab_size or vocab
    qkv = 2 * h * (nh + 2 * nkv) * d
    params = 3 * h * h + qkv + nh * d * h + 3 * h * head.intermediate_size + 4 * h + vd * h
    if vd < vocab:  # d2t int64 + t2d bool, counted as parameter-equivalents of 2 bytes
        params += (8 * vd + vocab) // 2
    return params


def head_flops_per_row(head: HeadSpec, target: LMSpec, vocab: int, seq_len: int) -> float:
    """Training FLOPs per head row: frozen target forward + U unrolled head steps (fwd+bwd)."""
    h = target.hidden_size
    nh, nkv, d = head_dims(head, target)
    vd = head.draft_vocab_size or vocab
    step = 2 * (2 * h * (nh + 2 * nkv) * d + nh * d * h + 3 * h * head.intermediate_size + h * vd)
    step += 4 * seq_len * nh * d  # the TTT attention is computed densely (not causal-halved)
    fc = 2 * 3 * h * h
    target_fwd = lm_flops_per_token(target, vocab, seq_len + 1, train=False)
    return target_fwd + 3 * (fc + head.unroll * step)


def projected_seconds(flops: float, mfu: float) -> float:
    return flops / (H100_BF16_PEAK_FLOPS * mfu)


def mib(n_bytes: float) -> float:
    return n_bytes / 2**20


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def cosine_lr(step: int, spec: TrainSpec) -> float:
    """Learning rate at optimiser step ``step`` (0-based)."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    span = max(1, spec.steps - spec.warmup_steps)
    t = min(1.0, (step - spec.warmup_steps) / span)
    floor = spec.lr * spec.min_lr_ratio
    return floor + (spec.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * t))
