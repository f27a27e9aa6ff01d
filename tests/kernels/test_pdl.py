"""Programmatic dependent launch (phasegraph.kernels._dispatch, ``PHASEGRAPH_PDL``) on the CPU:
the setting's values and errors, the device-capability rule, and the invariant that makes it safe
(every Triton kernel waits for the kernel before it, first thing, when it is launched early).
Whole engines with it on against it off are compared bit for bit in tests/gpu/test_cuda_graphs.py.
"""

from __future__ import annotations

import ast
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import phasegraph.kernels
from phasegraph.kernels import _dispatch

ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}


@pytest.fixture(autouse=True)
def _fresh_cache():
    _dispatch._pdl_options.cache_clear()
    yield
    _dispatch._pdl_options.cache_clear()


def _capability(monkeypatch, major, minor=0):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, minor))


@pytest.mark.parametrize("setting", ["", "auto", "AUTO ", "off"])
def test_without_a_cuda_device_kernels_launch_plainly(monkeypatch, setting):
    monkeypatch.setenv("PHASEGRAPH_PDL", setting)
    assert _dispatch.pdl_options() == OFF


def test_on_without_a_cuda_device_is_an_error(monkeypatch):
    monkeypatch.setenv("PHASEGRAPH_PDL", "on")
    with pytest.raises(_dispatch.KernelSettingError, match="PHASEGRAPH_PDL=on, but no CUDA device"):
        _dispatch.pdl_options()


def test_an_unknown_setting_is_named(monkeypatch):
    monkeypatch.setenv("PHASEGRAPH_PDL", "sometimes")
    with pytest.raises(ValueError, match=r"PHASEGRAPH_PDL='sometimes': expected one of auto, "
                                         r"on, off"):
        _dispatch.pdl_options()


@pytest.mark.parametrize(("major", "auto", "on"), [(8, OFF, None), (9, ON, ON), (10, ON, ON)])
def test_the_device_capability_decides(monkeypatch, major, auto, on):
    _capability(monkeypatch, major)
    assert _dispatch._pdl_options("auto", False, 0) == auto
    assert _dispatch._pdl_options("off", False, 0) == OFF
    if on is None:
        with pytest.raises(_dispatch.KernelSettingError, match=r"compute capability 8\.0 \(programmatic "
                                               r"dependent launch needs 9\.0\)"):
            _dispatch._pdl_options("on", False, 0)
    else:
        assert _dispatch._pdl_options("on", False, 0) == on


def test_a_launch_may_opt_out(monkeypatch):
    monkeypatch.setenv("PHASEGRAPH_PDL", "on")  # never consulted
    assert _dispatch.pdl_options(early=False) == OFF


def test_the_interpreter_never_launches_early(monkeypatch):
    _capability(monkeypatch, 9)
    assert _dispatch._pdl_options("auto", True, 0) == OFF
    with pytest.raises(_dispatch.KernelSettingError, match="no CUDA device runs the kernels"):
        _dispatch._pdl_options("on", True, 0)


def _kernel_modules():
    for info in pkgutil.iter_modules(phasegraph.kernels.__path__):
        module = __import__(f"phasegraph.kernels.{info.name}", fromlist=["_"])
        yield info.name, module


def _kernels():
    """(module name, kernel name, function definition) of every ``*_kernel`` in the package."""
    found = []
    for name, module in _kernel_modules():
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                found.append((name, node.name, node))
    return found


KERNELS = _kernels()


def test_the_package_has_its_kernels():
    names = {kernel for _, kernel, _ in KERNELS}
    assert len(names) >= 35 and {"_skinny_kernel", "_rope_tree_attention_kernel",
                                 "_add_rms_norm_kernel", "_chunk_topk_kernel"} <= names


@pytest.mark.parametrize(("module", "kernel", "node"), KERNELS,
                         ids=[f"{module}.{kernel}" for module, kernel, _ in KERNELS])
