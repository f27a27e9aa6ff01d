"""What ``python -m phasegraph.train`` does with bad input, failures and interrupts: one error
line and exit status 2 before anything is written, and never a directory that looks like a
complete pair (``phasegraph bench``'s ``has_pair``) unless the run finished."""

from __future__ import annotations

import json

import pytest
import torch

from phasegraph.bench.common import has_pair
from phasegraph.cli.train import main
from phasegraph.train import recipe
from phasegraph.train.presets import PRESETS, TrainInputError, apply_overrides, check_preset
from phasegraph.train.recipe import STAGING, run_recipe

# a ~1 s run of the tiny preset
SMALL = [
    "corpus.max_train_bytes=250000", "corpus.max_valid_bytes=30000",
    "corpus.max_heldout_bytes=40000", "target_train.steps=4", "target_train.eval_every=2",
    "head_train.steps=3", "head_train.eval_every=2", "head.selfgen_seqs=4",
    "head.selfgen_batch=2", "eval.max_prompts=2", "eval.gen_tokens=10",
]
SMALL_ARGS = [a for item in SMALL for a in ("--set", item)]


def _usage_error(capsys, argv) -> str:
    """The one error line of ``main(argv)``, which must exit with status 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _run(out, *overrides, **kw):
    preset = apply_overrides(PRESETS["tiny"], [*SMALL, *overrides])
    return run_recipe(preset, out, device="cpu", progress=False, log=lambda s: None, **kw)


def test_every_preset_passes_its_own_checks():
    for preset in PRESETS.values():
        check_preset(preset)


@pytest.mark.parametrize(("item", "message"), [
    ("foo=1", "unknown preset field 'foo' (top-level fields: name, vocab_size,"),
    ("target_train.nope=1", "unknown preset field 'target_train.nope' (target_train has: steps,"),
    ("a.b=1", "unknown preset field 'a.b' (sections: target,"),
    ("__class__=1", "unknown preset field '__class__'"),
    ("target_train.steps", "override 'target_train.steps' is not of the form key=value"),
    ("=1", "override '=1' has no key"),
    ("target=1", "override 'target=1': target is a section, not a value"),
    ("draft=3", "override 'draft=3': draft is a section, not a value"),
    ("draft.hidden_size=64", "preset 'tiny' has no draft"),
    ("target_train.steps=none", "override 'target_train.steps=none': expected an integer, got 'none'"),
    ("head.num_heads=abc", "override 'head.num_heads=abc': expected an integer or none, got 'abc'"),
    ("head.num_heads=2.5", "expected an integer or none, got '2.5'"),
    ("target_train.batch_size=99999999999999999999", "batch_size must be less than 2**63"),
    ("eval.loss_windows=0", "loss_windows must be greater than 0"),
    ("eval.prompt_max_lines=0", "prompt_max_lines must be greater than 0"),
    ("name=", "override 'name=': expected text, got ''"),
    ("save_dtype=int8", "save_dtype must be one of bfloat16, float16, float32, not 'int8'"),
    ("head.ttt_tokens=bogus", "head.ttt_tokens must be one of data, greedy, not 'bogus'"),
    ("vocab_size=100", "vocab_size 100 must be at least 257"),
    ("target.num_kv_heads=3", "target.num_heads 2 must be a multiple of target.num_kv_heads 3"),
    ("target.hidden_size=65", "target.hidden_size 65 must be a multiple of target.num_heads 2"),
    ("target.head_dim=31", "target.head_dim 31 must be even"),
    ("head.num_kv_heads=3", "attention heads (head.num_heads, else target.num_heads) must be a "
                            "multiple of its 3 KV heads"),
    ("head.draft_vocab_size=600", "head.draft_vocab_size 600 must be at most vocab_size 512"),
    ("head.unroll=200", "head.unroll 200 must be at most head_train.seq_len 127"),
    ("head.selfgen_fraction=3", "head.selfgen_fraction 3.0 must be at most 1"),
    ("target_train.seq_len=300", "target_train.seq_len 300 must be at most target.context 128"),
    ("target.context=64", "head_train.seq_len 127 must be below target.context 64"),
    ("target_train.beta2=1", "target_train.beta2 1.0 must be below 1"),
    ("head_train.min_lr_ratio=2", "head_train.min_lr_ratio 2.0 must be at most 1"),
    ("eval.gen_tokens=200", "eval.gen_tokens 200 must be at most target.context - 2 (126)"),
    ("eval.chain_steps=30", "eval.chain_steps 30 must be below eval.gen_tokens 24"),
    ("eval.tree_nodes=100", "eval.tree_nodes 100 must be between 2 and 11"),
    ("eval.tree_topk=600", "eval.tree_topk 600 must be at most the draft vocabulary (512)"),
])
def test_a_bad_override_is_one_error_line(capsys, item, message):
    """Each of these was a traceback (at parsing, or deep inside a run after the target had
    trained), NaN weights (head.unroll past the window), or silently wrong (save_dtype=int8,
    steps=none, prompts cut by a negative length): now exit 2 with the field named."""
    with pytest.raises(TrainInputError, match=None) as raised:
        apply_overrides(PRESETS["tiny"], [item])
    assert message in str(raised.value)
    assert isinstance(raised.value, ValueError)  # what phasegraph bench --train-set catches
    assert message in _usage_error(capsys, ["tiny", "--plan", "--set", item])


def test_overrides_that_stay_allowed():
    tiny, bench = PRESETS["tiny"], PRESETS["bench-pair"]
    assert apply_overrides(tiny, ["head.num_heads=none"]).head.num_heads is None
    assert apply_overrides(tiny, ["eval.max_prompts=0", "eval.gen_tokens=500"]).eval.gen_tokens == 500
    assert apply_overrides(bench, ["draft=none", "draft_train=none"]).draft is None
    with pytest.raises(TrainInputError, match="draft and draft_train must both be set or both be none"):
        apply_overrides(bench, ["draft=none"])
    with pytest.raises(TrainInputError, match="draft.hidden_size 100 must be a multiple of draft.num_heads 8"):
        apply_overrides(bench, ["draft.hidden_size=100"])


@pytest.mark.parametrize(("args", "message"), [
    (["--out", ""], "--out needs a directory name, got an empty one"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--threads", "-1"], "--threads must be at least 1, got -1"),
    (["--time-budget-s", "nan"], "--time-budget-s must be a positive number of seconds, got nan"),
    (["--time-budget-s", "0"], "--time-budget-s must be a positive number of seconds, got 0.0"),
    (["--time-budget-s", "-3"], "--time-budget-s must be a positive number of seconds, got -3.0"),
    (["--time-budget-s", "inf"], "--time-budget-s must be a positive number of seconds, got inf"),
    (["--seed", str(10**20)], f"--seed must be between {recipe.MIN_SEED} and {recipe.MAX_SEED}"),
    (["--seed", str(-(10**19))], "--seed must be between"),
])
def test_a_bad_run_option_is_one_error_line_and_writes_nothing(tmp_path, capsys, monkeypatch,
                                                               args, message):
    """--threads -1 and a huge --seed were tracebacks (torch), --threads 0 was ignored, and a
    time budget of 0, a negative one or nan trained nothing and saved an untrained pair."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    argv = ["tiny", "--out", str(out), *args] if "--out" not in args else ["tiny", *args]
    assert message in _usage_error(capsys, argv)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_device_cuda_without_a_gpu(tmp_path, capsys):
    """Was an AssertionError from torch after --out had been created."""
    line = _usage_error(capsys, ["tiny", "--out", str(tmp_path / "out"), "--device", "cuda"])
    assert "--device cuda: no CUDA GPU is available" in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(TrainInputError, match="device cuda: no CUDA GPU is available"):
        run_recipe(PRESETS["tiny"], tmp_path / "out", device="cuda")


