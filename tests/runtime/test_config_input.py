"""SpecConfig's bounds, SamplingParams' int64 fields and ``phasegraph generate``'s draft options:
refused up front with a named error, never a torch overflow or a silently ignored option."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

import phasegraph
from phasegraph.cli import main
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.errors import InvalidConfig, InvalidRequest

DEMO = Path(phasegraph.__file__).parent / "data" / "demo_pair"
HUGE = 10**30


@pytest.mark.parametrize(("kw", "message"), [
    # was: a torch C++ error / OverflowError from the first draft step
    (dict(num_steps=HUGE), f"SpecConfig.num_steps must be an integer in [1, 64]; got {HUGE}"),
    (dict(num_steps=65), "SpecConfig.num_steps must be an integer in [1, 64]; got 65"),
    (dict(topk=HUGE), f"SpecConfig.topk must be an integer in [1, 128]; got {HUGE}"),
    (dict(topk=129, num_steps=1), "SpecConfig.topk must be an integer in [1, 128]; got 129"),
    (dict(topk=True), "SpecConfig.topk must be an integer in [1, 128]; got True"),
    (dict(num_draft_tokens=HUGE), f"SpecConfig.num_draft_tokens must be at most 1024; got {HUGE}"),
    (dict(topk=128, num_steps=3),
     "SpecConfig: topk=128, num_steps=3 drafts 32896 candidates per request (K + (S-1)·K²); at most 32768"),
])
def test_spec_config_bounds(kw, message):
    with pytest.raises(InvalidConfig) as info:
        SpecConfig(method="eagle3", **kw)
    assert message in str(info.value)


def test_spec_config_bounds_keep_real_trees():
    assert SpecConfig(method="eagle3", num_steps=64).num_draft_tokens == 65  # the longest chain
    assert SpecConfig(method="eagle3", topk=128, num_steps=2, num_draft_tokens=1024).tree().num_candidates == 16512
    assert SpecConfig(method="eagle3", topk=32, num_steps=32, num_draft_tokens=64).topk == 32


def test_sampling_params_stop_token_ids_fit_int64():
    with pytest.raises(InvalidRequest, match=r"stop_token_ids must be non-negative integers below 2\*\*63"):
        SamplingParams(stop_token_ids=[2**63])
    assert SamplingParams(stop_token_ids=[2**63 - 1]).stop_token_ids == (2**63 - 1,)


def test_sampling_params_logprobs_and_logit_controls_are_normalised():
    assert SamplingParams(logprobs=0).logprobs is True  # the chosen token's only (vLLM's 0)
    assert SamplingParams(logprobs=None).wants_logprobs is False
    sp = SamplingParams(logprobs=20, prompt_logprobs=0, logit_bias={7: 1, 3: -2.5})
    assert (sp.wants_logprobs, sp.top_logprobs, sp.prompt_logprobs) == (True, 20, 0)
    assert sp.logit_bias == ((3, -2.5), (7, 1.0)) and sp.uses_penalties
    again = attrs.evolve(sp, seed=3)  # the stored pairs are taken as they are
    assert again.logit_bias == sp.logit_bias and hash(again) != hash(sp)
    assert SamplingParams(logit_bias={}).logit_bias is None and not SamplingParams(logit_bias={}).uses_penalties
    assert not SamplingParams(min_p=0.3).uses_penalties and SamplingParams(presence_penalty=-2).uses_penalties
    with pytest.raises(InvalidRequest, match="logit_bias names a token twice"):
        SamplingParams(logit_bias=((1, 0.5), (1, 0.25)))


@pytest.fixture
def no_engine(monkeypatch):
    """Refusals come before any model is loaded."""
    import phasegraph.runtime.engine as engine

    def no_run(*args, **kwargs):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(engine.Engine, "from_pretrained", no_run)


def _generate(capsys, *args: str) -> str:
    capsys.readouterr()
    rc = main(["generate", "--target", str(DEMO / "target"), "--prompt-ids", "1,2", "--no-progress", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("phasegraph: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("option", "message"), [
    ("--num-steps", f"--num-steps must be an integer in [1, 64]; got {HUGE}"),
    ("--topk", f"--topk must be an integer in [1, 128]; got {HUGE}"),
    ("--num-draft-tokens", f"--num-draft-tokens must be at most 1024; got {HUGE}"),
])
def test_generate_refuses_huge_tree_options(capsys, no_engine, option, message):
    err = _generate(capsys, "--method", "eagle3", "--draft", str(DEMO / "eagle3"), option, str(HUGE))
    assert message in err


@pytest.mark.parametrize(("args", "message"), [
    (["--draft-dtype", "bfloat16"],
     "--draft-dtype was given with --method none: pass a speculative --method or drop --draft-dtype"),
    (["--topk", "1"], "--topk was given with --method none"),  # its default value, but given
    (["--num-steps", "2", "--num-draft-tokens", "3"],
     "--num-steps, --num-draft-tokens were given with --method none: pass a speculative --method or drop "
     "--num-steps, --num-draft-tokens"),
    (["--method", "none", "--draft", str(DEMO / "eagle3")],
     "--draft was given with --method none: pass a speculative --method or drop --draft"),
    (["--draft", ""], "--draft needs a directory name, got an empty one"),
    (["--trace", ""], "--trace needs a file name, got an empty one"),
])
def test_generate_refuses_draft_options_without_a_draft(capsys, no_engine, args, message):
    """Draft options beside method none were silently ignored (only --draft was refused)."""
    assert message in _generate(capsys, *args)


def test_engine_options_are_one_checked_config():
    """Engine(target, config=EngineConfig(...)) and Engine(target, **options) are the same
    engine; a bad option is refused when the config is made, an unknown one by name."""
    from phasegraph import Engine, EngineConfig
    from phasegraph.runtime.errors import InvalidConfig
    from tests.phases.lossless_support import tiny_target

    config = EngineConfig(max_batch_size=3, kv_pool_tokens=512, page_size=4)
    engine = Engine(tiny_target(), config=config)
    assert engine.config == config and engine.page_size == 4 and engine.kv.page_size == 4
    evolved = Engine(tiny_target(), config=config, page_size=2)
    assert evolved.config.page_size == 2 and evolved.config.max_batch_size == 3
    with pytest.raises(InvalidConfig, match=r"page_size must be an integer in \[1, 65536\]; got 0"):
        EngineConfig(page_size=0)
    with pytest.raises(InvalidConfig, match="unknown option.*page_sise"):
        Engine(tiny_target(), page_sise=2)
    with pytest.raises(InvalidConfig, match="config must be an EngineConfig; got SpecConfig"):
        Engine(tiny_target(), None, SpecConfig(method="none"))


def test_a_cpu_engine_runs_on_one_thread_unless_told_otherwise():
    import torch

    from phasegraph import Engine
    from phasegraph.runtime.errors import InvalidConfig
    from tests.phases.lossless_support import tiny_target

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        Engine(tiny_target(), kv_pool_tokens=512)
        assert torch.get_num_threads() == 1
        Engine(tiny_target(), kv_pool_tokens=512, num_threads=2)
        assert torch.get_num_threads() == 2
        Engine(tiny_target(), kv_pool_tokens=512, num_threads=None)  # torch's setting stays
        assert torch.get_num_threads() == 2
        with pytest.raises(InvalidConfig, match=r"num_threads must be an integer in \[1, 1024\]"):
            Engine(tiny_target(), num_threads=0)
    finally:
        torch.set_num_threads(before)
