"""Compile part 1's kernels while the pair trains: a second process runs every phasegraph
configuration of part 1 once, at every batch size, on a random pair of the preset's shapes.

On a fresh machine Triton compiles each kernel the first time a configuration launches it.
Run 22 (fresh machine, one call) spent 170 s in part 1's phasegraph rows; run 23 (same code,
Triton cache already filled) spent 94 s (bench/RESULTS.md §5). Triton keeps compiled kernels on
disk, keyed by source and specialisation, so kernels compiled here on the same shapes and dtypes
are loaded, not compiled, when part 1 launches them. The timed calls are unaffected: they were
always warm (every call runs twice before it is timed); only the bench's wall time changes.

    python -m phasegraph.bench.warm SPEC_JSON      # what phasegraph.bench.pair starts
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phasegraph.bench.common import PG_CONFIGS, REPO_ROOT

WARM_NEW_TOKENS = 8  # enough for prefill, draft-extend and a few iterations of every phase


def warm_spec(run, preset_name: str, overrides: list[str], preset) -> dict:
    """What the second process needs to build the engines part 1 builds: part 1's engine
    keywords (:func:`phasegraph.bench.pair.engine_settings`), with its prompt cap and KV pool."""
    from phasegraph.bench.pair import engine_settings, kv_pool_tokens, prompt_cap

    a = run.args
    prompt_tokens = prompt_cap(a, preset.target.context)
    kv_tokens = kv_pool_tokens(max(a.batch_list), prompt_tokens, a.new_tokens)
    return {"preset": preset_name, "overrides": overrides, "seed": a.seed, "batches": a.batch_list,
            "prompt_tokens": prompt_tokens, "engine": engine_settings(run, kv_tokens)}


def start(spec: dict, log_path: Path) -> subprocess.Popen:
    """The warm-up process, its output in ``log_path``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:  # the child writes to its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "phasegraph.bench.warm", json.dumps(spec)],
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


def run_configs(spec: dict, dirs: dict[str, Path], log=print) -> int:
    """Engines of every part-1 configuration (and acceptance length, :func:`accept_lengths`), one
    short ``generate`` per batch size; the number of calls made."""
    import torch

    from phasegraph import Engine, SamplingParams, SpecConfig

    g = torch.Generator().manual_seed(spec["seed"])
    vocab = json.loads((dirs["target"] / "config.json").read_text())["vocab_size"]
    params = SamplingParams(max_new_tokens=WARM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    calls = 0
    for label, spec_kw, draft_key in PG_CONFIGS:
        if draft_key is not None and dirs[draft_key] is None:
            continue
        t0 = time.perf_counter()
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
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        log(f"warm-up: {label}: {time.perf_counter() - t0:.1f} s", flush=True)
    return calls


def main(argv: list[str] | None = None) -> int:
    from phasegraph.train.presets import PRESETS, apply_overrides

    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    preset = apply_overrides(PRESETS[spec["preset"]], spec["overrides"])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="phasegraph-warm-") as tmp:
        dirs = write_random_pair(preset, Path(tmp), spec["seed"])
        calls = run_configs(spec, dirs)
    print(f"warm-up: {calls} calls in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