def test_every_kernel_waits_for_the_one_before_first(module, kernel, node):
    """A kernel launched early must not read or write anything before ``griddepcontrol.wait``:
    its first statement (after the docstring) is ``pdl_enter(PDL)``, PDL a constexpr. The one
    exception is a weight load under ``if EARLY_W:`` (weights no kernel writes), with the index
    arithmetic it needs (``_pre_wait_problems``)."""
    params = {a.arg: a for a in node.args.args}
    assert "PDL" in params, f"{module}.{kernel} has no PDL parameter"
    assert ast.unparse(params["PDL"].annotation) == "tl.constexpr"
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    texts = [ast.unparse(stmt) for stmt in body]
    assert "pdl_enter(PDL)" in texts, f"{module}.{kernel} never calls pdl_enter(PDL)"
    before = body[: texts.index("pdl_enter(PDL)")]
    assert _pre_wait_problems(before) == [], f"{module}.{kernel}"


PURE_CALLS = {"tl.program_id", "tl.arange", "tl.cdiv", "tl.minimum", "tl.maximum"}


def _pre_wait_problems(statements) -> list[str]:
    """What in ``statements`` (a kernel's, before its wait) may touch memory another kernel
    writes: anything but assignments of index arithmetic (``PURE_CALLS``, ``.to`` casts, and
    ``w_ptr`` offsets) and ``if EARLY_W:`` blocks whose one call is ``_w_tile(w_rows, ...)``."""
    problems = []
    for stmt in statements:
        text = ast.unparse(stmt)
        if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "EARLY_W" and not stmt.orelse:
            calls = [ast.unparse(c) for c in ast.walk(stmt) if isinstance(c, ast.Call)]
            if not calls or not all(c.startswith("_w_tile(w_rows,") for c in calls):
                problems.append(text)
            continue
        if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "SPLIT_K > 1":
            problems += _pre_wait_problems(stmt.body) + _pre_wait_problems(stmt.orelse)
            continue
        if not isinstance(stmt, ast.Assign):
            problems.append(text)
            continue
        calls = {ast.unparse(c.func) for c in ast.walk(stmt) if isinstance(c, ast.Call)}
        names = {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)}
        if any(c not in PURE_CALLS and not c.endswith(".to") for c in calls) or names & {
                "x_ptr", "res_ptr", "y_ptr", "partial_ptr", "arrived_ptr", "summed_ptr"}:
            problems.append(text)
    return problems


def test_the_pre_wait_check_refuses_reads_of_what_a_kernel_writes():
    def problems(source):
        return _pre_wait_problems(ast.parse(source).body)

    assert problems("pid = tl.program_id(0)\nrows = w_ptr + pid.to(tl.int64) * 4") == []
    assert problems("if EARLY_W:\n    w = _w_tile(w_rows, n_in, ks, K, EVEN_K)") == []
    assert problems("a = tl.load(x_ptr)") == ["a = tl.load(x_ptr)"]
    assert problems("if EARLY_W:\n    a = tl.load(x_ptr)") != []
    assert problems("if PREFETCH:\n    w = _w_tile(w_rows, n_in, ks, K, EVEN_K)") != []
    assert problems("p = x_ptr + 4") == ["p = x_ptr + 4"]
    assert problems("tl.store(w_ptr, 0)") == ["tl.store(w_ptr, 0)"]


def test_launch_pdl_is_set_only_beside_a_waiting_kernel():
    """``launch_pdl`` appears in the kernel package only where ``PDL`` is set with it: the
    dispatcher's one early-launch option set (which the skinny product's forced-PDL configs
    take too)."""
    root = Path(phasegraph.kernels.__file__).parent
    sites = [(p.name, line) for p in sorted(root.glob("*.py"))
             for line in p.read_text().splitlines() if '"launch_pdl"' in line]
    assert sites and all('"PDL": True' in line for _, line in sites), sites
    assert {name for name, _ in sites} == {"_dispatch.py"}
