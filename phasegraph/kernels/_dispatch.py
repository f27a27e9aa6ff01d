"""Choosing between the Triton kernels and their torch references.

Every kernel module keeps its torch implementation as ``<name>_reference`` (the CPU path and the
oracle), a Triton implementation as ``<name>_triton``, and a public ``<name>`` that dispatches:

- ``PHASEGRAPH_KERNELS=auto`` (default): Triton when the inputs are CUDA tensors and Triton is
  importable, else the reference;
- ``PHASEGRAPH_KERNELS=reference``: always the reference;
- ``PHASEGRAPH_KERNELS=triton``: always Triton (on CPU tensors this needs ``TRITON_INTERPRET=1``
  set before Triton is first imported; the tests in ``tests/gpu`` use that).

The switch is read on every call (a dictionary lookup, no device work), so a test may flip it with
``monkeypatch.setenv``. Nothing here synchronises with the device, so dispatching is safe inside
CUDA-graph capture.

Triton is optional: without it the kernel modules still import (``jit`` below then returns a
stand-in that refuses to launch) and every public name runs its reference.

Programmatic dependent launch (Hopper, ``PHASEGRAPH_PDL``): every Triton kernel starts with
:func:`pdl_enter` and every launch passes :func:`pdl_options`. Launched that way, a kernel's
programs may be placed on the SMs while the kernel before it on the stream still runs; each waits
(``griddepcontrol.wait``) until that kernel has finished and its writes are visible, then lets
the next kernel launch (``griddepcontrol.launch_dependents``). Since every kernel waits before it
reads or writes anything, a chain of kernels keeps stream order; what is saved is the launch and
placement of each kernel (CUDA graphs capture the programmatic edges; on the H100 0.3-0.4 us per
launch, a bench-pair decode step 4 % and a tree iteration 4 % of GPU time).
Torch's own kernels never signal early, so a kernel after one of them starts as it always did. A
launch may opt out (``pdl_options(early=False)``, the decode attention): it then starts plainly.

- ``PHASEGRAPH_PDL=auto`` (default): on for CUDA devices of compute capability 9.0 or newer;
- ``PHASEGRAPH_PDL=off``: plain launches (each kernel waits for the one before to end);
- ``PHASEGRAPH_PDL=on``: on, and an error on a device that lacks it.

A skinny product launched early may load its weights *before* its wait where no kernel writes
them (``PHASEGRAPH_EARLY_WEIGHTS``, :func:`phasegraph.kernels.linear.early_weight_load`).
"""

from __future__ import annotations

import functools
import os

import torch

from phasegraph.kernels.tile_tables import TileTableError, tables_for

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

HAS_TRITON = triton is not None
ENV_VAR = "PHASEGRAPH_KERNELS"
MODES = ("auto", "reference", "triton")
PDL_ENV_VAR = "PHASEGRAPH_PDL"
PDL_MODES = ("auto", "on", "off")
# Triton reads TRITON_INTERPRET when a kernel is defined, so this module reads it once, on import
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0")
PDL_LAUNCH = {"PDL": True, "launch_pdl": True}  # a launch placed early, its kernel waiting first
EARLY_WEIGHTS_ENV_VAR = "PHASEGRAPH_EARLY_WEIGHTS"
EARLY_WEIGHTS_MODES = ("auto", "on", "off")


_NO_TRITON = (f"{ENV_VAR}=triton, but triton cannot be imported (unset it, or set it to auto or "
              "reference, to run the torch references)")


class KernelSettingError(ValueError):
    """A kernel setting (``PHASEGRAPH_KERNELS``, ``PHASEGRAPH_PDL``,
    ``PHASEGRAPH_EARLY_WEIGHTS``, ``PHASEGRAPH_TILE_TABLE``) with an unknown value, or one this
    machine cannot honour."""


