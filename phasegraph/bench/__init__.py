"""What ``phasegraph bench`` measures: end-to-end speed against transformers and our own
baseline. The command's options and output are :mod:`phasegraph.cli.bench`.

One command, one process, one GPU::

    phasegraph bench --out DIR [--pair PAIR_DIR] [--train-budget-s 280] [--parts 1,2]
    phasegraph bench --quick --out DIR            # the whole pipeline on the CPU, tiny models

Part 1, trained pair: reuses ``--pair`` when it holds ``target/`` and ``eagle3/`` (and
``draft/``), else trains the ``bench-pair`` preset into it (``phasegraph.train``, strict
deterministic kernels, stages sized to fit ``--train-budget-s`` on an H100, which cuts them
only on a slower GPU). Held-out stdlib prompts (last ``--prompt-tokens`` tokens), greedy,
``--new-tokens`` new tokens, ``ignore_eos``, at each batch size (B prompts at once): phasegraph
baseline (``method="none"``), EAGLE-3 chain and tree, standalone-draft chain; transformers'
``generate`` on the same target (sdpa attention), plain and with ``assistant_model`` (batch 1
only: transformers' assisted generation does not batch). Tokens/s (warm-up excluded), τ,
speedup over the phasegraph baseline at the same batch, η = speedup / τ, time share by phase
(from the engine's trace) and the share of outputs identical to the baseline's.

Part 2, scale: benchmarks/bench_scale.py's Llama-3-8B-shaped target (random bf16 weights) and
EAGLE-3-shaped head (chain S=3 drafts by default), acceptance SIMULATED (verify accepts τ - 1
drafts whatever they are) at each τ and batch size, against the graphed baseline; the baseline's
share of the bandwidth bound, and bench_scale's GPU probes of a decode step and of each phase.

Writes ``bench.json`` (every figure and the environment), ``bench.md`` (the table, also
printed), ``tokens_per_s.png`` and ``eta_vs_tau.png`` into ``--out``; the JSON and the table
after every configuration too, so a run cut short still leaves what it measured.
"""