def test_an_out_directory_that_cannot_be_made(tmp_path, capsys):
    """A path below a file was a NotADirectoryError traceback from mkdir."""
    (tmp_path / "file").write_text("x")
    line = _usage_error(capsys, ["tiny", "--out", str(tmp_path / "file" / "sub")])
    assert f"{tmp_path / 'file' / 'sub'}: cannot create or write the directory (Not a directory)" in line
    line = _usage_error(capsys, ["tiny", "--out", str(tmp_path / "file")])
    assert f"{tmp_path / 'file'} is a file, not a directory" in line


def test_a_corpus_too_small_for_a_window_is_named(tmp_path, capsys):
    """Was a ValueError from the window sampler ("stream of 48 tokens is too short for 129");
    the directory the run made is removed again."""
    with pytest.raises(TrainInputError, match=r"corpus.max_train_bytes=100 leaves \d+ train tokens, "
                       r"fewer than one 129-token window \(target_train.seq_len \+ 1\)"):
        _run(tmp_path / "out", "corpus.max_train_bytes=100")
    assert not (tmp_path / "out").exists()
    line = _usage_error(capsys, ["tiny", "--out", str(tmp_path / "out"), *SMALL_ARGS,
                                 "--set", "corpus.max_valid_bytes=10"])
    assert "corpus.max_valid_bytes=10 leaves" in line
    assert not (tmp_path / "out").exists()