def kernel_mode() -> str:
    """The value of ``PHASEGRAPH_KERNELS`` (``auto`` when unset)."""
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise KernelSettingError(f"{ENV_VAR}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def use_triton(x: torch.Tensor) -> bool:
    """Whether a kernel whose main input is ``x`` runs its Triton implementation."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        if not HAS_TRITON:
            raise KernelSettingError(_NO_TRITON)
        return True
    return HAS_TRITON and x.device.type == "cuda"


class _NoTriton:
    """Stand-in for a ``@triton.jit`` function where Triton is not installed."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        raise RuntimeError(f"{self.fn.__name__}: triton is not installed")


def jit(fn=None, **kwargs):
    """``triton.jit`` when Triton is importable, else a stand-in that refuses to launch.

    Kernel modules use ``from __future__ import annotations``, so ``tl.constexpr`` annotations
    stay strings and a module defines its kernels even without Triton.
    """
    if triton is not None:
        return triton.jit(fn, **kwargs) if fn is not None else triton.jit(**kwargs)
    if fn is None:
        return _NoTriton
    return _NoTriton(fn)


@functools.cache
def _pdl_options(setting: str, interpreted: bool, device_index: int | None) -> dict:
    mode = setting.strip().lower() or "auto"
    if mode not in PDL_MODES:
        raise KernelSettingError(f"{PDL_ENV_VAR}={setting!r}: expected one of {', '.join(PDL_MODES)}")
    if mode == "off":
        return {"PDL": False}
    if device_index is None or interpreted:
        if mode == "on":
            raise KernelSettingError(f"{PDL_ENV_VAR}=on, but no CUDA device runs the kernels")
        return {"PDL": False}
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 9:
        if mode == "on":
            raise KernelSettingError(f"{PDL_ENV_VAR}=on, but CUDA device {device_index} has "
                                     f"compute capability {major}.{minor} (programmatic dependent "
                                     "launch needs 9.0)")
        return {"PDL": False}
    return PDL_LAUNCH


def pdl_options(early: bool = True) -> dict:
    """Keyword arguments for a Triton launch on the current device: the kernel's ``PDL``
    constant and Triton's ``launch_pdl`` (see the module docstring). The setting is read on
    every call; the answer is cached per setting and device (no synchronisation). ``early=False``
    launches the kernel plainly whatever the setting (for a grid sized to spread one wave over
    the SMs: placed early beside the kernel before it, its programs crowd onto the few SMs with
    room left)."""
    if not early:
        return {"PDL": False}
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    return _pdl_options(os.environ.get(PDL_ENV_VAR, "auto"), _INTERPRETED, device)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def early_weights_mode() -> str:
    """The value of ``PHASEGRAPH_EARLY_WEIGHTS`` (``auto`` when unset; see
    :func:`phasegraph.kernels.linear.early_weight_load`)."""
    setting = os.environ.get(EARLY_WEIGHTS_ENV_VAR, "auto")
    mode = setting.strip().lower() or "auto"
    if mode not in EARLY_WEIGHTS_MODES:
        raise KernelSettingError(f"{EARLY_WEIGHTS_ENV_VAR}={setting!r}: expected one of "
                                 f"{', '.join(EARLY_WEIGHTS_MODES)}")
    return mode


def check_kernel_settings(device: torch.device) -> None:
    """Raise :class:`KernelSettingError` now for a kernel setting that the kernels on
    ``device`` would refuse at their first launch, so that an Engine refuses it before it
    serves any request."""
    mode = kernel_mode()
    early_weights_mode()
    if mode == "reference":
        return
    if mode == "triton" and not HAS_TRITON:
        raise KernelSettingError(_NO_TRITON)
    if mode == "triton" or (HAS_TRITON and device.type == "cuda"):  # Triton kernels will launch
        index = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
        _pdl_options(os.environ.get(PDL_ENV_VAR, "auto"), _INTERPRETED, index)
        try:  # the launch tables the products will read
            tables_for(device)
        except TileTableError as exc:
            raise KernelSettingError(str(exc)) from None


def next_pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def prev_pow2(n: int) -> int:
    """The largest power of two <= max(n, 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small constant off CUDA, for the interpreter).

    Read once per device and cached (no synchronisation), so launch shapes that depend on it are
    still fixed for a given device.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sm_count(index)
    return 4


def as_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor viewed as uint8 (same storage), the form the kernels load and store."""
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


if triton is not None:
    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A kernel's first statement: wait until the kernel before it on the stream has ended
        (its writes visible), then let the next kernel launch; nothing unless ``PDL``."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
else:  # pragma: no cover - exercised only where Triton is missing
    def pdl_enter(PDL):
        return None
