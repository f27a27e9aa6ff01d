"""Counter-based uniform random numbers: a pure function of (seed, counter).

Sampling draws its coins here instead of from a stateful generator, so a request's random
numbers depend only on its own seed and the position being sampled, never on the batch it sits
in, the order of requests, retraction or CUDA-graph replay (reliability.md §7, test 5).
The mixer is SplitMix64 (Steele, Lea & Flood, OOPSLA 2014) on int64 tensors with wrapping
arithmetic; logical right shifts are emulated with a mask.

``counter_uniform`` dispatches to a Triton kernel on CUDA tensors: the torch version is ~25
elementwise launches on tiny tensors, the kernel one (same bits: uint64 wrapping arithmetic).
"""

from __future__ import annotations

import torch

from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_block

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


def counter_uniform_reference(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
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


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _splitmix64_u64(x):
    z = x + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@jit
def _counter_uniform_kernel(
    seeds_ptr,  # [R, X] view (broadcast strides) of the int seeds
    counters_ptr,  # [R, X] view of the int64 counters
    out_ptr,  # [R, X] f32, out
    cols,
    stride_sr,
    stride_sc,
    stride_cr,
    stride_cc,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    r, c, ok = row_block(BLOCK, cols)
    seed = tl.load(seeds_ptr + r * stride_sr + c * stride_sc, mask=ok, other=0)
    counter = tl.load(counters_ptr + r * stride_cr + c * stride_cc, mask=ok, other=0)
    seed = seed.to(tl.int64).to(tl.uint64, bitcast=True)
    counter = counter.to(tl.int64).to(tl.uint64, bitcast=True)
    z = _splitmix64_u64(_splitmix64_u64(seed) ^ counter)
    tl.store(out_ptr + r * cols + c, (z >> 40).to(tl.float32) * (1.0 / (1 << 24)), mask=ok)


def counter_uniform_triton(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Triton ``counter_uniform``: one launch; broadcast through strides (no expanded copies).
    Shapes of more than two dimensions take the reference."""
    s = seeds
    if counters.dim() > s.dim():
        s = s.view(*s.shape, *([1] * (counters.dim() - s.dim())))
    shape = torch.broadcast_shapes(s.shape, counters.shape)
    if len(shape) > 2:
        return counter_uniform_reference(seeds, counters)
    out = torch.empty(shape, dtype=torch.float32, device=counters.device)
    if out.numel() == 0:
        return out
    shape2 = (1,) * (2 - len(shape)) + tuple(shape)
    s2 = s.reshape((1,) * (2 - s.dim()) + tuple(s.shape)).expand(shape2)
    c2 = counters.reshape((1,) * (2 - counters.dim()) + tuple(counters.shape)).expand(shape2)
    rows, cols = shape2
    block = min(1024, next_pow2(cols))
    _counter_uniform_kernel[(rows, -(-cols // block))](
        s2, c2, out, cols, *s2.stride(), *c2.stride(),
        BLOCK=block, num_warps=1 if block <= 128 else 4, **pdl_options(),
    )
    return out


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) for every (seed, counter) pair (see
    :func:`counter_uniform_reference`)."""
    if use_triton(counters):
        return counter_uniform_triton(seeds, counters)
    return counter_uniform_reference(seeds, counters)
