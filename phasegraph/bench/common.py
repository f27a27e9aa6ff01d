"""Shared pieces of ``phasegraph bench``: configurations, the run's state, small helpers and
the environment record."""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# (label, SpecConfig kwargs, which draft directory of the pair); the fixed shapes pin
# adaptive=False, which a GPU engine would otherwise turn on
_TREE = {"method": "eagle3", "num_steps": 4, "topk": 4, "num_draft_tokens": 16}
PG_CONFIGS = (
    ("baseline (autoregressive)", {"method": "none"}, None),
    ("EAGLE-3 chain S=3", {"method": "eagle3", "num_steps": 3, "topk": 1, "adaptive": False}, "eagle3"),
    ("EAGLE-3 tree K=4 S=4 N=16", {**_TREE, "adaptive": False}, "eagle3"),
    ("standalone draft chain S=3", {"method": "standalone", "num_steps": 3, "topk": 1, "adaptive": False}, "draft"),
    ("EAGLE-3 adaptive, up to the tree", {**_TREE, "adaptive": True}, "eagle3"),
)
BASELINE, CHAIN, TREE, STANDALONE, ADAPTIVE = (c[0] for c in PG_CONFIGS)
# --pair-configs names; the baseline always runs (every row is compared with it)
PAIR_CONFIG_KEYS = {"chain": CHAIN, "tree": TREE, "standalone": STANDALONE, "adaptive": ADAPTIVE}
# the fixed configurations adaptive speculation chooses among (its goals compare with these)
ADAPTIVE_FIXED = (BASELINE, CHAIN, TREE)
HF_PLAIN = "transformers generate"
HF_ASSISTED = "transformers generate + assistant_model (batch 1 only: assisted generation does not batch)"
# Part 2 drafts: the chain is the default. Simulated acceptance takes the first-child path of the
# drafted tree; with random weights every draft probability is small (~1e-3 at the 8B shape, by
# estimate: logits of std ~1.3 over 32k tokens), so
# a tree's score (the product along the path) drops ~1000x per level, a K=4 S=4 N=16 tree keeps
# its 4 depth-1 and 11 depth-2 nodes, and τ stops at 3 (seen in --quick: measured τ 3.00 at a
# simulated 4); a chain with S=3 always holds a path of 3 drafts, so τ = 4 is reachable.
# The adaptive row chooses among off and chains of 1 and 3 (the tree's τ stops at 3 here).
SCALE_CONFIGS = {
    "chain": ("chain S=3", {"method": "eagle3", "num_steps": 3, "topk": 1, "adaptive": False}),
    "tree": ("tree K=4 S=4 N=16", {**_TREE, "adaptive": False}),
    "adaptive": ("adaptive (off, chains S=1 and 3)", {"method": "eagle3", "num_steps": 3, "topk": 1, "adaptive": True}),
}


class BenchError(Exception):
    """A bench run that cannot start or go on as asked (a missing GPU or pair, an output
    directory that cannot be made): it stops the run, where other errors only lose their rows."""


def _silent(text: str) -> None:
    """Where a run's messages go unless its caller passes a log."""


