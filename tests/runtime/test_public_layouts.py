"""Every public draft-head layout loads and computes what its reference code computes, or is
refused by a named error that says which key or value is unsupported.

Each layout is a tiny checkpoint whose config keys and tensor names are the published ones
(``phasegraph.testing.checkpoints.write_public_draft``). Two checks per layout:

- the head's logits and next hidden, over a draft-extend, a second extend and two draft steps
  (``test_drafts.run_scenario``), equal a plain float64 torch forward written here from the
  layout's semantics and reading the checkpoint's tensors by name (not the runtime's modules);
- the engine's greedy speculative output, chain and tree, is token-identical to the
  non-speculative run (lossless).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import CheckpointMismatch, DraftMismatch, UnsupportedDraftLayout
from phasegraph.runtime.models.drafts import draft_kind, load_draft
from phasegraph.runtime.models.target import HFTarget
from phasegraph.testing.checkpoints import (
    PUBLIC_DRAFT_LAYOUTS,
    write_hf_target,
    write_public_draft,
)
from tests.runtime.pg_runtime_helpers import rms, rope
from tests.runtime.test_drafts import run_scenario

ATOL = 1e-4
KIND = {"eagle1": "eagle", "eagle3": "eagle3", "speculators": None, "nextn": "mtp"}
FEATURES = {"eagle": "last", "eagle3": "eagle3", "mtp": "last"}
TARGET = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, vocab_size=96, max_position_embeddings=256)


def kind_of(layout: str) -> str:
    if layout.startswith("speculators"):
        return "eagle3" if layout.endswith("eagle3") else "eagle"
    return KIND[layout.split("-")[0]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_hf_target(tmp_path_factory.mktemp("target"), "llama", **TARGET)


@pytest.fixture(scope="module")
def qwen2_target_dir(tmp_path_factory):
    return write_hf_target(tmp_path_factory.mktemp("qwen2"), "qwen2", **TARGET)


# -- the reference: plain float64 torch over the checkpoint's tensors ----------------------------


class Ref:
    """The layer math of Llama-family heads, reading tensors by their checkpoint names."""

    def __init__(self, tensors: dict, cfg: dict, eps: float) -> None:
        self.w = {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}
        self.cfg, self.eps = cfg, eps
        rope_params = cfg.get("rope_parameters") or {}
        self.theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)

    def lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        out = x.double() @ self.w[f"{name}.weight"].T
        return out + self.w[f"{name}.bias"] if f"{name}.bias" in self.w else out

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.w[f"{name}.weight"], self.eps)

    def attention(self, prefix: str, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        heads, kv = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        head_dim = self.w[f"{prefix}.self_attn.o_proj.weight"].shape[1] // heads
        q = self.lin(f"{prefix}.self_attn.q_proj", x).view(n, heads, head_dim)
        k = self.lin(f"{prefix}.self_attn.k_proj", x).view(n, kv, head_dim)
        v = self.lin(f"{prefix}.self_attn.v_proj", x).view(n, kv, head_dim)
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril()[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * head_dim)
        return self.lin(f"{prefix}.self_attn.o_proj", out)

    def mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        gate = self.lin(f"{prefix}.mlp.gate_proj", x)
        return self.lin(f"{prefix}.mlp.down_proj", torch.nn.functional.silu(gate) * self.lin(f"{prefix}.mlp.up_proj", x))

    def after_attention(self, prefix: str, h1: torch.Tensor) -> torch.Tensor:
        return h1 + self.mlp(prefix, self.norm(f"{prefix}.post_attention_layernorm", h1))

    def layer(self, prefix: str, x: torch.Tensor, pos: torch.Tensor, *, input_norm: bool = True) -> torch.Tensor:
        normed = self.norm(f"{prefix}.input_layernorm", x) if input_norm else x
        return self.after_attention(prefix, x + self.attention(prefix, normed, pos))


def tensors_of(directory) -> dict:
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", weights_only=True)
    return load_file(str(directory / "model.safetensors"))


def reference(layout: str, directory, target: HFTarget):
    """``rows -> (logits [n, V or Vd], next hidden [n, H])`` of the layout's reference code."""
    raw = json.loads((directory / "config.json").read_text())
    cfg = raw.get("transformer_layer_config", raw)
    ref = Ref(tensors_of(directory), cfg, cfg["rms_norm_eps"])
    target_embed = target.embed_tokens.weight.double()
    target_head = target.lm_head.weight.double()
    w = ref.w

    def rows_of(rows):
        pos = torch.tensor([r.pos for r in rows])
        return pos, [r.token for r in rows]

    if layout.startswith("eagle1") or layout == "speculators-eagle":
        spec = layout == "speculators-eagle"

        def eagle1(rows):
            pos, tokens = rows_of(rows)
            e = w.get("embed_tokens.weight", target_embed)[tokens]  # the checkpoint's wins
            if spec:
                e = ref.norm("embedding_layernorm", e)
            x = ref.lin("fusion_fc" if spec else "fc", torch.cat([e, torch.stack([r.vec.double() for r in rows])], -1))
            out = ref.layer("transformer" if spec else "layers.0", x, pos, input_norm=spec)
            normed = ref.norm("pre_lm_head_layernorm", out) if spec else out
            return normed @ target_head.T, out

        return eagle1

    if layout == "nextn":
        p = f"model.layers.{raw['num_hidden_layers']}"

        def nextn(rows):
            pos, tokens = rows_of(rows)
            e = w[f"{p}.embed_tokens.weight"][tokens] * (pos != 0)[:, None]  # vLLM zeroes position 0
            prev = torch.stack([r.vec.double() for r in rows])
            x = ref.lin(f"{p}.eh_proj", torch.cat([ref.norm(f"{p}.enorm", e), ref.norm(f"{p}.hnorm", prev)], -1))
            out = ref.layer(p, x, pos)
            return ref.lin(f"{p}.shared_head.head", ref.norm(f"{p}.shared_head.norm", out)), out

        return nextn

    prefixes = sorted({k.split(".self_attn")[0] for k in w if ".self_attn.q_proj" in k})
    flag = {k: bool(raw.get(k) or (raw.get("eagle_config") or {}).get(k)) for k in
            ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc")}
    embed = w.get("embed_tokens.weight", target_embed)

    def eagle3(rows):
        pos, tokens = rows_of(rows)
        hs = []
        for r in rows:
            if r.step is not None:
                hs.append(r.vec.double())
                continue
            f = r.vec.double()
            if flag["norm_before_fc"]:
                f = ref.norm("input_norm", f)
            if flag["fc_norm"]:
                f = torch.cat([ref.norm(f"fc_norm.{i}", c) for i, c in enumerate(f.chunk(3))])
            hs.append(ref.lin("fc", f))
        h = torch.stack(hs)
        first, *rest = prefixes
        hn = ref.norm(f"{first}.hidden_norm", h)
        x = torch.cat([ref.norm(f"{first}.input_layernorm", embed[tokens]), hn], -1)
        h1 = (hn if flag["norm_before_residual"] else h) + ref.attention(first, x, pos)
        out = ref.after_attention(first, h1)
        for prefix in rest:
            out = ref.layer(prefix, out, pos)
        normed = ref.norm("norm", out)
        logits = normed @ (w["lm_head.weight"] if "lm_head.weight" in w else target_head).T
        return logits, normed if flag["norm_output"] else out

    return eagle3


# -- every layout: loads, parity with the reference, lossless in the engine ------------------------


def load(layout, tmp_path, target_dir, **options):
    directory = write_public_draft(tmp_path / layout, target_dir, layout)
    kind = kind_of(layout)
    assert draft_kind(directory) == kind
    target = HFTarget.from_pretrained(target_dir, feature_mode=FEATURES[kind])
    return directory, target, load_draft(directory, target, **options)


EAGLE3_LAYOUTS = [name for name in PUBLIC_DRAFT_LAYOUTS if kind_of(name) == "eagle3"]
# (layout, adapter options): every layout with its default path, and the EAGLE-3 ones the fused
# path runs by default once more through transformers' modules
PATHS = [(name, {}) for name in PUBLIC_DRAFT_LAYOUTS] + [(name, {"fused": False}) for name in EAGLE3_LAYOUTS]


@pytest.mark.parametrize(("layout", "options"), PATHS, ids=[f"{n}-{'modules' if o else 'default'}" for n, o in PATHS])
def test_layout_computes_what_its_reference_computes(tmp_path, target_dir, qwen2_target_dir, layout, options):
    base = qwen2_target_dir if layout == "eagle1-qwen2" else target_dir
    directory, target, draft = load(layout, tmp_path, base, **options)
    if kind_of(layout) == "eagle3":  # which layouts the fused path takes, and which it leaves
        plain = layout in ("eagle3-norm_before_residual", "eagle3-wide", "speculators-eagle3")
        assert (draft.fused_layer is not None) == (plain and not options)
    hist = run_scenario(draft, target, page_size=4)
    naive = reference(layout, directory, target)
    checked = 0
    for rows in hist:
        want_logits, want_hidden = naive(rows)
        for i, row in enumerate(rows):
            torch.testing.assert_close(row.hidden.double(), want_hidden[i], atol=ATOL, rtol=0)
            if row.logits is not None:
                torch.testing.assert_close(row.logits.double(), want_logits[i], atol=ATOL, rtol=0)
                checked += 1
    assert checked > 4


def test_a_copied_embedding_is_dropped_and_a_distinct_one_used(tmp_path, target_dir):
    for layout in ("speculators-eagle3", "eagle1-bias"):
        _, _, copied = load(layout, tmp_path, target_dir)
        assert not hasattr(copied.head, "embed_tokens")  # the target's copy: one table, not two
    directory = write_public_draft(tmp_path / "own", target_dir, "eagle1-bias")
    state = torch.load(directory / "pytorch_model.bin", weights_only=True)
    state["embed_tokens.weight"] = state["embed_tokens.weight"] * 0.5  # trained further
    torch.save(state, directory / "pytorch_model.bin")
    target = HFTarget.from_pretrained(target_dir, feature_mode="last")
    draft = load_draft(directory, target)
    assert draft.embedding is draft.head.embed_tokens
    hist = run_scenario(draft, target, page_size=4)
    want_logits, _ = reference("eagle1-bias", directory, target)(hist[0])
    row = next(r for r in hist[0] if r.logits is not None)
    torch.testing.assert_close(row.logits.double(), want_logits[hist[0].index(row)], atol=ATOL, rtol=0)
    _, target, wide = load("eagle3-wide", tmp_path, target_dir)
    assert wide.embedding is wide.head.embed_tokens and wide.hidden_size == 48 != target.hidden_size


@pytest.mark.parametrize("shape", [dict(topk=1, num_steps=3), dict(topk=4, num_steps=3, num_draft_tokens=8)],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("layout", list(PUBLIC_DRAFT_LAYOUTS))
def test_layout_is_lossless_in_the_engine(tmp_path, target_dir, qwen2_target_dir, layout, shape):
    base = qwen2_target_dir if layout == "eagle1-qwen2" else target_dir
    directory = write_public_draft(tmp_path / layout, base, layout)
    prompts = [[3, 14, 15, 92, 65, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    baseline = Engine.from_pretrained(base, None, spec=SpecConfig(method="none"), dtype="float32",
                                      kv_pool_tokens=1024)
    engine = Engine.from_pretrained(base, directory, spec=SpecConfig(method=kind_of(layout), **shape),
                                    dtype="float32", kv_pool_tokens=1024)
    want = [o.token_ids for o in baseline.generate(prompts, params)]
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want


# -- refusals: by name, before any weight is read ---------------------------------------------------


def rewrite_config(directory, **changes):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return directory


@pytest.mark.parametrize(
    ("layout", "changes", "error", "match"),
    [
        ("eagle3-norm_before_residual", {"num_hidden_layers": 2}, UnsupportedDraftLayout,
         r"num_hidden_layers is 2, but the checkpoint holds layers \[0\] under 'midlayer'"),
        ("eagle3-midlayers", {"num_hidden_layers": 3}, UnsupportedDraftLayout, r"holds layers \[0, 1\]"),
        ("eagle3-fc_norm", {"norm_output": "yes"}, UnsupportedDraftLayout, "norm_output must be true or false; got 'yes'"),
        ("eagle3-fc_norm", {"norm_before_residual": 1}, UnsupportedDraftLayout, "norm_before_residual must be true or false"),
        ("eagle3-fc_norm", {"bias": True}, UnsupportedDraftLayout, "bias: true is not supported"),
        ("eagle3-fc_norm", {"num_aux_hidden_states": 4}, UnsupportedDraftLayout, "num_aux_hidden_states 4"),
        ("eagle3-fc_norm", {"eagle_config": {"use_aux_hidden_state": False}}, UnsupportedDraftLayout,
         "use_aux_hidden_state: false is not supported"),
        ("eagle1-llama3", {"bias": "false"}, UnsupportedDraftLayout, "bias must be true or false; got 'false'"),
        ("eagle1-llama3", {"bias": None}, CheckpointMismatch, r"missing keys \(1\): fc.bias"),
        ("eagle1-bias", {"bias": False}, CheckpointMismatch, r"unexpected keys \(1\): fc.bias"),
        ("eagle1-qwen2", {"qkv_bias": False}, CheckpointMismatch, "layers.0.self_attn.k_proj.bias"),
        ("speculators-eagle", {"layernorms": "on"}, UnsupportedDraftLayout, "layernorms must be true or false"),
        ("speculators-eagle3", {"speculators_model_type": "mlp_speculator"}, UnsupportedDraftLayout,
         "speculators_model_type 'mlp_speculator' is not supported"),
        ("speculators-eagle3", {"transformer_layer_config": None, "speculators_model_type": "eagle3"},
         UnsupportedDraftLayout, "transformer_layer_config as an object"),
        ("nextn", {"num_nextn_predict_layers": 2}, UnsupportedDraftLayout, "num_nextn_predict_layers 2"),
        ("nextn", {"kv_lora_rank": 512}, UnsupportedDraftLayout, "kv_lora_rank 512: multi-head latent attention"),
        ("nextn", {"n_routed_experts": 8}, UnsupportedDraftLayout, "n_routed_experts 8: routed experts"),
    ],
)
def test_unsupported_keys_and_values_are_refused_by_name(tmp_path, target_dir, qwen2_target_dir, layout,
                                                          changes, error, match):
    base = qwen2_target_dir if layout == "eagle1-qwen2" else target_dir
    directory = rewrite_config(write_public_draft(tmp_path / layout, base, layout), **changes)
    kind = kind_of(layout)
    target = HFTarget.from_pretrained(base, feature_mode=FEATURES[kind])
    with pytest.raises(error, match=match):
        load_draft(directory, target, kind)


def test_heads_that_cannot_use_the_targets_tables_are_refused(tmp_path, target_dir):
    directory = write_public_draft(tmp_path / "wide", target_dir, "eagle3-wide")
    state = load_file(str(directory / "model.safetensors"))
    del state["embed_tokens.weight"]
    save_file(state, str(directory / "model.safetensors"))
    target = HFTarget.from_pretrained(target_dir, feature_mode="eagle3")
    with pytest.raises(DraftMismatch, match="needs its own embed_tokens.weight"):
        load_draft(directory, target)
    del state["lm_head.weight"]
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(DraftMismatch, match="has no lm_head.weight, so it uses the target's"):
        load_draft(directory, target)


def test_mimo_names_are_refused_by_name(tmp_path, target_dir):
    directory = write_public_draft(tmp_path / "nextn", target_dir, "nextn")
    state = load_file(str(directory / "model.safetensors"))
    renamed = {k.replace("model.layers.4.", "model.mtp_layers.0."): v for k, v in state.items()}
    save_file(renamed, str(directory / "model.safetensors"))
    with pytest.raises(UnsupportedDraftLayout, match=r"MiMo's model.mtp_layers"):
        draft_kind(directory)
