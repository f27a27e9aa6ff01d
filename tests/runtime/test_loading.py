"""Strict checkpoint loading: every failure raises a named error with an informative message."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from phasegraph.runtime.errors import (
    CheckpointFileError,
    CheckpointMismatch,
    DraftMismatch,
    UnsupportedModel,
)
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

EAGLE3_KEYS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(
        f"midlayer.{n}.weight"
        for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")
    ),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_hf_target(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def eagle3_target(target_dir):
    return HFTarget.from_pretrained(target_dir, feature_mode="eagle3")


def edit_safetensors(path, edit):
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def test_written_eagle3_checkpoint_has_the_public_layout(tmp_path, target_dir):
    d = write_eagle3_draft(tmp_path / "e3", target_dir, draft_vocab_size=40)
    state = load_file(str(d / "model.safetensors"))
    assert set(state) == EAGLE3_KEYS
    assert state["fc.weight"].shape == (64, 3 * 64)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert state["lm_head.weight"].shape == (40, 64)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    config = json.loads((d / "config.json").read_text())
    assert config["draft_vocab_size"] == 40 and config["num_hidden_layers"] == 1
    full = write_eagle3_draft(tmp_path / "full", target_dir)
    assert set(load_file(str(full / "model.safetensors"))) == EAGLE3_KEYS - {"d2t", "t2d"}


def test_missing_key_is_named(tmp_path, target_dir, eagle3_target):
    d = write_eagle3_draft(tmp_path / "e3", target_dir)
    edit_safetensors(d / "model.safetensors", lambda s: s.pop("midlayer.mlp.up_proj.weight"))
    with pytest.raises(CheckpointMismatch, match=r"missing keys \(1\): midlayer\.mlp\.up_proj"):
        Eagle3Draft.from_pretrained(d, eagle3_target)


def test_missing_d2t_with_a_reduced_vocab_is_a_missing_key(tmp_path, target_dir, eagle3_target):
    d = write_eagle3_draft(tmp_path / "e3", target_dir, draft_vocab_size=40)
    edit_safetensors(d / "model.safetensors", lambda s: s.pop("d2t"))
    with pytest.raises(CheckpointMismatch, match="missing keys.*d2t") as info:
        Eagle3Draft.from_pretrained(d, eagle3_target)
    assert info.value.missing == ["d2t"]


def test_wrong_shape_is_named_with_both_shapes(tmp_path, target_dir, eagle3_target):
    d = write_eagle3_draft(tmp_path / "e3", target_dir)

    def edit(s):
        s["fc.weight"] = torch.zeros(64, 2 * 64)

    edit_safetensors(d / "model.safetensors", edit)
    with pytest.raises(
        CheckpointMismatch,
        match=r"shape mismatch for fc.weight: checkpoint \[64, 128\], model \[64, 192\]",
    ):
        Eagle3Draft.from_pretrained(d, eagle3_target)


def test_unexpected_key_in_target_is_named(tmp_path):
    d = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=2)
    edit_safetensors(d / "model.safetensors", lambda s: s.update(extra_head=torch.zeros(3)))
    with pytest.raises(CheckpointMismatch, match=r"unexpected keys \(1\): extra_head"):
        HFTarget.from_pretrained(d)


def test_untied_target_needs_its_lm_head_and_tied_target_does_not(tmp_path):
    d = write_hf_target(tmp_path / "untied", "qwen2", num_hidden_layers=2)
    edit_safetensors(d / "model.safetensors", lambda s: s.pop("lm_head.weight"))
    with pytest.raises(CheckpointMismatch, match="missing keys.*lm_head.weight"):
        HFTarget.from_pretrained(d)
    tied = write_hf_target(
        tmp_path / "tied", "qwen2", num_hidden_layers=2, tie_word_embeddings=True
    )
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))
    t = HFTarget.from_pretrained(tied)
    assert t.lm_head.weight is t.embed_tokens.weight


def test_ignorable_rotary_buffers_are_accepted(tmp_path):
    """Old checkpoints carry each layer's rotary inv_freq buffer: it loads, and is ignored (a
    bogus one would change every logit if it were copied into the model)."""
    plain = write_hf_target(tmp_path / "plain", "llama", num_hidden_layers=2)
    d = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=2)
    edit_safetensors(
        d / "model.safetensors",
        lambda s: s.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}),
    )
    def tensors(target):
        return dict(target.model.named_parameters()) | dict(target.model.named_buffers())

    want, got = tensors(HFTarget.from_pretrained(plain)), tensors(HFTarget.from_pretrained(d))
    assert got.keys() == want.keys() and any("inv_freq" in k for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_truncated_safetensors_names_the_file(tmp_path):
    d = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=2)
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors.*truncated or corrupt"):
        HFTarget.from_pretrained(d)


def test_corrupt_shard_and_missing_shard(tmp_path):
    d = write_hf_target(tmp_path / "t", "mistral", num_hidden_layers=2, shards=3)
    shard = d / "model-00002-of-00003.safetensors"
    shard.write_bytes(b"\x00" * 5)
    with pytest.raises(CheckpointFileError, match="model-00002-of-00003"):
        HFTarget.from_pretrained(d)
    shard.unlink()
    with pytest.raises(
        CheckpointFileError, match="model-00002-of-00003.safetensors: file not found"
    ):
        HFTarget.from_pretrained(d)


def test_index_pointing_at_the_wrong_shard(tmp_path):
    d = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=2, shards=2)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = "model.norm.weight"
    other = sorted(set(index["weight_map"].values()) - {index["weight_map"][key]})[0]
    index["weight_map"][key] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointFileError, match="lists 'model.norm.weight' in"):
        HFTarget.from_pretrained(d)


def test_corrupt_bin_and_missing_files(tmp_path, target_dir):
    target = HFTarget.from_pretrained(target_dir, feature_mode="last")
    d = write_eagle1_draft(tmp_path / "e1", target_dir, fmt="bin")
    (d / "pytorch_model.bin").write_bytes(b"not a zip file")
    with pytest.raises(CheckpointFileError, match="pytorch_model.bin.*truncated or corrupt"):
        Eagle1Draft.from_pretrained(d, target)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointFileError, match="no checkpoint file found"):
        Eagle1Draft.from_pretrained(d, target)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointFileError, match="config.json not found"):
        Eagle1Draft.from_pretrained(d, target)


def test_draft_with_wrong_hidden_size(tmp_path, target_dir, eagle3_target):
    d = write_eagle3_draft(tmp_path / "e3", target_dir, hidden_size=32, intermediate_size=64)
    with pytest.raises(DraftMismatch, match="draft hidden_size 32 != target hidden_size 64"):
        Eagle3Draft.from_pretrained(d, eagle3_target)
    target = HFTarget.from_pretrained(target_dir, feature_mode="last")
    d = write_mtp_draft(tmp_path / "mtp", target_dir, hidden_size=32, intermediate_size=64)
    with pytest.raises(DraftMismatch, match="hidden_size 32"):
        MTPDraft.from_pretrained(d, target)


def test_draft_with_wrong_vocab(tmp_path, target_dir):
    target = HFTarget.from_pretrained(target_dir, feature_mode="last")
    d = write_eagle1_draft(tmp_path / "e1", target_dir, vocab_size=100)
    with pytest.raises(DraftMismatch, match="vocab_size 100 != target vocab_size 128"):
        Eagle1Draft.from_pretrained(d, target)
    sa = write_standalone_draft(tmp_path / "sa", target_dir, vocab_size=100)
    with pytest.raises(DraftMismatch, match="vocab_size 100 != target vocab_size 128"):
        StandaloneDraft.from_pretrained(sa, target)


def test_eagle3_against_a_target_without_eagle3_features(tmp_path, target_dir):
    target = HFTarget.from_pretrained(target_dir, feature_mode="last")
    d = write_eagle3_draft(tmp_path / "e3", target_dir)
    with pytest.raises(DraftMismatch, match=r"features of width 192.*provides 64.*'last'"):
        Eagle3Draft.from_pretrained(d, target)


def test_d2t_outside_the_target_vocab(tmp_path, target_dir, eagle3_target):
    d = write_eagle3_draft(tmp_path / "e3", target_dir, draft_vocab_size=40)

    def edit(s):
        s["d2t"][5] = 1000

    edit_safetensors(d / "model.safetensors", edit)
    with pytest.raises(DraftMismatch, match=r"d2t maps draft ids \[5\] outside"):
        Eagle3Draft.from_pretrained(d, eagle3_target)


def test_unsupported_model_type(tmp_path):
    d = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=2)
    config = json.loads((d / "config.json").read_text())
    config["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2' is not supported"):
        HFTarget.from_pretrained(d)


def test_load_in_bfloat16(tmp_path, target_dir):
    t = HFTarget.from_pretrained(target_dir, dtype="bfloat16", feature_mode="eagle3")
    assert t.dtype == torch.bfloat16 and t.kv_spec.dtype == torch.bfloat16
    assert t.model.model.rotary_emb.inv_freq.dtype == torch.float32
    d = Eagle3Draft.from_pretrained(
        write_eagle3_draft(tmp_path / "e3", target_dir, draft_vocab_size=40), t
    )
    assert d.dtype == torch.bfloat16 and d.d2t.dtype == torch.int64
    assert d.rotary.inv_freq.dtype == torch.float32


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_path_that_is_no_checkpoint_directory_says_what_it_is(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, why in [(afile, "it is a file, not a checkpoint directory"),
                      (tmp_path / "nowhere", "the directory does not exist"),
                      (tmp_path, "the directory holds no config.json")]:
        with pytest.raises(CheckpointFileError, match=f"config.json not found \\({path}: {why}\\)"):
            HFTarget.from_pretrained(path)


def test_config_json_that_is_no_object(tmp_path, target_dir):
    import shutil

    d = shutil.copytree(target_dir, tmp_path / "t")
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointFileError, match="config.json must hold a JSON object; got a list"):
        HFTarget.from_pretrained(d)


# sizes transformers would build a model from (or fail on deep inside torch: a ZeroDivisionError,
# a negative tensor dimension) and configs transformers itself rejects (a KeyError, its own
# validator exceptions): each is a CheckpointFileError naming config.json
BAD_CONFIGS = {
    "heads-zero": (dict(num_attention_heads=0), "num_attention_heads must be an integer >= 1; got 0"),
    "vocab-negative": (dict(vocab_size=-1), "vocab_size must be an integer >= 1; got -1"),
    "hidden-string": (dict(hidden_size="abc"), "hidden_size must be an integer >= 1; got 'abc'"),
    "context-zero": (dict(max_position_embeddings=0), "max_position_embeddings must be an integer >= 1"),
    "heads-do-not-divide": (dict(num_attention_heads=3, head_dim=None),
                            "transformers cannot build a model from this config"),
    "unknown-rope": (dict(rope_scaling={"rope_type": "bogus", "factor": 2.0}, rope_parameters=None),
                     "transformers cannot build a model from this config \\(KeyError: 'bogus'\\)"),
    # was: KeyError: 'gelu_bogus' from transformers/activations.py while the model was built
    "unknown-activation": (dict(hidden_act="gelu_bogus"),
                           "hidden_act 'gelu_bogus' is not an activation transformers knows"),
    # was: every norm NaN, every greedy pick token 0, silently
    "eps-negative": (dict(rms_norm_eps=-1), "rms_norm_eps must be a number > 0; got -1"),
    "eps-zero": (dict(rms_norm_eps=0.0), "rms_norm_eps must be a number > 0; got 0.0"),
    "eps-string": (dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a number > 0; got '1e-5'"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_values_name_the_file(tmp_path, target_dir, eagle3_target, case):
    import shutil

    changes, message = BAD_CONFIGS[case]
    t = _edit_config(shutil.copytree(target_dir, tmp_path / "t"), **changes)
    with pytest.raises(CheckpointFileError, match=f"{t / 'config.json'}: {message}"):
        HFTarget.from_pretrained(t)
    d = _edit_config(write_eagle3_draft(tmp_path / "e3", target_dir), **changes)
    with pytest.raises(CheckpointFileError, match=f"{d / 'config.json'}: {message}"):
        Eagle3Draft.from_pretrained(d, eagle3_target)


def test_an_mtp_draft_without_layers_is_a_config_error(tmp_path, target_dir):
    target = HFTarget.from_pretrained(target_dir, feature_mode="last")
    d = _edit_config(write_mtp_draft(tmp_path / "mtp", target_dir), num_hidden_layers=0)
    with pytest.raises(CheckpointFileError, match="num_hidden_layers must be an integer >= 1; got 0"):
        MTPDraft.from_pretrained(d, target)


@pytest.mark.parametrize(("weight_map", "why"), [
    ("x", "weight_map must map tensor names to shard file names; got 'x'"),
    ({"model.norm.weight": 3}, "weight_map must map tensor names to shard file names"),
])
def test_a_shard_index_of_the_wrong_shape_names_the_index(tmp_path, weight_map, why):
    # was: AttributeError: 'str' object has no attribute 'values' (or a TypeError) from the loader
    d = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=2, shards=2)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointFileError, match=f"model.safetensors.index.json: cannot parse the shard index \\({why}"):
        HFTarget.from_pretrained(d)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_weight_holding_nan_or_inf_is_refused(tmp_path, target_dir, bad):
    import shutil

    d = shutil.copytree(target_dir, tmp_path / "t")
    edit_safetensors(d / "model.safetensors", lambda state: state["model.norm.weight"].__setitem__(3, bad))
    with pytest.raises(CheckpointFileError, match="'model.norm.weight' holds 1 NaN or infinite values"):
        HFTarget.from_pretrained(d)


def test_a_weight_that_overflows_the_asked_dtype_is_refused(tmp_path, target_dir):
    import shutil

    d = shutil.copytree(target_dir, tmp_path / "t")
    edit_safetensors(d / "model.safetensors", lambda state: state["model.norm.weight"].__setitem__(0, 1e6))
    HFTarget.from_pretrained(d)  # float32 holds it
    with pytest.raises(CheckpointFileError, match=r"holds 1 NaN or infinite values \(as loaded in torch.float16\)"):
        HFTarget.from_pretrained(d, dtype=torch.float16)


@pytest.mark.parametrize(("fields", "layers"), [
    ({}, (2, 4, 5)),  # the default (2, L//2, L-3) at L = 8
    ({"eagle_aux_layers": [1, 3, 6]}, (1, 3, 6)),  # phasegraph's trainer: captured inputs
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}}, (1, 3, 6)),  # outputs of
    ({"eagle_aux_layers": [1, 3, 6], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}}, (1, 3, 6)),
])
def test_an_eagle3_head_gets_the_target_layers_it_declares(tmp_path, fields, layers):
    # was: the declared layers silently ignored (the target always captured (2, L//2, L-3))
    deep = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=8)
    target = HFTarget.from_pretrained(deep, feature_mode="eagle3")
    d = _edit_config(write_eagle3_draft(tmp_path / "e3", deep), **fields)
    Eagle3Draft.from_pretrained(d, target)
    assert target.feature_layers == layers


@pytest.mark.parametrize(("fields", "message"), [
    ({"eagle_aux_layers": [1, 3, 8]}, r"eagle_aux_layers asks for the inputs of target layers \[1, 3, 8\], but the "
                                      r"target has layers 0..7"),
    ({"eagle_aux_layers": [1, 3]}, "eagle_aux_layers must list three target layer indices; got \\[1, 3\\]"),
    ({"eagle_aux_layers": [1, 3, 6], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}},
     "declares two different sets of target layers"),
])
def test_an_eagle3_head_declaring_impossible_layers_is_refused(tmp_path, fields, message):
    deep = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=8)
    target = HFTarget.from_pretrained(deep, feature_mode="eagle3")
    d = _edit_config(write_eagle3_draft(tmp_path / "e3", deep), **fields)
    with pytest.raises(DraftMismatch, match=message):
        Eagle3Draft.from_pretrained(d, target)
    assert target.feature_layers == (2, 4, 5)  # unchanged


class _Rank:
    """What a tensor-parallel group tells the split: this rank, of how many, on which device."""

    def __init__(self, rank: int, world_size: int = 2) -> None:
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")


def _split_dir(tmp_path, arch, tied=False):
    values = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                  intermediate_size=128, tie_word_embeddings=tied)
    if arch == "qwen3":
        values["head_dim"] = 16
    return write_hf_target(tmp_path / arch, arch, shards=2, **values)


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_a_target_read_layer_by_layer_equals_the_whole_one_sliced(tmp_path, arch, tied):
    """Each rank's slices, its replicated embedding, norms, lm_head and rotary tables equal those
    of the whole model loaded and then sliced (biases of qwen2, per-head norms of qwen3, ties)."""
    import attrs

    from phasegraph.runtime.models.fused_decoder import FusedLayer, shard_target

    d = _split_dir(tmp_path, arch, tied)
    for rank in (0, 1):
        whole = HFTarget.from_pretrained(d, feature_mode="eagle3")
        shard_target(whole, _Rank(rank))
        split = HFTarget.from_pretrained_split(d, torch.float32, _Rank(rank), feature_mode="eagle3")
        assert len(split.fused_layers) == 3 and split.tp is not None
        for a, b in zip(whole.fused_layers, split.fused_layers, strict=True):
            for field in attrs.fields(FusedLayer):
                x, y = getattr(a, field.name), getattr(b, field.name)
                if isinstance(x, torch.nn.Module):
                    x, y = x.weight, y.weight
                if isinstance(x, torch.Tensor):
                    assert torch.equal(x, y), f"rank {rank}: {field.name} differs"
                else:
                    assert x == y, f"rank {rank}: {field.name} {x} != {y}"
        want, got = whole.model.state_dict(), split.model.state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)
        assert torch.equal(whole.model.model.rotary_emb.inv_freq, split.model.model.rotary_emb.inv_freq)
        assert all(p.device.type == "cpu" for p in split.model.parameters())
        assert (split.model.lm_head.weight is split.model.model.embed_tokens.weight) == tied


def test_a_split_target_holds_one_whole_layer_at_a_time(tmp_path, monkeypatch):
    """No rank holds the whole model: a layer's full weights are gone before the next is read."""
    import weakref

    from phasegraph.runtime.models import target as target_module

    d = _split_dir(tmp_path, "llama")
    alive, real = [], target_module.fuse_layer

    def fuse_counting(layer, config):
        alive[:] = [ref for ref in alive if ref() is not None]
        assert not alive, "the previous whole layer is still in memory"
        fused = real(layer, config)
        alive.extend(weakref.ref(t) for t in (fused.qkv_weight, fused.o_weight, fused.gate_up_weight,
                                              fused.down_weight))
        return fused

    monkeypatch.setattr(target_module, "fuse_layer", fuse_counting)
    split = HFTarget.from_pretrained_split(d, torch.float32, _Rank(1))
    assert len(split.fused_layers) == 3
    assert split.fused_layers[0].qkv_weight.shape == (2 * 16 + 2 * 16, 64)  # 2 query heads, 1 kv head