def test_a_vocabulary_the_tokenizer_did_not_reach_is_named(tmp_path):
    """vocab_size is what the tokenizer may reach; a head vocabulary above what it did reach
    was a tensor-size RuntimeError when the head was built, after the target had trained."""
    with pytest.raises(TrainInputError, match=r"head.draft_vocab_size 40000 must be at most the "
                       r"\d+ tokens the tokenizer reached \(vocab_size 50000\)"):
        _run(tmp_path / "out", "vocab_size=50000", "head.draft_vocab_size=40000")
    assert not (tmp_path / "out").exists()


def test_a_small_run_from_the_cli(tmp_path, capsys):
    """--no-progress also silences transformers' "Writing model shards" bar."""
    assert main(["tiny", "--out", str(tmp_path / "out"), "--no-progress", *SMALL_ARGS]) == 0
    assert "Writing model shards" not in capsys.readouterr().err
    assert has_pair(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eagle3", "target", "train_report.json"]


def _fail_after_saving(monkeypatch, exc):
    """Makes the simulated decode (which runs after the files are saved) raise ``exc``."""
    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(recipe, "_acceptance", boom)


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failed_run_leaves_no_pair(tmp_path, monkeypatch, exc):
    """A run that failed or was interrupted after saving target/ and eagle3/ (in the simulated
    decode) used to leave them in place: a directory that phasegraph bench took for a complete
    pair, with no train_report.json. Now nothing is left, not even the directory it made."""
    _fail_after_saving(monkeypatch, exc)
    with pytest.raises(type(exc)):
        _run(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_interrupted_cli_run_exits_130(tmp_path, monkeypatch, capsys):
    _fail_after_saving(monkeypatch, KeyboardInterrupt())
    out = tmp_path / "out"
    out.mkdir()
    assert main(["tiny", "--out", str(out), "--no-progress", *SMALL_ARGS]) == 130
    assert f"interrupted (no new pair in {out})" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_a_failed_overwrite_keeps_the_previous_pair(tmp_path, monkeypatch):
    """With overwrite, the new files replace the old ones only once the run has finished."""
    out = tmp_path / "out"
    _run(out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _fail_after_saving(monkeypatch, RuntimeError("boom"))
    with pytest.raises(RuntimeError):
        _run(out, "target_train.steps=5", overwrite=True)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before


def test_overwrite_replaces_the_previous_outputs_whole(tmp_path):
    """An overwrite used to write into the old target/ and eagle3/ and keep a previous
    bench-pair run's draft/ (another target's draft, that bench would load with the new pair);
    a killed run's staging directory does not make a directory non-empty."""
    out = tmp_path / "out"
    for sub in ("target", "eagle3", "draft"):
        (out / sub).mkdir(parents=True)
        (out / sub / "config.json").write_text("{}")
        (out / sub / "old.bin").write_text("old")
    (out / "notes.txt").write_text("mine")
    report = _run(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["eagle3", "notes.txt", "target", "train_report.json"]
    assert not (out / "target" / "old.bin").exists() and not (out / "eagle3" / "old.bin").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "train_report.json").read_text())["files"] == report["files"]

    fresh = tmp_path / "fresh"
    (fresh / STAGING / "target").mkdir(parents=True)  # left by a run killed while saving
    _run(fresh)
    assert sorted(p.name for p in fresh.iterdir()) == ["eagle3", "target", "train_report.json"]


@pytest.mark.parametrize("exc", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 103200000000 bytes"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 GiB"),
], ids=["cpu", "cuda"])
def test_sizes_too_large_for_memory_end_in_one_error_line(tmp_path, monkeypatch, capsys, exc):
    """``--set target_train.batch_size=100000000`` used to end in the allocator's traceback."""
    _fail_after_saving(monkeypatch, exc)
    out = tmp_path / "out"
    assert main(["tiny", "--out", str(out), "--no-progress", *SMALL_ARGS]) == 1
    err = capsys.readouterr().err
    assert f"error: out of memory ({str(exc).splitlines()[0]})" in err
    assert "lower a batch_size or seq_len with --set" in err and "Traceback" not in err
    assert not out.exists()


def test_other_runtime_errors_are_not_taken_for_out_of_memory(tmp_path, monkeypatch):
    _fail_after_saving(monkeypatch, RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        main(["tiny", "--out", str(tmp_path / "out"), "--no-progress", *SMALL_ARGS])
