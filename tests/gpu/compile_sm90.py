"""Compile every Triton kernel for sm_90 (H100/H200) on a machine without a GPU.

    python tests/gpu/compile_sm90.py            # all cases
    python tests/gpu/compile_sm90.py attention  # cases whose name contains "attention"
    python tests/gpu/compile_sm90.py attention --ptx DIR   # also each kernel's PTX code, debug
                                                           # info stripped, one file per kernel

Two ``--ptx`` directories from two versions of a kernel module, compared with ``diff -r``, say
whether a refactor changed one instruction the GPU runs (a refactor that changes none needs no
new GPU measurement).

The interpreter (``TRITON_INTERPRET=1``) runs kernels as Python and never compiles them, so it
misses everything the compiler rejects. This script installs a stand-in Triton driver that
reports an sm_90 target, turns every kernel launch into a compile-only ``warmup``, calls each
``*_triton`` wrapper on CPU tensors of realistic shapes (Llama-3-8B-like attention, V = 128256),
and prints each compiled kernel's registers, spills (local memory), stack and shared memory from
``cuobjdump --dump-resource-usage``. Nothing is launched; the outputs are garbage. Kernels compile
with programmatic dependent launch on, as ``PHASEGRAPH_PDL=auto`` launches them on sm_90.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_cases  # noqa: E402

from phasegraph.kernels import _dispatch as dispatch  # noqa: E402

_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


class _Sm90Driver:
    """Enough of a Triton driver for ``JITFunction.run(..., warmup=True)``."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def is_active(self):
        return True


_COMPILED: list[tuple[str, object]] = []


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kwargs)
    _COMPILED.append((self.fn.__name__, kernel))
    return kernel


_ORIGINAL_RUN = JITFunction.run


def resource_usage(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run(
            [_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not m:
        return text.strip()
    reg, stack, shared, local = m.groups()
    return f"regs {reg:>3}  stack {stack:>4}  local {local:>4}  shared {shared:>6}"


def ptx_code(kernel) -> str:
    """The kernel's PTX up to its debug sections, without comments, source locations and the
    numbering of temporary labels."""
    ptx = kernel.asm["ptx"].split("\t.section\t.debug", 1)[0]
    ptx = re.sub(r"^\s*(//.*|\.loc\s.*|\.file\s.*|\$L__tmp\d+:)$", "", ptx, flags=re.M)
    ptx = re.sub(r"\$L__tmp\d+", "$L__tmp", ptx)
    return "\n".join(line for line in ptx.splitlines() if line.strip()) + "\n"


def _sm90_pdl_options(setting: str, interpreted: bool, device_index: int | None) -> dict:
    return dispatch.PDL_LAUNCH


def main(argv: list[str]) -> int:
    driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only
    dispatch._pdl_options = _sm90_pdl_options  # no CUDA device here; sm_90 launches with PDL
    ptx_dir = None
    if "--ptx" in argv:
        at = argv.index("--ptx")
        ptx_dir = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
        os.makedirs(ptx_dir, exist_ok=True)
    pattern = argv[1] if len(argv) > 1 else ""
    failures = 0
    torch.manual_seed(0)
    for name, case in kernel_cases.compile_cases():
        if pattern not in name:
            continue
        _COMPILED.clear()
        try:
            case()
        except Exception as exc:  # report and go on with the other kernels
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        for i, (kernel_name, kernel) in enumerate(_COMPILED):
            if ptx_dir is not None:
                path = os.path.join(ptx_dir, f"{name.replace('/', '_')}__{i}_{kernel_name}.ptx")
                with open(path, "w") as f:
                    f.write(ptx_code(kernel))
            meta = kernel.metadata
            print(
                f"ok   {name:<44} {kernel_name:<32} warps {meta.num_warps} stages "
                f"{meta.num_stages}  {resource_usage(kernel)}  scratch {meta.global_scratch_size}"
            )
    print("compile failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
