"""The weight bytes a decode step and a speculative iteration stream (`phasegraph bench`'s bound
on η at the memory-bandwidth limit), against parameter counts worked out from the configs."""

from __future__ import annotations

import pytest

from phasegraph import Engine, SpecConfig
from phasegraph.bench.common import forward_weight_bytes, iteration_weight_bytes
from phasegraph.testing.checkpoints import (
    TINY,
    write_eagle1_draft,
    write_eagle3_draft,
    write_hf_target,
    write_standalone_draft,
)

F32 = 4  # bytes per float32 weight


def llama_layer(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, norms: int = 2,
                attn_in: int | None = None) -> int:
    """Parameters of one Llama decoder layer (q/k/v take ``attn_in`` inputs)."""
    attn_in = attn_in or hidden
    return ((heads + 2 * kv_heads) * head_dim * attn_in + hidden * heads * head_dim
            + 3 * hidden * inter + norms * hidden)


H, INTER, V, L = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"], TINY["num_hidden_layers"]
D = H // TINY["num_attention_heads"]
TARGET_STEP = L * llama_layer(H, INTER, 4, 2, D) + H + V * H  # layers, final norm, lm_head (no embedding)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    target = write_hf_target(root / "target")
    return {
        "target": target,
        "tied": write_hf_target(root / "tied", tie_word_embeddings=True),
        "eagle3": write_eagle3_draft(root / "eagle3", target),
        "eagle3_small_vocab": write_eagle3_draft(root / "eagle3_small", target, draft_vocab_size=32),
        "eagle1": write_eagle1_draft(root / "eagle1", target),
        "standalone": write_standalone_draft(root / "standalone", target),
    }


def engine(dirs, draft: str | None, **spec) -> Engine:
    return Engine.from_pretrained(dirs["target"], dirs[draft] if draft else None, spec=SpecConfig(**spec),
                                  device="cpu", dtype="float32", cuda_graphs=False)


def test_a_tied_table_counts_once_as_the_lm_head(dirs):
    from transformers import AutoModelForCausalLM

    untied = AutoModelForCausalLM.from_pretrained(str(dirs["target"]))
    tied = AutoModelForCausalLM.from_pretrained(str(dirs["tied"]))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert forward_weight_bytes(untied) == forward_weight_bytes(tied) == F32 * TARGET_STEP


def test_baseline_streams_the_target_once(dirs):
    wb = iteration_weight_bytes(engine(dirs, None, method="none"))
    assert wb == {"step": F32 * TARGET_STEP, "draft_pass": 0, "draft_passes": 0, "draft_once": 0,
                  "iteration": F32 * TARGET_STEP, "eta_bound": 1.0}


@pytest.mark.parametrize(("draft", "draft_vocab"), [("eagle3", V), ("eagle3_small_vocab", 32)])
@pytest.mark.parametrize("spec", [dict(num_steps=3, topk=1, num_draft_tokens=4),
                                  dict(num_steps=4, topk=4, num_draft_tokens=16)])
def test_eagle3_reads_its_head_per_step_and_fc_once(dirs, draft, draft_vocab, spec):
    wb = iteration_weight_bytes(engine(dirs, draft, method="eagle3", **spec))
    # the test checkpoints' heads: 2H intermediate, 4 heads of D, 2 KV heads, q/k/v over [emb | hidden]
    midlayer = llama_layer(H, 2 * H, 4, 2, D, norms=3, attn_in=2 * H)
    per_pass = midlayer + H + draft_vocab * H  # + final norm + the head's own lm_head
    fc = 3 * H * H
    steps = spec["num_steps"]
    assert wb["draft_pass"] == F32 * per_pass and wb["draft_once"] == F32 * fc
    assert wb["draft_passes"] == steps
    assert wb["iteration"] == F32 * (TARGET_STEP + steps * per_pass + fc)
    assert wb["eta_bound"] == pytest.approx(TARGET_STEP / (TARGET_STEP + steps * per_pass + fc))


def test_standalone_reads_the_whole_draft_per_step(dirs):
    wb = iteration_weight_bytes(engine(dirs, "standalone", method="standalone", num_steps=3, topk=1,
                                       num_draft_tokens=4))
    h, layers = 32, 2  # write_standalone_draft's model: 2 heads of 16, 1 KV head, untied lm_head
    per_pass = layers * llama_layer(h, 64, 2, 1, 16) + h + V * h
    assert wb["draft_pass"] == F32 * per_pass and wb["draft_once"] == 0
    assert wb["iteration"] == F32 * (TARGET_STEP + 3 * per_pass)


def test_methods_the_bound_does_not_cover_give_none(dirs):
    assert iteration_weight_bytes(engine(dirs, "eagle1", method="eagle", num_steps=3, topk=1,
                                         num_draft_tokens=4)) is None
