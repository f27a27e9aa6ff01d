"""Experiment: a chain of dependent skinny products in one launch, each item's weights loaded
into registers *before* it waits for its input (bench/RESULTS.md §5, "the one-launch tail with
its weights prefetched": L2 prefetch did not help; this tests weights held on chip).

The chain is the MLP half of the bench pair's EAGLE-3 head in bfloat16 at 4 rows (a tree step):

    y1  = x @ Wo^T                       o       768 -> 768
    act = silu(y1 @ Wg^T) * (y1 @ Wu^T)  gate/up 768 -> 2 x 2560
    y3  = act @ Wd^T                     down    2560 -> 768

against the skinny products of :mod:`phasegraph.kernels.linear` (the table's 4-row tiles) and
the SwiGLU kernel: four launches. Norms are left out on both sides (they are elementwise given
the row statistics; the mechanism under test is the dependency chain).

One launch: programs take tickets in dependency order (o items, then gate/up items, then down
items; a program waits only on smaller tickets, so no deadlock). Each item first loads its
whole weight tile (16 output columns, or 32 gate + 32 up columns, the whole K) into registers,
then waits on the previous product's done-counter, loads its operand rows from L2 and runs one
``tl.dot`` per power-of-two piece of K.

    python bench/weight_stationary_chain.py [--out DIR]      # GPU only

Measured (H100, 2026-11-25; bench/results/weight-stationary-h100-2026-11-25/): correct (6e-3
of the largest value, bfloat16 rounding), but 38.7 µs per chain with 4 warps and 82.6 with 8,
against 14.9 µs (11.4 warm) for the four launches. The compiled kernel does load every weight
tile before its wait, and stages it through shared memory for ``mma``. ptxas, though, spills
~2.6 KB per thread (sm_90: 168 registers at 4 warps, 128 at 8), and the 256 programs' tiles and
spin-waits share the SMs with the items they wait for. Not the way to build it with Triton's
``tl`` language: it needs explicit shared memory and residency (Gluon, or CUDA C++).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, INNER = 768, 2560
CO, CG, CD = 16, 16, 16  # output columns per o, gate/up (each), down item
N_O, N_G, N_D = H // CO, INNER // CG, H // CD  # 48, 160, 48 items


@triton.jit
def _wait(counter_ptr, target):
    while tl.load(counter_ptr, volatile=True) < target:
        pass
    tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _publish(counter_ptr):
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _rows(ptr, stride, rows, row_in, cols):
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=row_in[:, None], other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _chain_kernel(sync_ptr, x_ptr, wo_ptr, wgu_ptr, wd_ptr, y1_ptr, act_ptr, y3_ptr, M,
                  H: tl.constexpr, INNER: tl.constexpr, CO: tl.constexpr, CG: tl.constexpr,
                  CD: tl.constexpr, N_O: tl.constexpr, N_G: tl.constexpr, N_D: tl.constexpr):
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    rows = tl.arange(0, 16)
    row_in = rows < M
    ka = tl.arange(0, 512)  # K = 768 as 512 + 256
    kb = 512 + tl.arange(0, 256)
    if item < N_O:
        cols_o = item * CO + tl.arange(0, CO)
        w_a_o = tl.load(wo_ptr + cols_o[:, None] * H + ka[None, :])  # [CO, 512]
        w_b_o = tl.load(wo_ptr + cols_o[:, None] * H + kb[None, :])  # [CO, 256]
        acc_o = tl.dot(_rows(x_ptr, H, rows, row_in, ka), tl.trans(w_a_o))
        acc_o = tl.dot(_rows(x_ptr, H, rows, row_in, kb), tl.trans(w_b_o), acc_o)
        tl.store(y1_ptr + rows[:, None] * H + cols_o[None, :], acc_o.to(y1_ptr.dtype.element_ty),
                 mask=row_in[:, None])
        _publish(sync_ptr + 1)
    elif item < N_O + N_G:
        cols_g = (item - N_O) * CG + tl.arange(0, CG)
        g_a = tl.load(wgu_ptr + cols_g[:, None] * H + ka[None, :])  # gate rows [CG, 512]
        g_b = tl.load(wgu_ptr + cols_g[:, None] * H + kb[None, :])
        u_a = tl.load(wgu_ptr + (INNER + cols_g)[:, None] * H + ka[None, :])  # up rows
        u_b = tl.load(wgu_ptr + (INNER + cols_g)[:, None] * H + kb[None, :])
        _wait(sync_ptr + 1, N_O)
        x_a_g = _rows(y1_ptr, H, rows, row_in, ka)
        x_b_g = _rows(y1_ptr, H, rows, row_in, kb)
        gate_g = tl.dot(x_b_g, tl.trans(g_b), tl.dot(x_a_g, tl.trans(g_a)))
        up_g = tl.dot(x_b_g, tl.trans(u_b), tl.dot(x_a_g, tl.trans(u_a)))
        dtype_g = act_ptr.dtype.element_ty
        g_g = gate_g.to(dtype_g).to(tl.float32)
        act_g = (g_g / (1.0 + tl.exp(-g_g))).to(dtype_g)
        out_g = (act_g.to(tl.float32) * up_g.to(dtype_g).to(tl.float32)).to(dtype_g)
        tl.store(act_ptr + rows[:, None] * INNER + cols_g[None, :], out_g, mask=row_in[:, None])
        _publish(sync_ptr + 2)
    else:
        cols_d = (item - N_O - N_G) * CD + tl.arange(0, CD)
        kc_d = tl.arange(0, 2048)  # K = 2560 as 2048 + 512
        kd_d = 2048 + tl.arange(0, 512)
        w_c_d = tl.load(wd_ptr + cols_d[:, None] * INNER + kc_d[None, :])  # [CD, 2048]
        w_d_d = tl.load(wd_ptr + cols_d[:, None] * INNER + kd_d[None, :])  # [CD, 512]
        _wait(sync_ptr + 2, N_G)
        acc_d = tl.dot(_rows(act_ptr, INNER, rows, row_in, kc_d), tl.trans(w_c_d))
        acc_d = tl.dot(_rows(act_ptr, INNER, rows, row_in, kd_d), tl.trans(w_d_d), acc_d)
        tl.store(y3_ptr + rows[:, None] * H + cols_d[None, :], acc_d.to(y3_ptr.dtype.element_ty),
                 mask=row_in[:, None])
        if _publish(sync_ptr + 3) == N_D - 1:  # the last item: every program is past its waits
            for c in tl.static_range(4):
                tl.atomic_xchg(sync_ptr + c, 0, sem="relaxed", scope="gpu")


def chain_one_launch(x, wo, wgu, wd, sync, num_warps=4):
    m = x.shape[0]
    y1 = torch.empty((m, H), dtype=x.dtype, device=x.device)
    act = torch.empty((m, INNER), dtype=x.dtype, device=x.device)
    y3 = torch.empty((m, H), dtype=x.dtype, device=x.device)
    _chain_kernel[(N_O + N_G + N_D,)](sync, x, wo, wgu, wd, y1, act, y3, m, H=H, INNER=INNER,
                                      CO=CO, CG=CG, CD=CD, N_O=N_O, N_G=N_G, N_D=N_D,
                                      num_warps=num_warps)
    return y3


def chain_launches(x, wo, wgu, wd):
    from phasegraph.kernels.activation import silu_mul
    from phasegraph.kernels.linear import linear

    return linear(silu_mul(linear(linear(x, wo), wgu)), wd)


def chain_reference(x, wo, wgu, wd):
    y1 = (x.float() @ wo.float().T).to(x.dtype)
    gu = (y1.float() @ wgu.float().T).to(x.dtype)
    g, u = gu.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(g).to(x.dtype).float() * u).to(x.dtype)
    return (act.float() @ wd.float().T).to(x.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("weight_stationary_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench_cudagraph

    dev, dtype, rows = "cuda", torch.bfloat16, 4
    sets = []
    for seed in range(4):  # four weight sets (52 MB): rotated, they do not stay in L2 ("cold")
        g = torch.Generator().manual_seed(seed)
        sets.append(tuple((torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype).to(dev)
                          for shape in ((rows, H), (H, H), (2 * INNER, H), (H, INNER))))
    sync = torch.zeros(4, dtype=torch.int32, device=dev)
    result = {"rows": rows, "dtype": "bfloat16", "items": [N_O, N_G, N_D]}
    for warps in (4, 8):
        out = chain_one_launch(*sets[0], sync, num_warps=warps)
        ref = chain_reference(*sets[0])
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        result[f"max_rel_err_w{warps}"] = err
        print(f"one launch, {warps} warps: max error {err:.2e} of the reference's largest value")
    for name, fn in (("four launches", lambda s: chain_launches(*s)),
                     ("one launch, 4 warps", lambda s: chain_one_launch(*s, sync, num_warps=4)),
                     ("one launch, 8 warps", lambda s: chain_one_launch(*s, sync, num_warps=8))):
        for label, used in (("cold", sets), ("warm", sets[:1])):
            def run(used=used, fn=fn):
                for s in used:
                    fn(s)
            us = do_bench_cudagraph(run, rep=200) * 1e3 / len(used)
            result[f"{name} {label}"] = us
            print(f"{name:<22} {label}: {us:6.1f} us per chain")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "weight_stationary_chain.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
