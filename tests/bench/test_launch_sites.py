"""benchmarks/profile_pair_host.py --sites on the CPU: a step's device launches by phasegraph source
line, where one call into phasegraph/kernels counts once whatever its torch reference does."""

import re

import torch

from phasegraph import SpecConfig
from phasegraph.runtime.engine import Engine
from tests.bench.scripts import load_bench_script


def _script():
    return load_bench_script("profile_pair_host")


def test_a_decode_step_is_mapped_to_its_kernel_calls_and_phase_lines():
    script = _script()
    target, _ = script.build_pair(torch.float32, "cpu")
    base = type(target)(target.model, feature_mode="none")
    engine = Engine(base, None, spec=SpecConfig(method="none"), max_batch_size=1, kv_pool_tokens=2048,
                    max_context=1024, cuda_graphs=False, trace=False)
    table = script.launch_sites(engine, 1, steps=2)
    counts = {m.group(2): float(m.group(1)) for m in re.finditer(r"^\s+([\d.]+)x  (.+)$", table, re.MULTILINE)}
    layers = target.model.config.num_hidden_layers
    # one call per layer, although each CPU reference runs several ops (a decode step's rotary,
    # KV write and attention are one kernel module call: rope_attention)
    assert counts["phasegraph/kernels/rope_attention.py:rope_paged_attention (kernel call)"] == layers
    assert not any("rotary.py" in site or "attention.py:paged_attention" in site for site in counts)
    assert counts["phasegraph/kernels/linear.py:silu_mul_linear (kernel call)"] == layers
    assert any(site.startswith("phasegraph/phases/decode.py:") for site in counts)
    total = float(re.search(r"launches per step \(eager; a kernel-module call counts once\): (\d+)", table).group(1))
    assert len(counts) < 150 and total == round(sum(counts.values()))  # every site listed, and summed