def test_a_split_target_checks_keys_and_values_as_the_whole_one(tmp_path):
    import shutil

    d = _split_dir(tmp_path, "llama")
    bad = shutil.copytree(d, tmp_path / "nan")
    shard = next(p for p in bad.glob("*.safetensors") if "model.layers.2.mlp.down_proj.weight" in load_file(str(p)))
    edit_safetensors(shard, lambda s: s["model.layers.2.mlp.down_proj.weight"].__setitem__((0, 0), float("nan")))
    with pytest.raises(CheckpointFileError, match="'model.layers.2.mlp.down_proj.weight' holds 1 NaN"):
        HFTarget.from_pretrained_split(bad, torch.float32, _Rank(0))
    wrong = write_hf_target(tmp_path / "wide", "llama", num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, hidden_size=64, intermediate_size=96)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    with pytest.raises(CheckpointMismatch, match="down_proj"):
        HFTarget.from_pretrained_split(wrong, torch.float32, _Rank(0))


def test_loading_shows_progress_only_when_asked(tmp_path, capsys):
    d = _split_dir(tmp_path, "llama")
    HFTarget.from_pretrained(d)
    HFTarget.from_pretrained_split(d, torch.float32, _Rank(0))
    assert capsys.readouterr().err == ""
    HFTarget.from_pretrained(d, progress=True)
    err = capsys.readouterr().err
    n = len(load_file(str(d / "model-00001-of-00002.safetensors"))) + len(load_file(str(d / "model-00002-of-00002.safetensors")))
    assert "loading llama" in err and f"{n}/{n}" in err and "tensor" in err
    HFTarget.from_pretrained_split(d, torch.float32, _Rank(0), progress=True)
    err = capsys.readouterr().err
    assert "loading llama" in err and "3/3" in err and "layer" in err


def test_a_layer_computing_buffers_of_its_own_is_not_read_layer_by_layer(tmp_path):
    """A buffer that is not in the checkpoint would be left as to_empty made it: refused by name."""
    from phasegraph.runtime.models.target import load_split_causal_lm, read_layer

    model, checkpoint = load_split_causal_lm(_split_dir(tmp_path, "llama"), torch.float32, torch.device("cpu"))
    assert read_layer(model, checkpoint, 1).self_attn.q_proj.weight.device.type == "cpu"
    model.model.layers[1].register_buffer("table", torch.ones(4, device="meta"), persistent=False)
    with pytest.raises(UnsupportedModel, match="decoder layer 1 computes buffers of its own \\(table\\)"):
        read_layer(model, checkpoint, 1)