class BenchRun:
    """One ``phasegraph bench`` run: its options, device, output directory and the result dict
    that every part fills in.

    ``log`` takes each progress line and the final table, ``log_error`` the traceback of an
    error a row group survives (both silent by default); ``warm_worker`` is the command line
    that runs the kernel warm-up process (:mod:`phasegraph.bench.warm`), given the spec as its
    last argument (None: part 1 compiles its kernels itself)."""

    def __init__(self, args: argparse.Namespace, log: Callable[[str], None] = _silent,
                 log_error: Callable[[str], None] = _silent, warm_worker: Sequence[str] | None = None):
        import torch

        self.args = args
        self.log = log
        self.log_error = log_error
        self.warm_worker = warm_worker
        self.t0 = time.perf_counter()
        self.out = Path(args.out)
        self.device = torch.device(args.device if args.device != "auto" else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        # --dry-run too: its plan would be of a run that cannot start
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BenchError("--device cuda: no CUDA GPU is available")
        if self.device.type != "cuda" and not args.quick and not args.dry_run:
            raise BenchError("the full bench (a ~96M pair, the 8B shape) needs a CUDA GPU: use --quick on the CPU")
        if self.out.exists() and not self.out.is_dir():
            raise BenchError(f"--out {self.out}: exists and is not a directory")
        if not args.dry_run:  # a dry run prints the plan and makes nothing
            try:
                self.out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise BenchError(f"--out {self.out}: cannot create the directory ({exc.strerror or exc})") from None
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32  # part 2 (the 8B shape)
        # part 1: float32 by default, so that "identical to the baseline" is exact: in bf16 the
        # rounding of a product depends on its batch shape (a verify of B*N tokens vs a decode of
        # B), and greedy picks at near-ties flip
        self.pair_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.pair_dtype]
        # the drafts (EAGLE-3 head, standalone draft, transformers' assistant): bfloat16 on a GPU,
        # as their checkpoints are saved; a draft only proposes, so this moves τ, never the output
        draft_dtype = getattr(args, "draft_dtype", None) or ("bfloat16" if self.cuda else args.pair_dtype)
        self.draft_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[draft_dtype]
        self.graphs = self.cuda
        self.prefill_graphs = self.graphs and args.prefill_graphs  # replayed per request and token bucket
        self.result: dict = {
            "command": "phasegraph bench " + " ".join(args.argv),
            "quick": args.quick,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "settings": {},
            "parts_wall_s": {},
            "trained_pair": None,
            "scale": None,
            "goals": [],
            "skipped": [],
        }

    def guard(self, what: str, fn, *args, **kwargs):
        """Run ``fn``; an exception is recorded under ``errors`` (its traceback to ``log_error``)
        instead of ending the run, so one failing row leaves the others measured. Interrupts and
        :class:`BenchError` pass through."""
        try:
            return fn(*args, **kwargs)
        except BenchError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded, reported, and the exit status says so
            import traceback

            self.log_error(traceback.format_exc().rstrip("\n"))
            self.result.setdefault("errors", []).append(f"{what}: {type(exc).__name__}: {exc}")
            free_memory()
            return None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out_of_time(self, what: str) -> bool:
        limit = self.args.time_limit_s
        if limit and self.elapsed() > limit:
            self.result["skipped"].append(f"{what}: skipped, --time-limit-s {limit:.0f} s reached")
            return True
        return False

    def pair_path(self) -> Path:
        """``--pair``, else ``OUT/pair``."""
        return pair_path(self.args)


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------


def fmt(x, spec: str = ".2f", none: str = "–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def fill_random_weights(*modules) -> None:
    """Random weights as every benchmark model gets them: vectors (norm weights) 1, matrices
    normal(0, 0.02), parameters in module order."""
    import torch

    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                if p.ndim == 1:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)


