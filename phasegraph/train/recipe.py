"""The whole recipe: corpus -> tokenizer -> target -> EAGLE-3 head (-> standalone draft) -> files.

Output directory layout::

    DIR/target/     config.json, model.safetensors, generation_config.json,
                    tokenizer.json, tokenizer_config.json            (HF directory)
    DIR/eagle3/     config.json, model.safetensors                   (EAGLE-3 layout)
    DIR/draft/      HF directory + tokenizer (bench-pair only)
    DIR/train_report.json

Everything is saved into ``DIR/.train-incomplete/`` first and moved into place once the report
is written (``eagle3/`` last), so a failed or interrupted run never leaves a ``target/`` and
``eagle3/`` pair that looks complete, and ``overwrite`` replaces the previous run's outputs whole.

Deterministic for a given ``(preset, seed)`` on a given machine: every random draw comes from a
seeded CPU generator, every kernel is a deterministic one (:func:`deterministic_mode`, strict:
on a GPU the attention backward is otherwise not), and training runs a fixed number of steps.
``time_budget_s`` only cuts stages short (the report then says ``stopped_early``, and the
weights then depend on the clock).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import tokenizers
import torch
import transformers
from tqdm.auto import tqdm

from phasegraph.train import corpus as corpus_mod
from phasegraph.train.eagle3_head import save_eagle3_head
from phasegraph.train.eagle3_train import FrozenTarget, build_head, eval_head, train_head
from phasegraph.train.loop import (
    Deadline,
    deterministic_mode,
    eval_windows,
    stage_generator,
)
from phasegraph.train.presets import (
    Preset,
    TrainInputError,
    check_preset,
    head_flops_per_row,
    head_param_count,
    lm_flops_per_token,
    lm_param_count,
    mib,
    preset_to_dict,
    projected_seconds,
)
from phasegraph.train.simulate import (
    generate_continuations,
    greedy_generate,
    simulate_eagle3,
    simulate_standalone_chain,
)
from phasegraph.train.target import build_lm, eval_lm, save_lm, train_lm
from phasegraph.train.tokenizer import EOS_TOKEN, encode_stream, save_tokenizer, train_tokenizer

__all__ = [
    "STAGE_MFU",
    "PACKAGE_BUDGET_MIB",
    "check_run_options",
    "prepare_out_dir",
    "project",
    "run_recipe",
]

# Share of the H100's bf16 peak each stage reaches in eager PyTorch under strict deterministic
# kernels (measured on the bench-pair preset). The head reaches half the target's: one layer
# unrolled five steps behind the frozen target's forward. A time budget is split over the stages
# in proportion to these projections, so they must be near the truth for a budget that fits
# every stage to cut none.
STAGE_MFU = {"target": 0.17, "head": 0.085, "draft": 0.155}
SELFGEN_STEP_S = 0.015  # projected seconds per batched decode step at least (launch-bound)
SELFGEN_MFU = 0.0065  # a 1024-row decode step of the bench target: 0.037 s on an H100
PACKAGE_BUDGET_MIB = 24.0
FILE_BUDGET_MIB = 16.0
_EVAL_RESERVE = 0.1  # share of a time budget kept for saving and evaluation
STAGING = ".train-incomplete"  # what a run saves into until every file is written
OUTPUTS = ("target", "draft", "train_report.json", "eagle3")  # moved into place in this order
# torch generators take seed * 1000 + a stage offset (at most 12) in [-2**63, 2**64)
MIN_SEED, MAX_SEED = -(2**63 // 1000), (2**64 - 13) // 1000


def project(preset: Preset) -> dict[str, dict]:
    """Projected H100 seconds of each training stage (FLOP count / (peak * the stage's MFU))."""
    v, t = preset.vocab_size, preset.target
    tt, ht, h = preset.target_train, preset.head_train, preset.head
    out = {}
    tokens = tt.steps * tt.batch_size * tt.seq_len
    flops = tokens * lm_flops_per_token(t, v, tt.seq_len)
    out["target"] = {"tokens": tokens, "tflop": flops / 1e12,
                     "s": projected_seconds(flops, STAGE_MFU["target"])}
    if h.selfgen_seqs:
        n_batches = math.ceil(h.selfgen_seqs / h.selfgen_batch)
        gen = ht.seq_len + 1 - h.selfgen_prompt_len
        batch = min(h.selfgen_batch, h.selfgen_seqs)
        step_s = max(SELFGEN_STEP_S, projected_seconds(batch * lm_flops_per_token(t, v, 1, train=False),
                                                       SELFGEN_MFU))
        out["selfgen"] = {"tokens": h.selfgen_seqs * gen, "tflop": 0.0, "s": n_batches * gen * step_s}
    rows = ht.steps * ht.batch_size * ht.seq_len
    flops = rows * head_flops_per_row(h, t, v, ht.seq_len)
    out["head"] = {"tokens": rows, "tflop": flops / 1e12, "s": projected_seconds(flops, STAGE_MFU["head"])}
    if preset.draft is not None and preset.draft_train is not None:
        dt = preset.draft_train
        tokens = dt.steps * dt.batch_size * dt.seq_len
        flops = tokens * (
            lm_flops_per_token(preset.draft, v, dt.seq_len)
            + lm_flops_per_token(t, v, dt.seq_len, train=False)
        )
        out["draft"] = {"tokens": tokens, "tflop": flops / 1e12, "s": projected_seconds(flops, STAGE_MFU["draft"])}
    return out


class _Budget:
    """Splits an overall wall-clock budget over the stages in proportion to their projection."""

    def __init__(self, seconds: float | None, projection: dict[str, dict]):
        self.end = None if seconds is None else time.monotonic() + seconds * (1 - _EVAL_RESERVE)
        self.left = {k: v["s"] for k, v in projection.items()}

    def deadline(self, stage: str) -> Deadline | None:
        if self.end is None:
            return None
        share = self.left.get(stage, 0.0) / max(sum(self.left.values()), 1e-9)
        self.left.pop(stage, None)
        return Deadline(max(0.0, self.end - time.monotonic()) * share)


def _dir_files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}


def _versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _prompt_ids(tok, prompts, limit: int) -> list[list[int]]:
    """Token ids of each prompt; longer ones keep their last ``limit`` tokens (the header)."""
    return [tok.encode(p.text, add_special_tokens=False).ids[-limit:] for p in prompts]


def check_run_options(seed: int = 0, device: str | torch.device | None = None,
                      time_budget_s: float | None = None) -> None:
    """A :class:`TrainInputError` for a seed the generators cannot take, a device that is not
    there, or a time budget that is not a positive number of seconds."""
    if not MIN_SEED <= seed <= MAX_SEED:
        raise TrainInputError(f"seed must be between {MIN_SEED} and {MAX_SEED}, got {seed}")
    if time_budget_s is not None and not (math.isfinite(time_budget_s) and time_budget_s > 0):
        raise TrainInputError(
            f"time_budget_s must be a positive number of seconds, got {time_budget_s}"
        )
    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise TrainInputError(f"device {device}: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise TrainInputError(f"device {device}: training runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainInputError(f"device {device}: no CUDA GPU is available")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise TrainInputError(f"device {device}: there are {torch.cuda.device_count()} GPUs")


def prepare_out_dir(out_dir: str | Path, overwrite: bool = False) -> bool:
    """Check that a run may train into ``out_dir``, create it, and return whether it was
    missing. FileExistsError: a file, or (unless ``overwrite``) a directory holding files (a
    killed run's ``.train-incomplete/`` does not count); :class:`TrainInputError`: an empty name,
    or a directory that cannot be created or written."""
    if not str(out_dir).strip():
        raise TrainInputError("the output directory needs a name, got an empty one")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a directory")
    try:
        held = sorted(p.name for p in out_dir.iterdir() if p.name != STAGING) \
            if out_dir.exists() else []
        if held and not overwrite:
            listed = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise FileExistsError(
                f"{out_dir} is not empty ({listed}): training would overwrite what it holds; "
                "choose a new or empty directory, or overwrite it on purpose (--overwrite)"
            )
        created = not out_dir.exists()
        out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()  # written only at the end: fail now instead
    except FileExistsError:
        raise
    except OSError as exc:
        raise TrainInputError(
            f"{out_dir}: cannot create or write the directory ({exc.strerror or exc})"
        ) from None
    return created


def run_recipe(
    preset: Preset,
    out_dir: str | Path,
    seed: int = 0,
    device: str | torch.device | None = None,
    time_budget_s: float | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> dict:
    """Run every stage, write the files and ``train_report.json``; returns the report. ``log``
    takes the plan, each stage's result and the summary, one string each (None: nothing).
    ``out_dir`` must be missing or empty unless ``overwrite`` (FileExistsError): the run then
    replaces its ``target/``, ``eagle3/``, ``draft/`` and report, and leaves other files alone.
    Bad input (:func:`check_preset`, :func:`check_run_options`, :func:`prepare_out_dir`) is a
    :class:`TrainInputError` before anything is read or written."""
    check_preset(preset)
    check_run_options(seed, device, time_budget_s)
    created = prepare_out_dir(out_dir, overwrite)
    out_dir = Path(out_dir)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        with deterministic_mode():
            return _run(preset, out_dir, seed, device, time_budget_s, progress, log or _silent)
    except BaseException:  # failed or interrupted: nothing half-written stays behind
        shutil.rmtree(out_dir / STAGING, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()  # only if still empty
        raise


def _silent(text: str) -> None:
    """Where the recipe's messages go unless its caller passes a log."""


def _move_into_place(staging: Path, out_dir: Path) -> None:
    """Replace ``out_dir``'s outputs by the staged ones. The old ``eagle3/`` goes first and the
    new one comes last: ``phasegraph bench`` takes ``target/`` + ``eagle3/`` for a complete pair,
    so it never sees one of two runs, or one without its tokenizer or report."""
    for name in reversed(OUTPUTS):
        old = out_dir / name
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        elif old.exists() or old.is_symlink():
            old.unlink()
    for name in OUTPUTS:
        if (staging / name).exists():
            (staging / name).rename(out_dir / name)
    staging.rmdir()


@contextlib.contextmanager
def _save_progress(progress: bool):
    """transformers' "Writing model shards" bar only with ``progress``."""
    was = transformers.utils.logging.is_progress_bar_enabled()
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not progress:
            transformers.utils.logging.enable_progress_bar()


def _run(preset, out_dir, seed, device, time_budget_s, progress, log) -> dict:
    t_start = time.perf_counter()
    walls: dict[str, float] = {}
    report: dict = {
        "preset": preset.name,
        "seed": seed,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or platform.machine(),
        "versions": _versions(),
        "config": preset_to_dict(preset),
    }
    projection = project(preset)
    report["projection_h100"] = {
        "assumed_mfu": STAGE_MFU,
        "stages": {k: {"tokens": v["tokens"], "tflop": round(v["tflop"], 1), "s": round(v["s"], 1)}
                   for k, v in projection.items()},
        "total_training_s": round(sum(v["s"] for v in projection.values()), 1),
    }
    log(format_projection(preset, projection))
    budget = _Budget(time_budget_s, projection)

    # -- corpus and tokenizer ------------------------------------------------------------------
    t0 = time.perf_counter()
    caps = {"train": preset.corpus.max_train_bytes, "valid": preset.corpus.max_valid_bytes,
            "heldout": preset.corpus.max_heldout_bytes}
    files = corpus_mod.split_files(max_bytes=caps)
    texts = {split: corpus_mod.read_texts(fs) for split, fs in files.items()}
    walls["corpus"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = train_tokenizer(texts["train"], preset.vocab_size, preset.tokenizer_min_frequency)
    walls["tokenizer"] = time.perf_counter() - t0
    eos = tok.token_to_id(EOS_TOKEN)
    vocab = tok.get_vocab_size()
    if vocab != preset.vocab_size:
        log(f"note: the tokenizer reached {vocab} tokens (asked for {preset.vocab_size})")
    t0 = time.perf_counter()
    streams = {split: encode_stream(tok, texts[split]) for split in texts}
    walls["encode"] = time.perf_counter() - t0
    _check_data(preset, streams, files["heldout"], vocab)
    report["corpus"] = {
        "stdlib": str(corpus_mod.stdlib_root()),
        "splits": {
            split: {"files": len(files[split]), "bytes": sum(f.size for f in files[split]),
                    "tokens": int(streams[split].numel())}
            for split in files
        },
    }
    train_bytes = report["corpus"]["splits"]["train"]["bytes"]
    report["tokenizer"] = {
        "vocab_size": vocab,
        "bytes_per_token_train": round(train_bytes / max(1, streams["train"].numel()), 3),
    }
    log(f"corpus: {_format_splits(report['corpus']['splits'])}")

    # -- target ---------------------------------------------------------------------------------
    target = build_lm(preset.target, vocab, eos, seed, "target")
    target_log = train_lm(
        target, streams["train"], streams["valid"], preset.target_train, device, seed, "target",
        deadline=budget.deadline("target"), progress=progress,
    )
    walls["target"] = target_log.wall_s
    tt = preset.target_train
    held_windows = eval_windows(streams["heldout"], tt.seq_len + 1, preset.eval.loss_windows)
    held = eval_lm(target, held_windows, device, tt.batch_size)
    report["target"] = {
        "params": lm_param_count(preset.target, vocab),
        "train": target_log.to_dict(),
        "heldout_loss": round(held["loss"], 5),
        "heldout_ppl": round(math.exp(held["loss"]), 4),
        "heldout_top1_accuracy": round(held["accuracy"], 5),
        "heldout_windows": int(held_windows.shape[0]),
    }
    log(f"target: held-out loss {held['loss']:.4f} (ppl {math.exp(held['loss']):.2f})")

    # -- EAGLE-3 head ---------------------------------------------------------------------------
    frozen = FrozenTarget(target)
    hs, ht = preset.head, preset.head_train
    pool = None
    if hs.selfgen_seqs:
        t0 = time.perf_counter()
        pool = _selfgen_pool(frozen, streams["train"], preset, seed, device, budget, progress)
        walls["selfgen"] = time.perf_counter() - t0
        report["selfgen"] = {"sequences": int(pool.shape[0]), "length": int(pool.shape[1]),
                             "generated_tokens": int(pool.shape[0]) *
                             (ht.seq_len + 1 - hs.selfgen_prompt_len),
                             "wall_s": round(walls["selfgen"], 2)}
    head = build_head(hs, preset.target, target, vocab, eos, seed, streams["train"])
    head_log = train_head(
        head, frozen, streams["train"], streams["valid"], hs, ht, device, seed, pool=pool,
        deadline=budget.deadline("head"), progress=progress,
    )
    walls["head"] = head_log.wall_s
    head_windows = eval_windows(streams["heldout"], ht.seq_len + 1, preset.eval.loss_windows)
    head_eval = eval_head(head, frozen, head_windows, hs, device, ht.batch_size)
    report["head"] = {
        "params": head_param_count(hs, preset.target, vocab),
        "aux_layers": list(head.cfg.eagle_aux_layers),
        "draft_vocab_size": head.cfg.draft_vocab_size,
        "train": head_log.to_dict(),
        "heldout_loss": round(head_eval["loss"], 5),
        "heldout_agreement_by_step": [round(a, 5) for a in head_eval["agreement_by_step"]],
        "heldout_windows": int(head_windows.shape[0]),
    }
    agree = ", ".join(f"{a:.3f}" for a in head_eval["agreement_by_step"])
    log(f"eagle3 head: held-out top-1 agreement by draft step: {agree}")

    # -- standalone draft (bench-pair) ------------------------------------------------------
    draft = None
    if preset.draft is not None and preset.draft_train is not None:
        draft = build_lm(preset.draft, vocab, eos, seed, "draft")
        draft_log = train_lm(
            draft, streams["train"], streams["valid"], preset.draft_train, device, seed, "draft",
            teacher=target, deadline=budget.deadline("draft"), progress=progress,
        )
        walls["draft"] = draft_log.wall_s
        dt = preset.draft_train
        dwin = eval_windows(streams["heldout"], dt.seq_len + 1, preset.eval.loss_windows)
        d_eval = eval_lm(draft, dwin, device, dt.batch_size, teacher=target)
        report["draft"] = {
            "params": lm_param_count(preset.draft, vocab),
            "train": draft_log.to_dict(),
            "heldout_distill_loss": round(d_eval["loss"], 5),
            "heldout_data_loss": round(d_eval["data_loss"], 5),
            "heldout_agreement": round(d_eval["agreement"], 5),
        }

    # -- save -----------------------------------------------------------------------------------
    t0 = time.perf_counter()
    dtype = getattr(torch, preset.save_dtype)
    context = preset.target.context
    staging = out_dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)  # a killed run's leftovers
    staging.mkdir()
    dirs = {"target": staging / "target", "eagle3": staging / "eagle3"}
    with _save_progress(progress):
        save_lm(target, dirs["target"], dtype)
        save_tokenizer(tok, dirs["target"], context)
        save_eagle3_head(head, dirs["eagle3"], dtype)
        if draft is not None:
            dirs["draft"] = staging / "draft"
            save_lm(draft, dirs["draft"], dtype)
            save_tokenizer(tok, dirs["draft"], context)
    for d in dirs.values():  # safetensors writes 0600; the files are meant to be shipped
        for f in d.iterdir():
            f.chmod(0o644)
    walls["save"] = time.perf_counter() - t0
    report["files"] = {name: _dir_files(d) for name, d in dirs.items()}
    shipped = [s for name in ("target", "eagle3") for s in report["files"][name].values()]
    report["package_size"] = {
        "target_plus_head_mib": round(mib(sum(shipped)), 3),
        "largest_file_mib": round(mib(max(shipped)), 3),
        "within_budget": mib(sum(shipped)) <= PACKAGE_BUDGET_MIB
        and mib(max(shipped)) <= FILE_BUDGET_MIB,
    }

    # -- simulated speculative decoding on held-out prompts (eval.max_prompts=0: skipped) -------
    report["acceptance"] = None
    if preset.eval.max_prompts > 0:
        t0 = time.perf_counter()
        report["acceptance"] = _acceptance(
            preset, tok, files["heldout"], target, head, draft, frozen, device, dtype, eos
        )
        walls["acceptance"] = time.perf_counter() - t0

    walls["total"] = time.perf_counter() - t_start
    report["wall_s"] = {k: round(v, 2) for k, v in walls.items()}
    report["stopped_early"] = any(
        report.get(k, {}).get("train", {}).get("stopped_early", False)
        for k in ("target", "head", "draft")
    )
    (staging / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    _move_into_place(staging, out_dir)
    log(format_summary(report))
    return report


def _check_data(preset: Preset, streams: dict[str, torch.Tensor], heldout, vocab: int) -> None:
    """A :class:`TrainInputError` where a corpus cap leaves a split shorter than the windows
    the stages draw from it or no held-out prompt for the simulated decode, or the tokenizer
    reached fewer tokens than the head's vocabulary or the tree's top-k need."""
    stages = [("target_train", preset.target_train), ("head_train", preset.head_train)]
    if preset.draft_train is not None:
        stages.append(("draft_train", preset.draft_train))
    name, spec = max(stages, key=lambda s: s[1].seq_len)
    need = spec.seq_len + 1
    bad = []
    for split in ("train", "valid", "heldout"):
        have = int(streams[split].numel())
        if have < need + (split == "train"):  # training samples windows at random offsets
            cap = getattr(preset.corpus, f"max_{split}_bytes")
            bad.append(f"corpus.max_{split}_bytes={cap} leaves {have} {split} tokens, "
                       f"fewer than one {need}-token window ({name}.seq_len + 1)")
    if not bad and preset.eval.max_prompts > 0 and not corpus_mod.heldout_prompts(
            max_lines=preset.eval.prompt_max_lines, max_prompts=1, files=heldout):
        bad.append(f"corpus.max_heldout_bytes={preset.corpus.max_heldout_bytes} leaves no "
                   "held-out file long enough for a prompt (eval.max_prompts=0 skips them)")
    h, ev = preset.head, preset.eval
    if h.draft_vocab_size is not None and h.draft_vocab_size > vocab:
        bad.append(f"head.draft_vocab_size {h.draft_vocab_size} must be at most the {vocab} "
                   f"tokens the tokenizer reached (vocab_size {preset.vocab_size})")
    elif ev.max_prompts > 0 and ev.tree_topk > min(vocab, h.draft_vocab_size or vocab):
        bad.append(f"eval.tree_topk {ev.tree_topk} must be at most the draft vocabulary "
                   f"({min(vocab, h.draft_vocab_size or vocab)} tokens: the tokenizer reached "
                   f"{vocab} of vocab_size {preset.vocab_size})")
    if bad:
        raise TrainInputError(f"preset {preset.name!r}: " + "; ".join(bad))


def _selfgen_pool(frozen, stream, preset, seed, device, budget, progress) -> torch.Tensor:
    """Target greedy continuations of random train windows: ``[n, head_seq_len + 1]``."""
    hs, ht = preset.head, preset.head_train
    length = ht.seq_len + 1
    prompt_len = min(hs.selfgen_prompt_len, length - 1)
    g = stage_generator(seed, "selfgen")
    deadline = budget.deadline("selfgen")
    seqs = []
    made = 0
    bar = tqdm(total=hs.selfgen_seqs, desc="selfgen", disable=not progress, dynamic_ncols=True)
    while made < hs.selfgen_seqs and not (deadline is not None and deadline.expired()):
        n = min(hs.selfgen_batch, hs.selfgen_seqs - made)
        starts = torch.randint(0, stream.numel() - prompt_len, (n,), generator=g)
        prompts = stream[starts[:, None] + torch.arange(prompt_len)].to(device)
        mask = torch.ones_like(prompts)
        new = greedy_generate(frozen.model, prompts, mask, length - prompt_len)
        seqs.append(torch.cat([prompts, new], dim=1).cpu())
        made += n
        bar.update(n)
    bar.close()
    return torch.cat(seqs) if seqs else torch.zeros(0, length, dtype=torch.int64)


def _acceptance(preset, tok, heldout, target, head, draft, frozen, device, dtype, eos) -> dict:
    """Greedy continuations of held-out prompts, then the simulated draft loops (in the saved
    dtype on CUDA; fp32 on CPU)."""
    ev = preset.eval
    if device.type == "cuda":
        target.to(dtype)
        head.to(dtype)
        if draft is not None:
            draft.to(dtype)
    prompts = corpus_mod.heldout_prompts(
        max_lines=ev.prompt_max_lines, max_prompts=ev.max_prompts, files=heldout
    )
    limit = preset.target.context - ev.gen_tokens - 1
    prompt_ids = _prompt_ids(tok, prompts, limit)
    seqs = generate_continuations(
        target, prompt_ids, ev.gen_tokens, device, batch_size=64, pad_id=eos
    )
    lens = [len(p) for p in prompt_ids]
    out = {
        "prompts": len(prompts),
        "prompt_tokens_mean": round(sum(lens) / max(1, len(lens)), 1),
        "gen_tokens": ev.gen_tokens,
        "dtype": str(dtype).removeprefix("torch.") if device.type == "cuda" else "float32",
    }
    chain = simulate_eagle3(head, frozen, seqs, lens, 1, ev.chain_steps, ev.chain_steps + 1,
                            device, eos)
    tree = simulate_eagle3(head, frozen, seqs, lens, ev.tree_topk, ev.tree_steps, ev.tree_nodes,
                           device, eos)
    out["eagle3_chain"] = {"steps": ev.chain_steps, **chain.to_dict()}
    out["eagle3_tree"] = {"topk": ev.tree_topk, "steps": ev.tree_steps,
                          "nodes": ev.tree_nodes, **tree.to_dict()}
    if draft is not None:
        sc = simulate_standalone_chain(draft, seqs, lens, ev.chain_steps, device, eos)
        out["standalone_chain"] = {"steps": ev.chain_steps, **sc.to_dict()}
    return out


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------


def _format_splits(splits: dict) -> str:
    return "; ".join(
        f"{k} {v['files']} files / {v['bytes'] / 1e6:.2f} MB / {v['tokens'] / 1e6:.3f}M tokens"
        for k, v in splits.items()
    )


def format_projection(preset: Preset, projection: dict) -> str:
    mfu = ", ".join(f"{stage} {share:.1%}" for stage, share in STAGE_MFU.items())
    lines = [f"[{preset.name}] projected H100 time at {mfu} of 790 TFLOP/s bf16:"]
    for stage, p in projection.items():
        lines.append(
            f"  {stage:<8} {p['tokens'] / 1e6:9.1f}M tokens {p['tflop']:9.1f} TFLOP  ~{p['s']:6.0f} s"
        )
    lines.append(f"  {'total':<8} {'':>37}  ~{sum(p['s'] for p in projection.values()):6.0f} s")
    return "\n".join(lines)


def format_summary(report: dict) -> str:
    rows: list[tuple[str, str]] = []
    add = rows.append
    add(("preset / seed / device", f"{report['preset']} / {report['seed']} / "
         f"{report['device']} ({report['device_name']})"))
    v = report["versions"]
    add(("versions", f"python {v['python']}, torch {v['torch']}, transformers "
         f"{v['transformers']}, tokenizers {v['tokenizers']}"))
    for split, s in report["corpus"]["splits"].items():
        add((f"corpus {split}", f"{s['files']} files, {s['bytes']:,} bytes, {s['tokens']:,} tokens"))
    add(("tokenizer", f"vocab {report['tokenizer']['vocab_size']}, "
         f"{report['tokenizer']['bytes_per_token_train']} bytes/token"))
    t = report["target"]
    add(("target", f"{t['params'] / 1e6:.2f}M params; steps {t['train']['steps']}/"
         f"{t['train']['planned_steps']} (best valid @ {t['train']['best_step']})"))
    add(("target held-out", f"loss {t['heldout_loss']:.4f}, ppl {t['heldout_ppl']:.2f}, "
         f"top-1 acc {t['heldout_top1_accuracy']:.4f}"))
    h = report["head"]
    add(("eagle3 head", f"{h['params'] / 1e6:.2f}M params, aux layers {h['aux_layers']}; steps "
         f"{h['train']['steps']}/{h['train']['planned_steps']} (best valid @ "
         f"{h['train']['best_step']})"))
    add(("head held-out agreement", " ".join(
        f"s{i + 1}={a:.3f}" for i, a in enumerate(h["heldout_agreement_by_step"]))))
    if "draft" in report:
        d = report["draft"]
        add(("standalone draft", f"{d['params'] / 1e6:.2f}M params, held-out agreement "
             f"{d['heldout_agreement']:.4f}, data loss {d['heldout_data_loss']:.4f}"))
    a = report["acceptance"]
    if a is None:
        add(("simulated tau (held-out)", "not run (eval.max_prompts=0)"))
    else:
        add(("simulated tau (held-out)", f"{a['prompts']} prompts x {a['gen_tokens']} tokens, "
             f"{a['dtype']}"))
        c, tr = a["eagle3_chain"], a["eagle3_tree"]
        add(("  eagle3 chain", f"S={c['steps']}: tau {c['tau']:.3f} over {c['verify_steps']} steps"))
        add(("  eagle3 tree", f"K={tr['topk']} S={tr['steps']} N={tr['nodes']}: tau {tr['tau']:.3f}"))
        if "standalone_chain" in a:
            s = a["standalone_chain"]
            add(("  standalone chain", f"S={s['steps']}: tau {s['tau']:.3f}"))
    p = report["package_size"]
    add(("size target+head+tok", f"{p['target_plus_head_mib']:.2f} MiB (largest file "
         f"{p['largest_file_mib']:.2f} MiB) within budget: {p['within_budget']}"))
    add(("wall s", ", ".join(f"{k} {v:.1f}" for k, v in report["wall_s"].items())))
    if report["stopped_early"]:
        add(("NOTE", "a stage stopped early on the time budget"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}} | {val}" for k, val in rows)
