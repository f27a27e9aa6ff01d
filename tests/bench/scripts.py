"""Loading a script of ``benchmarks/`` (not a package) as a module, as the tests of those scripts do."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load_bench_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a fresh module, with ``benchmarks/`` importable while it loads (scripts
    import their neighbours)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module