def _tensor_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def forward_weight_bytes(model) -> int:
    """Bytes of weights one forward of a causal LM streams at batch 1: every parameter but an
    input embedding table the lm_head does not share (a step gathers only B rows of it; a tied
    table is read whole by the lm_head)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    return _tensor_bytes(p for p in model.parameters() if tied or p is not embed)


def iteration_weight_bytes(engine) -> dict | None:
    """Weight bytes a batch-1 decode step and a speculative iteration of ``engine`` stream: the
    target once (a decode step; verify runs every tree node in one forward), then the draft's S
    forwards (draft-extend and the S-1 draft steps), each reading the draft's weights and its
    lm_head; an EAGLE-3 head's ``fc`` only in draft-extend, on the target features. None for the
    methods the bench does not run (EAGLE-1 and MTP heads read other weights per step).

    With every weight read from memory once per forward (a bandwidth-bound GPU), η could not
    pass ``step / iteration``: the bound the weight bytes alone put on η, whatever the kernels.
    """
    target, method = engine.target.model, engine.spec.method
    step = forward_weight_bytes(target)
    once = per_pass = 0
    if method == "eagle3":  # the embedding stays in the target; the head has its own lm_head
        once = _tensor_bytes(engine.draft.head.fc.parameters())
        per_pass = _tensor_bytes(engine.draft.head.parameters()) - once
    elif method == "standalone":
        per_pass = forward_weight_bytes(engine.draft.model.model)  # StandaloneDraft wraps an HFTarget
    elif method != "none":
        return None
    passes = 0 if method == "none" else engine.spec.num_steps
    iteration = step + passes * per_pass + once
    return {"step": step, "draft_pass": per_pass, "draft_passes": passes, "draft_once": once,
            "iteration": iteration, "eta_bound": step / iteration}


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_call(device, fn, freeze_gc: bool = True):
    """``(seconds, fn(), gc)``: the wall time of ``fn()`` between two device synchronisations,
    and the garbage-collector pauses inside it (``{"pauses": n, "seconds": s}``).

    With ``freeze_gc`` the heap that exists before the call (imports, models, the engine) is
    collected once and frozen for the call (``gc.freeze``), as serving engines do after warm-up:
    a full collection then scans only what the call allocates instead of the ~10^6 objects
    that torch and transformers import, so a collection in the middle of a timed call pauses
    it for well under a millisecond instead of tens of milliseconds, for the baseline and every
    other row alike. The heap is unfrozen afterwards."""
    pauses: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    if freeze_gc:
        gc.collect()
        gc.freeze()
    sync(device)
    gc.callbacks.append(on_gc)
    try:
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
        if freeze_gc:
            gc.unfreeze()
    return wall, out, {"pauses": len(pauses), "seconds": sum(pauses), "frozen": freeze_gc}


def timed_calls(run: BenchRun, calls: list[list], generate) -> tuple[float, list, dict]:
    """``timed_call`` for each call in turn: the summed wall time, the outputs in order and the
    summed collector pauses."""
    wall, outs, pauses, seconds = 0.0, [], 0, 0.0
    for batch in calls:
        w, out, g = timed_call(run.device, lambda batch=batch: generate(batch), run.args.gc == "freeze")
        wall, outs, pauses, seconds = wall + w, outs + list(out), pauses + g["pauses"], seconds + g["seconds"]
    return wall, outs, {"pauses": pauses, "seconds": seconds, "frozen": run.args.gc == "freeze"}


def repeats_at(run: BenchRun, batch: int) -> int:
    """Timed runs of a row at ``batch``, whose median it keeps: ``--batch1-repeats`` at batch 1,
    ``--repeats`` above."""
    return run.args.batch1_repeats if batch == 1 else run.args.repeats


def warm_then_time(run: BenchRun, engine, calls: list[list], params, repeats: int = 1) -> tuple[list, float, list, dict, int]:
    """Run each of ``calls`` (lists of prompts) through ``engine.generate`` twice, then time them
    (:func:`timed_calls`) ``repeats`` times and keep the repetition of median wall time, with its
    trace: ``(warm-up outputs, wall, outputs, gc pauses, graphs captured while timed)``. Twice
    because a CUDA graph is captured the second time its bucket is used (a bucket a call uses
    once, as requests finish one by one, or a prefill bucket), so the timed calls replay graphs
    only; the last figure says whether they did (0). Repeats: a call of ~60 ms on a lent
    machine's host now and then runs 20 % slower, which a single
    timing passes on to the row's speedup."""
    warm = []
    for batch in calls:
        warm += engine.generate(batch, params)
        engine.generate(batch, params)
    timings = []
    for _ in range(max(1, repeats)):
        if engine.trace is not None:
            engine.trace.clear()
        before = graph_count(engine)
        wall, outs, gc_pauses = timed_calls(run, calls, lambda batch: engine.generate(batch, params))
        transitions = list(engine.trace) if engine.trace is not None else []
        timings.append((wall, outs, gc_pauses, graph_count(engine) - before, transitions))
    timings.sort(key=lambda t: t[0])
    wall, outs, gc_pauses, captured, transitions = timings[len(timings) // 2]
    if engine.trace is not None:  # the row's iterations, prefill time and phase shares: the median run's
        engine.trace.clear()
        for t in transitions:
            engine.trace.record(t)
    return warm, wall, outs, gc_pauses, sum(t[3] for t in timings)


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pair_path(args: argparse.Namespace) -> Path:
    """``--pair``, else ``OUT/pair``."""
    return Path(args.pair) if args.pair else Path(args.out) / "pair"


def has_pair(d: Path) -> bool:
    return (d / "target" / "config.json").exists() and (d / "eagle3" / "config.json").exists()


PAIR_MODELS = ("target", "eagle3", "draft")


def pair_weight_digests(d: Path) -> dict[str, str]:
    """``{"target": sha256[:16], ...}`` of each model's safetensors files (in name order) in the
    pair directory ``d``: two runs whose digests agree measured the same weights, so their τ
    agree too."""
    digests = {}
    for model in PAIR_MODELS:
        files = sorted((d / model).glob("*.safetensors"))
        if files:
            h = hashlib.sha256()
            for f in files:
                with f.open("rb") as fh:
                    for block in iter(lambda: fh.read(1 << 24), b""):
                        h.update(block)
            digests[model] = h.hexdigest()[:16]
    return digests


def training_steps(report: dict) -> dict[str, list[int]]:
    """``{"target": [steps, planned], ...}`` of a training report's stages."""
    out = {}
    for stage, section in report.items():
        train = section.get("train") if isinstance(section, dict) else None
        if isinstance(train, dict) and "planned_steps" in train:
            out[stage] = [train.get("steps"), train["planned_steps"]]
    return out


def no_pair_to_skip_to(d: Path) -> BenchError:
    """The error of ``--skip-train`` where ``d`` holds no pair."""
    return BenchError(f"--skip-train: {d} holds no trained pair (target/ and eagle3/ with config.json)")


def check_reused_pair(d: Path) -> None:
    """A :class:`BenchError` naming the file where a pair to reuse has a ``config.json`` (target/,
    eagle3/, and draft/ when it has one) that the runtime's own reader refuses: not JSON, not an
    object, a size field out of range, or no supported ``model_type``."""
    from phasegraph.runtime.errors import PhasegraphRuntimeError
    from phasegraph.runtime.models.loading import read_config
    from phasegraph.runtime.models.target import check_model_type
    from phasegraph.statemachine.errors import one_line

    for role in PAIR_MODELS:
        directory = d / role
        if role == "draft" and not (directory / "config.json").exists():
            continue  # no standalone draft: its rows are skipped (or, with --quick, a random one made)
        try:
            check_model_type(read_config(directory).get("model_type"), str(directory / "config.json"))
        except PhasegraphRuntimeError as exc:
            raise BenchError(f"--pair {d}: cannot reuse the pair: {one_line(str(exc), 300)}") from None


def untrainable_pair_dir(d: Path) -> str | None:
    """Why the bench may not train a pair into ``d``: it holds files but no pair to reuse, and
    training would overwrite them (None: ``d`` is missing, empty, or holds a pair)."""
    from phasegraph.train.recipe import STAGING  # a killed training run's staging directory is
    # no file of the user's (the recipe clears it)
    if has_pair(d) or not d.exists() or (d.is_dir() and not any(p.name != STAGING for p in d.iterdir())):
        return None
    what = "is a file" if not d.is_dir() else "holds files but no trained pair (target/ and eagle3/ with config.json)"
    return (f"--pair {d} {what}: training the pair into it would overwrite them; point --pair at a new "
            "or empty directory, or at a complete pair to reuse")


def training_preset(args):
    """``(name, overrides, preset)`` of the recipe part 1 trains: ``bench-pair`` (``tiny`` with
    --quick), the bench's own override first and --train-set's after it (so the user's win), and
    the preset they give. Raises ValueError for a bad override, or for fields the recipe would
    refuse together (:func:`~phasegraph.train.presets.check_preset`): before any part runs."""
    from phasegraph.train.presets import PRESETS, apply_overrides, check_preset

    name = "tiny" if args.quick else "bench-pair"
    overrides = list(args.train_set)
    if not args.quick:
        # the bench measures τ itself, on the engine; the recipe's own simulated-acceptance
        # check (~30 s) is skipped unless --train-set asks for it
        overrides = ["eval.max_prompts=0", *overrides]
    preset = apply_overrides(PRESETS[name], overrides)
    check_preset(preset)
    return name, overrides, preset


def phase_share(trace, wall: float) -> dict[str, float]:
    """Share of the timed call's wall time spent inside each phase (host wall time: the GPU runs
    asynchronously, so a phase's GPU work shows up where the host next waits for it), plus
    ``outside phases`` (scheduler, host synchronisation, request bookkeeping)."""
    if trace is None or wall <= 0:
        return {}
    times = trace.phase_time()
    share = {k: v / wall for k, v in sorted(times.items(), key=lambda kv: -kv[1])}
    share["outside phases"] = max(0.0, 1.0 - sum(share.values()))
    return share


def share_text(share: dict[str, float], top: int = 4) -> str:
    if not share:
        return "–"
    items = [(k, v) for k, v in share.items() if k != "outside phases" and v >= 0.005][:top]
    items.append(("other", 1.0 - sum(v for _, v in items)))
    return " · ".join(f"{k} {100 * v:.0f}%" for k, v in items)


def count_phase(trace, phase: str) -> int:
    return 0 if trace is None else sum(1 for t in trace if t.target == phase)


def mean_accept_length(outputs) -> float | None:
    """τ of ``outputs`` (RequestOutputs): accepted tokens per verify over all of them; None where
    none verified (no drafts)."""
    lens = [n for o in outputs for n in o.stats.accept_lengths]
    return sum(lens) / len(lens) if lens else None


def shape_counts(trace) -> dict[str, int]:
    """Iterations per speculation shape (the notes of draft and decode runs; a split batch's
    two groups count once each), most frequent first."""
    counts = collections.Counter(t.note for t in (trace or ()) if t.target in ("draft", "decode") and t.note)
    return dict(counts.most_common())


def graph_count(engine) -> int:
    """CUDA graphs the engine holds (per phase, whole iteration and prefill), 0 without graphs."""
    return 0 if engine.graph_runner is None else engine.graph_runner.graph_count()


def prefill_seconds(trace) -> float:
    return sum(t.seconds for t in trace if t.target == "prefill-extend")


def load_bench_script(name: str):
    """``benchmarks/<name>.py`` (a script, not a package) as a fresh module, with ``benchmarks/``
    importable while it loads (scripts import their neighbours)."""
    import importlib.util

    folder = REPO_ROOT / "benchmarks"
    path = folder / f"{name}.py"
    if not path.exists():
        raise BenchError(f"{path} is missing: run `phasegraph bench` from a phasegraph checkout")
    spec = importlib.util.spec_from_file_location(f"phasegraph_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(folder))
    return mod


def load_bench_scale():
    """benchmarks/bench_scale.py (the 8B builders, bandwidth and step-time probes) as a module."""
    return load_bench_script("bench_scale")


# ------------------------------------------------------------------------------------------------
# environment
# ------------------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def source_digest(root: Path = REPO_ROOT) -> str:
    """sha256 (first 16 hex digits) over the path and bytes of every ``phasegraph/**/*.py`` and
    ``benchmarks/*.py`` file: names the code a run executed even where .git is a stale copy and the
    commit is given by hand (PHASEGRAPH_GIT_COMMIT). To match it to a commit:
    ``git checkout C && python -c 'from phasegraph.bench.common import source_digest as d; print(d())'``."""
    h = hashlib.sha256()
    files = sorted([*root.glob("phasegraph/**/*.py"), *root.glob("benchmarks/*.py")])
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def environment(device, validate: str | None) -> dict:
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    # PHASEGRAPH_GIT_COMMIT names the commit where the checkout's .git is not its own (a copy)
    pinned = os.environ.get("PHASEGRAPH_GIT_COMMIT")
    commit = pinned or _git("rev-parse", "HEAD")
    status = None if pinned else _git("status", "--porcelain")
    cuda = torch.device(device).type == "cuda"
    env = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": commit,
        "git_dirty": (bool(status) if status is not None else None),
        "source_digest": source_digest(),
        "phasegraph_kernels": os.environ.get("PHASEGRAPH_KERNELS", "auto"),
        "validation": validate or os.environ.get("PHASEGRAPH_VALIDATE") or "library default (boundary)",
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "host_launch_us": round(1e6 * host_launch_seconds(device), 2),
    }
    return env


CUPTI_TEARDOWN_VAR = "TEARDOWN_CUPTI"


def detach_cupti_after_profiling() -> None:
    """Have every ``torch.profiler`` session from now on detach CUPTI when it ends (Kineto's
    ``TEARDOWN_CUPTI=1``), unless the environment already says otherwise. Left attached, CUPTI
    makes every later launch dearer for the host: on an H100 a tree iteration's graph replay
    went from 0.008 to 0.081 ms, and ``Machine.advance`` from 0.18 to 0.28 ms per iteration,
    after one session - and the bench times rows after it has profiled
    others."""
    os.environ.setdefault(CUPTI_TEARDOWN_VAR, "1")


def host_launch_seconds(device, calls: int = 2000) -> float:
    """Host time to issue one tiny op on ``device`` without waiting for it: how fast this
    machine's host is. Hosts of one GPU kind differ (~2x seen between two H100 hosts), and a
    small target at batch 1 is bound by the host, so its tokens/s move with this figure."""
    import torch

    x = torch.zeros(1, device=device)
    return host_issue_seconds(device, lambda: torch.add(x, 1), calls, warmup=50)


def host_issue_seconds(device, fn, calls: int, warmup: int = 1) -> float:
    """Host seconds per call of ``fn`` issued ``calls`` times in a row without waiting for the
    device (after ``warmup`` calls and a synchronisation)."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - start) / calls
    sync(device)
    return seconds
