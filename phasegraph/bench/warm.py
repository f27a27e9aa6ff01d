"""Compile part 1's kernels while the pair trains: a second process runs every phasegraph
configuration of part 1 once, at every batch size, on a random pair of the preset's shapes.

On a fresh machine Triton compiles each kernel the first time a configuration launches it,
which nearly doubled part 1's wall time. Triton keeps compiled kernels on disk, keyed by source
and specialisation, so kernels compiled here on the same shapes and dtypes are loaded, not
compiled, when part 1 launches them. The timed calls are unaffected: every call runs twice
before it is timed; only the bench's wall time changes.

    python -m phasegraph.cli.bench_warmup SPEC_JSON      # what phasegraph.bench.pair starts
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from phasegraph.bench.common import PG_CONFIGS, REPO_ROOT, free_memory
from phasegraph.runtime.errors import is_out_of_memory

WARM_NEW_TOKENS = 8  # enough for prefill, draft-extend and a few iterations of every phase
RETRY_FREE_BYTES = 8 << 30  # free device memory a configuration that ran out waits for (part
# 1's engines on the bench pair use ~2.4 GiB)
RETRY_WAIT_S = 900.0  # the longest a configuration that ran out waits for that memory (part 1
# stops the warm-up WARM_WAIT_S after the training ends in any case)


def start(worker: Sequence[str], spec: dict, log_path: Path) -> subprocess.Popen:
    """The warm-up process: the command line ``worker`` (it calls :func:`run_spec`) given
    ``spec`` as JSON, its output in ``log_path``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:  # the child writes to its own copy of the descriptor
        return subprocess.Popen([*worker, json.dumps(spec)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)


def finish(proc: subprocess.Popen, started: float, timeout_s: float) -> dict:
    """Wait for the warm-up (killed past ``timeout_s``); its record for bench.json."""
    waited = time.perf_counter()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    now = time.perf_counter()
    return {"wall_s": round(now - started, 1), "waited_s": round(now - waited, 1), "returncode": code}


def write_random_pair(preset, directory: Path, seed: int) -> dict[str, Path]:
    """target/, eagle3/ and (where the preset trains one) draft/ with the shapes, config fields
    and saved dtype of the pair ``phasegraph.train`` writes, random weights, no tokenizer."""
    import torch

    from phasegraph.train.eagle3_head import save_eagle3_head
    from phasegraph.train.eagle3_train import build_head
    from phasegraph.train.target import build_lm, save_lm

    vocab, eos = preset.vocab_size, 0
    dtype = getattr(torch, preset.save_dtype)
    target = build_lm(preset.target, vocab, eos, seed, "target")
    save_lm(target, directory / "target", dtype)
    head = build_head(preset.head, preset.target, target, vocab, eos, seed, torch.arange(vocab).repeat(4))
    save_eagle3_head(head, directory / "eagle3", dtype)
    dirs = {"target": directory / "target", "eagle3": directory / "eagle3", "draft": None}
    if preset.draft is not None:
        save_lm(build_lm(preset.draft, vocab, eos, seed, "draft"), directory / "draft", dtype)
        dirs["draft"] = directory / "draft"
    return dirs


def accept_lengths(spec_kw: dict) -> list[int | None]:
    """The acceptance lengths a configuration's warm-up runs: the random draft's own (None:
    nearly always 1), then every longer one up to ``num_steps + 1`` by SIMULATED acceptance, so
    that draft-extend and the KV compaction run (and compile) at every width a trained pair's
    accepted paths give them."""
    if spec_kw["method"] == "none":
        return [None]
    return [None, *range(2, spec_kw["num_steps"] + 2)]


def _warm_config(spec: dict, dirs: dict[str, Path], spec_kw: dict, draft_key: str | None,
                 params, vocab: int, g) -> int:
    """One configuration's engines (every acceptance length) and a short ``generate`` per batch
    size; the number of calls made."""
    import torch

    from phasegraph import Engine, SpecConfig

    calls = 0
    for tau in accept_lengths(spec_kw):
        engine = Engine.from_pretrained(
            dirs["target"], dirs[draft_key] if draft_key else None, spec=SpecConfig(**spec_kw),
            **spec["engine"], simulate_accept_length=tau,
        )
        for b in spec["batches"]:
            # prompt lengths spread below the cap, as the held-out prompts' are (mean ~0.85 of it)
            lengths = [max(8, spec["prompt_tokens"] - (37 * i) % (spec["prompt_tokens"] // 3 + 1))
                       for i in range(b)]
            prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
            engine.generate(prompts, params)
            calls += 1
        del engine
        free_memory()
    return calls


def _try_config(*args) -> int | None:
    """:func:`_warm_config`'s calls, or None where it ran out of device memory (released)."""
    try:
        return _warm_config(*args)
    except RuntimeError as exc:  # torch.OutOfMemoryError, or a CUDA call's own
        if not is_out_of_memory(exc):
            raise
        free_memory()
        return None


def device_free_bytes() -> int | None:
    """Free memory of the current CUDA device, all processes counted (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return free


def wait_for_memory(min_free: int, timeout_s: float, free_bytes=device_free_bytes,
                    sleep=time.sleep, poll_s: float = 2.0) -> bool:
    """Whether the device has ``min_free`` bytes free within ``timeout_s`` (polled): the training
    beside the warm-up holds most of the GPU's memory in its allocator's cache until it ends,
    and part 1 releases that cache before it waits for the warm-up."""
    deadline = time.perf_counter() + timeout_s
    while True:
        free = free_bytes()
        if free is None or free >= min_free:
            return True
        if time.perf_counter() >= deadline:
            return False
        sleep(poll_s)


def run_configs(spec: dict, dirs: dict[str, Path], log: Callable[[str], None], *,
                free_bytes=device_free_bytes, sleep=time.sleep) -> int:
    """Engines of every part-1 configuration (and acceptance length, :func:`accept_lengths`), one
    short ``generate`` per batch size; the number of calls made. A configuration that runs out
    of device memory (the training beside it can hold nearly all of it) is tried again
    once :data:`RETRY_FREE_BYTES` are free, within :data:`RETRY_WAIT_S`; else it is skipped
    with a message (part 1 then compiles its kernels itself)."""
    import torch

    from phasegraph import SamplingParams

    g = torch.Generator().manual_seed(spec["seed"])
    vocab = json.loads((dirs["target"] / "config.json").read_text())["vocab_size"]
    params = SamplingParams(max_new_tokens=WARM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    calls = 0
    retry = []
    for label, spec_kw, draft_key in PG_CONFIGS:
        if (draft_key is not None and dirs[draft_key] is None) or spec_kw.get("adaptive"):
            continue  # adaptive speculation runs the chain's and the tree's kernels
        t0 = time.perf_counter()
        made = _try_config(spec, dirs, spec_kw, draft_key, params, vocab, g)
        if made is None:
            log(f"warm-up: {label}: out of device memory (another process holds it: in the "
                f"bench, the training); tried again when {RETRY_FREE_BYTES >> 30} GiB are free")
            retry.append((label, spec_kw, draft_key))
            continue
        calls += made
        log(f"warm-up: {label}: {time.perf_counter() - t0:.1f} s")
    for label, spec_kw, draft_key in retry:
        if not wait_for_memory(RETRY_FREE_BYTES, RETRY_WAIT_S, free_bytes, sleep):
            log(f"warm-up: {label}: skipped, {RETRY_FREE_BYTES >> 30} GiB of device memory were "
                f"not free within {RETRY_WAIT_S:.0f} s (part 1 compiles its kernels itself)")
            continue
        t0 = time.perf_counter()
        made = _try_config(spec, dirs, spec_kw, draft_key, params, vocab, g)
        if made is None:
            log(f"warm-up: {label}: skipped, out of device memory again (part 1 compiles its "
                f"kernels itself)")
            continue
        calls += made
        log(f"warm-up: {label}: {time.perf_counter() - t0:.1f} s (second try)")
    return calls


def run_spec(spec: dict, log: Callable[[str], None]) -> int:
    """What the warm-up process does: a random pair of the spec's preset in a temporary
    directory, then :func:`run_configs` on it; the number of calls made."""
    from phasegraph.train.presets import PRESETS, apply_overrides

    preset = apply_overrides(PRESETS[spec["preset"]], spec["overrides"])
    with tempfile.TemporaryDirectory(prefix="phasegraph-warm-") as tmp:
        dirs = write_random_pair(preset, Path(tmp), spec["seed"])
        return run_configs(spec, dirs, log)
