"""Counter-based uniform random numbers: a pure function of (seed, counter).

Sampling draws its coins here instead of from a stateful generator, so a request's random
numbers depend only on its own seed and the position being sampled, never on the batch it sits
in, the order of requests, retraction or CUDA-graph replay (reliability.md §7, test 5).
The mixer is SplitMix64 (Steele, Lea & Flood, OOPSLA 2014) on int64 tensors with wrapping
arithmetic; logical right shifts are emulated with a mask.
"""

from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB

# Purposes mixed into the counter so that the coins of different uses never coincide.
PURPOSE_SAMPLE = 3  # prefill / decode: the token at a position
PURPOSE_ACCEPT = 1  # tree sampling: the acceptance coin at a depth
PURPOSE_BONUS = 2  # tree sampling: the residual (bonus) coin at a depth
_PURPOSES = 8


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) for every (seed, counter) pair.

    ``seeds`` [B] int64 broadcasts against ``counters`` [B, X] int64 (or [B]). 24 bits of each
    mixed word give the float (every float32 in [0, 1) with spacing 2^-24 is reachable).
    """
    s = seeds.to(torch.int64)
    if counters.dim() > s.dim():
        s = s.view(*s.shape, *([1] * (counters.dim() - s.dim())))
    z = splitmix64(splitmix64(s) ^ counters.to(torch.int64))
    return _srl(z, 40).to(torch.float32) * (1.0 / (1 << 24))


def position_counter(positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """The counter of the coin used to choose the token at ``positions`` for ``purpose``."""
    return positions.to(torch.int64) * _PURPOSES + purpose
