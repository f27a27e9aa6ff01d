"""Fixtures of the GPU tests, and interpreter mode for the Triton kernel tests.

On a machine with CUDA the tests here run on the GPU (``pytest -m gpu tests/gpu``); elsewhere the
phasegraph plugin skips everything marked ``gpu``. ``test_triton_kernels.py`` can also run on the
CPU through Triton's interpreter:

    PHASEGRAPH_TRITON_INTERPRET=1 python -m pytest -q tests/gpu/test_triton_kernels.py

In that mode this conftest sets ``TRITON_INTERPRET=1`` before anything imports the kernel modules
(``@triton.jit`` reads it when a kernel is defined), the test module drops its ``gpu`` marker (so
the plugin's skip does not fire), and the ``device`` fixture hands out CPU tensors. Run it in its
own pytest process: a session that imported the kernels first cannot switch them to the
interpreter.
"""

from __future__ import annotations

import os
import sys

import pytest

INTERPRET = os.environ.get("PHASEGRAPH_TRITON_INTERPRET", "") == "1"


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns scalars into Python ints with ``int(array)``, which
    NumPy >= 2.4 refuses for 1-element 1-d arrays (a ``range(lo, hi)`` over tensor bounds
    fails). Take the element explicitly."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_phasegraph_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._phasegraph_fixed = True
    interpreter._patch_lang_tensor = patched


def _fix_interpreter_bfloat16() -> None:
    """The interpreter keeps bf16 as raw uint16 bits: its ``tl.dot`` multiplies those bits as
    integers, and its fp32 -> bf16 cast truncates where the GPU rounds to nearest even. Emulate
    the GPU: bf16 dot operands are widened exactly to fp32 (tensor cores multiply bf16 exactly
    and accumulate in fp32), and the cast rounds to nearest even (through torch)."""
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_phasegraph_fixed", False):
        return
    original_dot = builder.create_dot
    original_convert = interpreter._convert_float

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original_convert(data, input_dtype, output_dtype, rounding_mode)

    create_dot._phasegraph_fixed = True
    builder.create_dot = create_dot
    interpreter._convert_float = convert_float


if INTERPRET:
    already = [m for m in ("phasegraph.kernels.attention",) if m in sys.modules]
    if already and os.environ.get("TRITON_INTERPRET", "") != "1":
        raise pytest.UsageError(
            "PHASEGRAPH_TRITON_INTERPRET=1: the kernel modules were imported before "
            "tests/gpu/conftest.py could turn on TRITON_INTERPRET; run tests/gpu in its own "
            "pytest process (or set TRITON_INTERPRET=1 as well)"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    _fix_interpreter_scalar_index()
    _fix_interpreter_bfloat16()


@pytest.fixture
def device():
    """CUDA on the GPU machine; CPU tensors in interpreter mode; else the test is skipped."""
    import torch

    if torch.cuda.is_available() and not INTERPRET:
        return torch.device("cuda")
    if INTERPRET:
        return torch.device("cpu")
    pytest.skip("needs CUDA, or PHASEGRAPH_TRITON_INTERPRET=1 for the Triton interpreter")


@pytest.fixture
def gen(request):
    """A generator per test case, seeded from its id (different inputs for every case,
    reproducible; ``PHASEGRAPH_TEST_SEED`` draws another set)."""
    import zlib

    import torch

    salt = os.environ.get("PHASEGRAPH_TEST_SEED", "")
    return torch.Generator().manual_seed(zlib.crc32(f"{salt}{request.node.nodeid}".encode()))
