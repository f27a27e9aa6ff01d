"""The kernel warm-up process ``phasegraph bench`` starts while its pair trains::

    python -m phasegraph.cli.bench_warmup SPEC_JSON

Runs :func:`phasegraph.bench.warm.run_spec` on the spec part 1 wrote, one line per configuration
and a closing line on stdout (the bench sends them to ``compile_warmup.log``).
"""

from __future__ import annotations

import functools
import json
import sys
import time

from phasegraph.bench.warm import run_spec


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    t0 = time.perf_counter()
    calls = run_spec(spec, functools.partial(print, flush=True))
    print(f"warm-up: {calls} calls in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
