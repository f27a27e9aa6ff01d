"""Draft adapters (EAGLE-1, EAGLE-3, MTP, standalone) over the paged pool == naive recomputation.

Scenario per draft kind and page size: two requests; draft-extend over the prompt rows
(from_target), a second extend of W=3 rows (as after a decode step), then two draft steps
(from_target=False, step 0 and 1) of one query per request. The naive side recomputes every row
in float64 from the head's weights with dense attention over the same rows (no pool, no
transformers modules).

One loader for every draft kind: the kind is told from the checkpoint, and a method that
names another kind is refused before any weight is read."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from phasegraph.phases.protocols import DraftModel
from phasegraph.runtime.config import SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import DraftMismatch, InvalidConfig
from phasegraph.runtime.kv_pool import KVCacheManager
from phasegraph.runtime.models.drafts import DRAFT_CLASSES, draft_kind, load_draft
from phasegraph.runtime.models.eagle1 import Eagle1Draft
from phasegraph.runtime.models.eagle3 import Eagle3Draft
from phasegraph.runtime.models.mtp import MTPDraft
from phasegraph.runtime.models.standalone import StandaloneDraft
from phasegraph.runtime.models.target import HFTarget
from phasegraph.testing.checkpoints import (
    write_eagle1_draft,
    write_eagle3_draft,
    write_hf_target,
    write_mtp_draft,
    write_standalone_draft,
)
from tests.engine.support import DRAFT_KINDS, arch_bundle
from tests.runtime.pg_runtime_helpers import (
    assert_conforms,
    linear,
    make_meta,
    naive_attention,
    naive_mlp,
    rms,
    rope_theta,
)

ATOL = 1e-4
W = 3


@dataclass
class Row:
    token: int
    pos: int
    vec: torch.Tensor | None  # target feature (extend) or previous draft hidden (step)
    step: int | None  # None for extend rows
    logits: torch.Tensor | None = None  # ours
    hidden: torch.Tensor | None = None  # ours


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_hf_target(tmp_path_factory.mktemp("target"), "llama")


def run_scenario(draft, target: HFTarget, page_size: int, *, mtp_own_rows_only=False):
    """Drive the draft through extend, extend, step 0, step 1; return per-request rows."""
    assert_conforms(draft, DraftModel)
    gen = torch.Generator().manual_seed(17 + page_size)
    vocab = target.vocab_size
    width = target.feature_size
    m = KVCacheManager(
        num_pages=2 * math.ceil(32 / page_size) + 4,
        page_size=page_size,
        max_reqs=3,
        max_pages_per_req=math.ceil(32 / page_size),
        target=target.kv_spec,
        draft=draft.kv_spec,
        topk=1,
        num_steps=3,
    )
    draft.attach_kv(m.draft_pool)
    lens = [6, 9]
    rows = [m.admit(n + W + 2) for n in lens]
    hist: list[list[Row]] = [[] for _ in lens]

    def call(items, *, from_target, step, extra=None, kv_len=None, logits_index=None):
        b_of = [b for b, _ in items]
        new = [row for _, row in items]
        pos = [r.pos for r in new]
        meta = make_meta(
            m.req_to_page,
            page_size,
            [rows[b] for b in b_of],
            pos,
            kv_len if kv_len is not None else [p + 1 for p in pos],
            extra,
        )
        hidden = None if new[0].vec is None else torch.stack([r.vec for r in new])
        out = draft.forward(
            torch.tensor([r.token for r in new]),
            hidden,
            torch.tensor(pos),
            meta,
            from_target=from_target,
            step=step,
            logits_index=logits_index,
        )
        assert out.logits.dtype == torch.float32
        index = range(len(new)) if logits_index is None else logits_index.tolist()
        for k, i in enumerate(index):
            new[i].logits = out.logits[k]
        for i, (b, row) in enumerate(items):
            row.hidden = out.hidden[i]
            hist[b].append(row)
        return out

    def feature():
        return torch.randn(width, generator=gen) if draft.uses_features else None

    def token():
        return int(torch.randint(0, vocab, (1,), generator=gen))

    # draft-extend after prefill: row p holds token p+1 (the last one is the bonus token)
    items = [(b, Row(token(), p, feature(), None)) for b, n in enumerate(lens) for p in range(n)]
    call(items, from_target=True, step=0)
    # draft-extend after a decode step: W rows; logits only for each request's last row
    items = [
        (b, Row(token(), n + i, feature(), None)) for b, n in enumerate(lens) for i in range(W)
    ]
    call(items, from_target=True, step=0, logits_index=torch.tensor([W - 1, 2 * W - 1]))
    # draft steps 0 and 1: one query per request, fed the previous hidden
    for step in range(2):
        items = [
            (
                b,
                Row(
                    token(),
                    n + W + step,
                    hist[b][-1].hidden if draft.uses_features else None,
                    step,
                ),
            )
            for b, n in enumerate(lens)
        ]
        # Plain draft-step metadata, as the draft phase builds it. An MTP draft narrows it
        # itself: layer 2 never ran at step 0's row, so step 1 reads the prefix and its own row.
        call(items, from_target=False, step=step)
    m.check()
    return hist


def compare(hist, naive):
    checked = 0
    for rows in hist:
        want_logits, want_hidden = naive(rows)
        for i, row in enumerate(rows):
            torch.testing.assert_close(row.hidden.double(), want_hidden[i], atol=ATOL, rtol=0)
            if row.logits is not None:
                torch.testing.assert_close(row.logits.double(), want_logits[i], atol=ATOL, rtol=0)
                checked += 1
    assert checked > 0


def dims(config):
    return dict(
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        theta=rope_theta(config),
    )


def causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("draft_vocab", [None, 40])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "modules"])
def test_eagle3_matches_naive(tmp_path, target_dir, page_size, draft_vocab, fused):
    target = HFTarget.from_pretrained(target_dir, feature_mode="eagle3")
    d = Eagle3Draft.from_pretrained(
        write_eagle3_draft(tmp_path / "e3", target_dir, draft_vocab_size=draft_vocab), target,
        fused=fused,
    )
    assert (d.fused_layer is not None) == fused
    assert d.uses_features and d.hidden_size == 64
    assert d.vocab_size == (draft_vocab or 128)
    hist = run_scenario(d, target, page_size)
    head, cfg = d.head, d.config
    mid = head.midlayer
    eps = cfg.rms_norm_eps
    embed = target.embed_tokens.weight.double()

    def naive(rows):
        e = embed[[r.token for r in rows]]
        h = torch.stack(
            [linear(r.vec, head.fc) if r.step is None else r.vec.double() for r in rows]
        )
        x = torch.cat(
            [rms(e, mid.input_layernorm.weight, eps), rms(h, mid.hidden_norm.weight, eps)], -1
        )
        pos = torch.tensor([r.pos for r in rows])
        h1 = h + naive_attention(mid.self_attn, x, pos, causal(len(rows)), **dims(cfg))
        out = h1 + naive_mlp(mid.mlp, rms(h1, mid.post_attention_layernorm.weight, eps))
        return linear(rms(out, head.norm.weight, eps), head.lm_head), out

    compare(hist, naive)
    if draft_vocab:
        ids = torch.arange(draft_vocab)
        mapped = d.to_target_ids(ids)
        assert (mapped == ids + d.d2t).all() and (mapped < 128).all()
        assert mapped.unique().numel() == draft_vocab
    else:
        assert d.d2t is None and torch.equal(d.to_target_ids(torch.arange(5)), torch.arange(5))


@pytest.mark.parametrize("page_size", [1, 4])
def test_eagle1_matches_naive(tmp_path, target_dir, page_size):
    target = HFTarget.from_pretrained(target_dir, feature_mode="last")
    d = Eagle1Draft.from_pretrained(
        write_eagle1_draft(tmp_path / "e1", target_dir, fmt="bin"), target
    )
    assert isinstance(d.head.layers[0].input_layernorm, torch.nn.Identity)
    hist = run_scenario(d, target, page_size)
    head, cfg = d.head, d.config
    layer = head.layers[0]
    eps = cfg.rms_norm_eps
    embed = target.embed_tokens.weight.double()

    def naive(rows):
        e = embed[[r.token for r in rows]]
        f = torch.stack([r.vec.double() for r in rows])
        x = linear(torch.cat([e, f], -1), head.fc)
        pos = torch.tensor([r.pos for r in rows])
        h1 = x + naive_attention(layer.self_attn, x, pos, causal(len(rows)), **dims(cfg))
        out = h1 + naive_mlp(layer.mlp, rms(h1, layer.post_attention_layernorm.weight, eps))
        return linear(out, target.lm_head), out

    compare(hist, naive)


@pytest.mark.parametrize(("page_size", "num_layers"), [(1, 2), (4, 2), (4, 3), (4, 1)])
def test_mtp_matches_naive(tmp_path, target_dir, page_size, num_layers):
    target = HFTarget.from_pretrained(target_dir, feature_mode="last")
    d = MTPDraft.from_pretrained(
        write_mtp_draft(tmp_path / "mtp", target_dir, num_layers=num_layers), target
    )
    assert d.kv_spec.num_layers == num_layers
    hist = run_scenario(d, target, page_size, mtp_own_rows_only=num_layers >= 3)
    head, cfg = d.head, d.config
    eps = cfg.rms_norm_eps
    embed = target.embed_tokens.weight.double()

    def layer_fwd(i, e, prev, pos):
        layer = head.layers[i]
        x = linear(
            torch.cat([rms(e, layer.enorm.weight, eps), rms(prev, layer.hnorm.weight, eps)], -1),
            layer.eh_proj,
        )
        h1 = x + naive_attention(
            layer.self_attn,
            rms(x, layer.input_layernorm.weight, eps),
            pos,
            causal(len(pos)),
            **dims(cfg),
        )
        return h1 + naive_mlp(layer.mlp, rms(h1, layer.post_attention_layernorm.weight, eps))

    def naive(rows):
        # Each layer attends over the rows it ran at (extend rows: all layers; step s: one).
        ran = {i: [] for i in range(num_layers)}  # layer -> row indices
        inputs = {}  # (layer, row index) -> prev hidden fed to that layer
        outs = {}
        for k, r in enumerate(rows):
            if r.step is None:
                for i in range(num_layers):
                    ran[i].append(k)
            else:
                ran[min(r.step + 1, num_layers - 1)].append(k)
        e_all = embed[[r.token for r in rows]]
        for i in range(num_layers):
            ks = ran[i]
            if not ks:
                continue
            prev = []
            for k in ks:
                r = rows[k]
                if r.step is None:
                    prev.append(r.vec.double() if i == 0 else outs[(i - 1, k)])
                else:
                    prev.append(r.vec.double())
                inputs[(i, k)] = prev[-1]
            h = layer_fwd(i, e_all[ks], torch.stack(prev), torch.tensor([rows[k].pos for k in ks]))
            for j, k in enumerate(ks):
                outs[(i, k)] = h[j]
        hidden = []
        for k, r in enumerate(rows):
            i = 0 if r.step is None else min(r.step + 1, num_layers - 1)
            hidden.append(outs[(i, k)])
        hidden = torch.stack(hidden)
        return linear(rms(hidden, head.norm.weight, eps), target.lm_head), hidden

    compare(hist, naive)
    assert [d.layer_for_step(s) for s in range(3)] == [
        min(s + 1, num_layers - 1) for s in range(3)
    ]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_standalone_matches_transformers_at_its_own_positions(
    tmp_path, target_dir, page_size, model_type
):
    target = HFTarget.from_pretrained(target_dir, feature_mode="none")
    directory = write_standalone_draft(tmp_path / "sa", target_dir, model_type)
    d = StandaloneDraft.from_pretrained(directory, target)
    assert not d.uses_features and d.kv_spec.num_layers == 2 and d.kv_spec.num_kv_heads == 1
    seen = []
    inner = d.model.forward
    d.model.forward = lambda ids, pos, attn, idx=None: (
        seen.append(pos) or inner(ids, pos, attn, idx)
    )
    hist = run_scenario(d, target, page_size)
    # A standalone draft (KV lead 1) runs every token at its own position: the LM is given
    # the positions the phases pass, unshifted (RoPE is shift-invariant, so check them directly).
    assert torch.equal(seen[0][:6], torch.arange(0, 6))
    ref = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    for rows in hist:
        ids = torch.tensor([[r.token for r in rows]])
        pos = torch.tensor([[r.pos for r in rows]])  # each token at its own position
        with torch.no_grad():
            want = ref(input_ids=ids, position_ids=pos).logits[0].double()
        for i, r in enumerate(rows):
            assert r.hidden.shape == (0,)
            if r.logits is not None:
                torch.testing.assert_close(r.logits.double(), want[i], atol=ATOL, rtol=0)


def test_a_head_built_in_code_attends_over_the_paged_pool(tmp_path, target_dir):
    """A head built from a plain LlamaConfig (transformers' default: eager attention, which
    would attend over one call's tokens only) gets the paged attention, and computes exactly
    what the same weights loaded from a checkpoint compute; a module holding another config
    that asks for another attention is refused."""
    from transformers import LlamaConfig

    from phasegraph.runtime.errors import DraftMismatch
    from phasegraph.runtime.models.eagle3 import Eagle3Head, eagle3_dims

    target = HFTarget.from_pretrained(target_dir, feature_mode="eagle3")
    loaded = Eagle3Draft.from_pretrained(write_eagle3_draft(tmp_path / "e3", target_dir), target, fused=False)
    raw = {k: v for k, v in loaded.config.to_dict().items() if not k.startswith("_")}
    plain = LlamaConfig(**raw)
    plain._attn_implementation = "eager"
    target_hidden, draft_vocab = eagle3_dims(plain)
    head = Eagle3Head(plain, target_hidden_size=target_hidden, draft_vocab_size=draft_vocab,
                      with_d2t=hasattr(loaded.head, "d2t"), with_t2d=hasattr(loaded.head, "t2d"))
    head.load_state_dict(loaded.head.state_dict())
    built = Eagle3Draft(target, plain, head, fused=False)  # the modules path reads the config
    assert plain._attn_implementation == "phasegraph"
    got, want = run_scenario(built, target, 4), run_scenario(loaded, target, 4)
    rows = [(a, b) for ra, rb in zip(got, want, strict=True) for a, b in zip(ra, rb, strict=True)]
    computed = [(a, b) for a, b in rows if b.logits is not None]
    assert len(computed) > 4
    for a, b in computed:
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)

    foreign = LlamaConfig(**raw)
    foreign._attn_implementation = "eager"
    head.midlayer.self_attn.config = foreign
    with pytest.raises(DraftMismatch, match="uses attention 'eager', not the paged 'phasegraph'"):
        Eagle3Draft(target, LlamaConfig(**raw), head)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return arch_bundle(tmp_path_factory.mktemp("kinds"), "llama")


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_each_kind_is_told_from_its_checkpoint_and_loads(bundle, kind):
    assert draft_kind(bundle.drafts[kind]) == kind
    target = HFTarget.from_pretrained(bundle.target, feature_mode={"eagle3": "eagle3", "standalone": "none"}.get(kind, "last"))
    assert type(load_draft(bundle.drafts[kind], target)) is DRAFT_CLASSES[kind]


def test_the_target_itself_is_a_standalone_draft(bundle):
    assert draft_kind(bundle.drafts["self"]) == "standalone"


def test_a_method_that_names_another_kind_is_refused_by_name(bundle):
    target = HFTarget.from_pretrained(bundle.target)
    with pytest.raises(DraftMismatch, match=r"holds an EAGLE-3 head \(method 'eagle3'\), not what method 'eagle' loads"):
        load_draft(bundle.drafts["eagle3"], target, "eagle")


def test_an_unknown_layout_asks_for_the_method(bundle, tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"hidden_size": 32, "vocab_size": 96}))
    import torch
    from safetensors.torch import save_file

    save_file({"weird.weight": torch.zeros(2, 2)}, str(odd / "model.safetensors"))
    assert draft_kind(odd) is None
    with pytest.raises(DraftMismatch, match="cannot tell which kind of draft"):
        load_draft(odd, HFTarget.from_pretrained(bundle.target))
    with pytest.raises(InvalidConfig, match=r"pass spec=SpecConfig\(method=\.\.\.\)"):
        Engine.from_pretrained(bundle.target, odd)


@pytest.mark.parametrize("kind", ["eagle3", "standalone"])
def test_engine_from_pretrained_picks_the_method_the_draft_holds(bundle, kind):
    draft = bundle.drafts["self" if kind == "standalone" else kind]
    engine = Engine.from_pretrained(bundle.target, draft, kv_pool_tokens=2048, dtype="float32")
    assert engine.spec == SpecConfig(method=kind)
    with pytest.raises(DraftMismatch, match="not what method 'mtp' loads"):
        Engine.from_pretrained(bundle.target, draft, spec=SpecConfig(method="mtp"), kv_pool_tokens=2048)
