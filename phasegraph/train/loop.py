"""Pieces every training stage shares: determinism, batch sampling, the optimisation loop.

Randomness: model initialisation and batch sampling draw from CPU ``torch.Generator`` objects
seeded from ``(seed, stage)``, so the same batches and initial weights come out on every device.
The loop is step-count driven; a wall-clock deadline can only cut it short, and the stage records
that it did.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.utils.deterministic
from tqdm.auto import tqdm

from phasegraph.train.presets import TrainSpec, cosine_lr

__all__ = [
    "Deadline",
    "StageLog",
    "WindowSampler",
    "autocast",
    "deterministic_mode",
    "eval_windows",
    "stage_generator",
    "train_loop",
    "train_on_windows",
]

_STAGE_IDS = {"init": 1, "target": 2, "head": 3, "draft": 4, "selfgen": 5}


def stage_generator(seed: int, stage: str) -> torch.Generator:
    """A CPU generator for one stage, independent of the others and of the global RNG."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed * 1000 + _STAGE_IDS[stage])
    return g


@contextlib.contextmanager
def deterministic_mode(warn_only: bool = False) -> Iterator[None]:
    """Deterministic kernels only; restores the flags after. An op PyTorch has no deterministic
    kernel for raises (``warn_only``: warns and runs its nondeterministic one). Only the strict
    form picks the deterministic backward of SDPA's flash and memory-efficient kernels, and
    keeps the cuDNN one out: with ``warn_only`` the attention backward of GPU training differs
    from run to run, so the trained pair (and the bench's τ) did.

    ``CUBLAS_WORKSPACE_CONFIG`` must be set before cuBLAS starts; the CLI sets it first thing.
    Filling uninitialised memory (a debugging aid that deterministic mode turns on) is left
    off: it costs a memory pass per allocation and every buffer here is written before use.
    """
    det = torch.utils.deterministic
    prev = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        det.fill_uninitialized_memory,
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.backends.cudnn.deterministic = prev[2]
        torch.backends.cudnn.benchmark = prev[3]
        det.fill_uninitialized_memory = prev[4]


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Deadline:
    """Wall-clock limit of one stage; ``None`` seconds = no limit."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end

    def remaining(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())


class WindowSampler:
    """Random fixed-length windows of a packed token stream, from a seeded CPU generator.

    ``pool`` (optional) is a second source of whole sequences ``[P, length]``; a fixed share of
    each batch's rows is drawn from it (the head's self-generated data).
    """

    def __init__(
        self,
        stream: torch.Tensor,
        length: int,
        batch_size: int,
        generator: torch.Generator,
        device: torch.device,
        pool: torch.Tensor | None = None,
        pool_fraction: float = 0.0,
    ):
        if stream.numel() <= length:
            raise ValueError(f"stream of {stream.numel()} tokens is too short for {length}")
        self.stream = stream.to(device)
        self.length = length
        self.batch_size = batch_size
        self.g = generator
        self.device = device
        self.offsets = torch.arange(length, device=device)
        self.pool = pool.to(device) if pool is not None and pool.numel() else None
        self.n_pool = 0
        if self.pool is not None:
            if self.pool.shape[1] != length:
                raise ValueError("pool sequences must have the window length")
            self.n_pool = min(batch_size, round(batch_size * pool_fraction))

    def __call__(self) -> torch.Tensor:
        n_stream = self.batch_size - self.n_pool
        starts = torch.randint(0, self.stream.numel() - self.length, (n_stream,), generator=self.g)
        rows = self.stream[starts.to(self.device)[:, None] + self.offsets]
        if self.n_pool:
            pick = torch.randint(0, self.pool.shape[0], (self.n_pool,), generator=self.g)
            rows = torch.cat([rows, self.pool[pick.to(self.device)]], 0)
        return rows


def eval_windows(stream: torch.Tensor, length: int, max_windows: int | None) -> torch.Tensor:
    """Non-overlapping windows ``[n, length]`` covering the stream; if more than
    ``max_windows``, an evenly spaced subset (deterministic)."""
    n = stream.numel() // length
    if n == 0:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than one window")
    windows = stream[: n * length].view(n, length)
    if max_windows is not None and n > max_windows:
        idx = torch.linspace(0, n - 1, max_windows).round().long()
        windows = windows[idx]
    return windows


@dataclass
class StageLog:
    """What one training stage did; goes into the report."""

    name: str
    planned_steps: int
    steps: int = 0
    stopped_early: bool = False
    wall_s: float = 0.0
    tokens: int = 0
    final_train_loss: float = float("nan")
    best_step: int = -1
    best_valid: float = float("nan")
    valid_curve: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "planned_steps": self.planned_steps,
            "steps": self.steps,
            "stopped_early": self.stopped_early,
            "wall_s": round(self.wall_s, 2),
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.wall_s) if self.wall_s > 0 else None,
            "final_train_loss": _round(self.final_train_loss),
            "best_step": self.best_step,
            "best_valid": _round(self.best_valid),
            "valid_curve": [[s, _round(v)] for s, v in self.valid_curve],
        }


def _round(x: float, nd: int = 5) -> float | None:
    return None if x is None or math.isnan(x) else round(float(x), nd)


def make_optimizer(params: list[torch.nn.Parameter], spec: TrainSpec, device: torch.device):
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": False}
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, spec.beta2), eps=1e-8, **kwargs)


def train_loop(
    name: str,
    model: torch.nn.Module,
    spec: TrainSpec,
    loss_fn: Callable[[int], torch.Tensor],
    valid_fn: Callable[[], float],
    device: torch.device,
    tokens_per_step: int,
    deadline: Deadline | None = None,
    progress: bool = True,
) -> StageLog:
    """AdamW + warm-up/cosine over ``spec.steps`` steps of ``loss_fn(step)``.

    Every ``spec.eval_every`` steps (and at the end) ``valid_fn()`` is evaluated (lower is
    better); the parameters with the best validation value are restored at the end.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, spec, device)
    log = StageLog(name, spec.steps)
    best_state: dict[str, torch.Tensor] | None = None
    t0 = time.perf_counter()
    bar = tqdm(total=spec.steps, desc=name, disable=not progress, dynamic_ncols=True)
    running = None

    def validate(step: int) -> None:
        nonlocal best_state
        model.eval()
        value = float(valid_fn())
        model.train()
        log.valid_curve.append((step, value))
        if math.isnan(log.best_valid) or value < log.best_valid:
            log.best_valid, log.best_step = value, step
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    model.train()
    for step in range(spec.steps):
        if deadline is not None and deadline.expired():
            log.stopped_early = True
            break
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, spec)
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        opt.step()
        log.steps = step + 1
        if (step + 1) % 10 == 0 or step + 1 == spec.steps:
            value = float(loss.detach())  # a host sync every 10 steps only
            running = value if running is None else 0.8 * running + 0.2 * value
            log.final_train_loss = value
            bar.set_postfix(loss=f"{running:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
        bar.update(1)
        if spec.eval_every > 0 and (step + 1) % spec.eval_every == 0 and step + 1 < spec.steps:
            validate(step + 1)
    bar.close()
    if log.steps and (not log.valid_curve or log.valid_curve[-1][0] != log.steps):
        validate(log.steps)
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.wall_s = time.perf_counter() - t0
    log.tokens = log.steps * tokens_per_step
    return log


def train_on_windows(
    name: str,
    model: torch.nn.Module,
    spec: TrainSpec,
    train_stream: torch.Tensor,
    valid_stream: torch.Tensor,
    generator: torch.Generator,
    device: torch.device,
    batch_loss: Callable[[torch.Tensor], torch.Tensor],
    valid_loss: Callable[[torch.Tensor], float],
    *,
    deadline: Deadline | None = None,
    progress: bool = True,
    **sampler_options,
) -> StageLog:
    """:func:`train_loop` of ``model`` on ``batch_loss(windows)``, the windows (``spec.seq_len +
    1`` tokens, ``spec.batch_size`` of them) drawn from ``train_stream`` by a
    :class:`WindowSampler` (``sampler_options``: its ``pool``); validated by ``valid_loss`` over
    :func:`eval_windows` of ``valid_stream``."""
    model.to(device)
    length = spec.seq_len + 1
    sampler = WindowSampler(train_stream, length, spec.batch_size, generator, device, **sampler_options)
    valid = eval_windows(valid_stream, length, spec.eval_windows)
    return train_loop(
        name, model, spec, lambda step: batch_loss(sampler()), lambda: valid_loss(valid), device,
        tokens_per_step=spec.batch_size * spec.seq_len, deadline=deadline, progress=progress,
    )
