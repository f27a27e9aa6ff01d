"""min_p, logit bias and penalties stay lossless through tree speculation (issue 61, part 2).

The harness of test_tree_sampling.py (a Markov-chain target over V = 32 tokens, a sharpened
draft, 1e5 trials as the batch, Pearson chi-square and total variation per generated position)
with the per-request state of penalties: a prompt and output counts that hold the bonus token
and a few earlier outputs. Every node's distribution is made as verify makes it, from its own
ancestry (:func:`apply_penalties` with the tree), then min_p in ``target_probs``; after the
first step the counts advance by the emitted tokens as finalize-tree-path advances them, and a
second step runs. The emitted tokens at generated positions 0 and 1 must follow the exact
distribution, which a plain implementation here computes without any tree: position 0 from the
request's counts, position 1 given the first token ``a`` from the counts plus ``a``.

Three planted mutants must fail the same check: penalties from the request's counts alone
(without the node's path), counts not advanced after a step, and min_p measured against the
root's row instead of the node's own.
"""

from __future__ import annotations

import functools

import pytest
import torch

from phasegraph.kernels import target_probs
from phasegraph.kernels.penalties import apply_penalties, count_tokens
from tests.kernels.test_tree_sampling import (
    LOGP,
    ROOT,
    TRIALS,
    VOCAB,
    check_against,
    kernel_sampler,
    speculative_step,
)


@pytest.fixture
def one_thread():
    """~1e3 small ops on 1e5-row tensors: one thread is faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# the request before the first step: its bonus token ROOT and two earlier outputs, and a prompt
OUTPUT_SO_FAR = {ROOT: 1, 3: 2, 11: 1}
PROMPT_TOKENS = (5, 9, 11, 30)
BIAS = {7: 2.0, 12: -1.5, 30: 1.0}


def request_state() -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(VOCAB, dtype=torch.int32)
    for token, n in OUTPUT_SO_FAR.items():
        counts[token] = n
    prompt = torch.zeros(VOCAB, dtype=torch.bool)
    prompt[list(PROMPT_TOKENS)] = True
    return counts, prompt


# (topk, num_steps, num_nodes, temperature, top_p), (min_p, repetition, frequency, presence, bias)
CASES = {
    "chain_penalties": ((1, 3, 4, 1.0, 1.0), (0.0, 1.5, 1.0, 0.5, False)),
    "tree_k2_penalties_t0.7": ((2, 3, 6, 0.7, 1.0), (0.0, 1.3, 0.5, 1.0, False)),
    "tree_k4_penalties_bias_p0.9": ((4, 3, 8, 1.0, 0.9), (0.0, 2.0, 1.5, 0.0, True)),
    "tree_k2_min_p": ((2, 3, 6, 1.0, 1.0), (0.1, 1.0, 0.0, 0.0, False)),
    "tree_k4_min_p_t0.7": ((4, 3, 8, 0.7, 1.0), (0.05, 1.0, 0.0, 0.0, False)),
    "tree_k4_everything": ((4, 3, 8, 0.8, 0.95), (0.05, 1.3, 0.7, 0.4, True)),
}


def _bias(controls) -> torch.Tensor | None:
    if not controls[4]:
        return None
    bias = torch.zeros(VOCAB)
    for token, value in BIAS.items():
        bias[token] = value
    return bias


def plain_probs(logits, counts, prompt, cfg, controls):
    """The sampling distribution of rows with their own counts, written out without a tree
    ([R, V] each): bias, repetition over prompt and output, frequency, presence, then
    temperature / top-p / min_p."""
    min_p, rep, freq, pres, _ = controls
    bias = _bias(controls)
    x = logits.double() + (0.0 if bias is None else bias.double())
    c = counts.double()
    seen = prompt | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * c - pres * (c > 0).double()
    rows = x.shape[0]
    return target_probs(x.float(), torch.full((rows,), cfg[3]), torch.zeros(rows, dtype=torch.int64),
                        torch.full((rows,), cfg[4]), 1, torch.full((rows,), min_p)).double()


@functools.cache
def exact_marginals(name):
    """P(first = a) and P(second = b | first = a) of the request state, from plain_probs."""
    cfg, controls = CASES[name]
    counts, prompt = request_state()
    m0 = plain_probs(LOGP[ROOT][None], counts[None], prompt[None], cfg, controls)[0]
    after = counts[None].repeat(VOCAB, 1) + torch.eye(VOCAB, dtype=torch.int32)  # row a: a emitted too
    cond = plain_probs(LOGP, after, prompt[None].repeat(VOCAB, 1), cfg, controls)  # [a, b]
    return m0, cond


@functools.cache
def token_table(name):
    """Without penalties a node's distribution depends on its token only: the V rows, made once
    and gathered (a CPU sort of 1e5*N rows would dominate the test)."""
    cfg, controls = CASES[name]
    zeros = torch.zeros(VOCAB, VOCAB, dtype=torch.int32)
    return plain_probs(LOGP, zeros, zeros > 0, cfg, controls).float()


def node_probs(tree, counts, prompt, name, mutant=None):
    """The distribution after every node, as verify makes it; ``mutant`` plants one bug."""
    cfg, controls = CASES[name]
    min_p, rep, freq, pres, _ = controls
    batch, nodes = tree.retrieve_next_token.shape
    if mutant is None and (rep, freq, pres) == (1.0, 0.0, 0.0) and not controls[4]:
        return token_table(name)[tree.draft_tokens]
    logits = LOGP[tree.draft_tokens]  # [B*N, V]: the Markov target after each node's token

    def full(v, n=batch):
        return torch.full((n,), float(v))

    bias = _bias(controls)
    if mutant == "no_path":  # every node penalised with the request's counts only
        rows = batch * nodes
        processed = apply_penalties(
            logits, counts.repeat_interleave(nodes, 0), prompt.repeat_interleave(nodes, 0),
            full(rep, rows), full(freq, rows), full(pres, rows), None if bias is None else bias.expand(rows, VOCAB),
        )
    else:
        processed = apply_penalties(
            logits, counts, prompt, full(rep), full(freq), full(pres),
            None if bias is None else bias.expand(batch, VOCAB), tree.draft_tokens, tree.tree_mask,
        )
    temperature, top_p = full(cfg[3]), full(cfg[4])
    top_k = torch.zeros(batch, dtype=torch.int64)
    if mutant != "min_p_root_row":
        return target_probs(processed, temperature, top_k, top_p, nodes, full(min_p))
    probs = target_probs(processed, temperature, top_k, top_p, nodes).view(batch, nodes, VOCAB)
    floor = min_p * probs[:, 0].amax(dim=-1)  # the root's most likely token, for every node
    probs = torch.where(probs >= floor[:, None, None], probs, 0.0)
    return (probs / probs.sum(-1, keepdim=True)).view(batch * nodes, VOCAB)


def two_positions(name, seed, mutant=None):
    """Tokens at generated positions 0 and 1 of every trial, and the first step's accept lengths."""
    cfg = CASES[name][0]
    gen = torch.Generator().manual_seed(seed)
    counts, prompt = request_state()
    counts = counts[None].repeat(TRIALS, 1)
    prompt = prompt[None].repeat(TRIALS, 1)
    roots = torch.full((TRIALS,), ROOT, dtype=torch.int64)

    def probs_of(c):
        return lambda tree: node_probs(tree, c, prompt, name, mutant)

    emitted, lens, bonus = speculative_step(roots, cfg, gen, kernel_sampler, probs_of(counts))
    advanced = counts if mutant == "stale_counts" else count_tokens(counts, emitted)  # -1 pads past lens
    emitted2, _, _ = speculative_step(bonus, cfg, gen, kernel_sampler, probs_of(advanced))
    second = torch.where(lens >= 2, emitted[:, 1], emitted2[:, 0])
    return emitted[:, 0], second, lens


def report(name, seed, mutant=None):
    first, second, lens = two_positions(name, seed, mutant)
    m0, cond = exact_marginals(name)
    joint = m0[:, None] * cond
    return {
        "pos0": check_against(first, m0),
        "pos1": check_against(second, m0 @ cond),
        "joint": check_against(first * VOCAB + second, joint.reshape(-1)),
        "accept_len_histogram": torch.bincount(lens, minlength=CASES[name][0][1] + 2)[1:].tolist(),
    }


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(CASES))
def test_penalties_and_min_p_are_lossless_through_the_tree(name):
    out = report(name, seed=300 + list(CASES).index(name))
    assert min(out["accept_len_histogram"]) >= 100, out  # drafts accepted down to the last depth
    for key in ("pos0", "pos1", "joint"):
        pvalue, tv, outside = out[key]
        assert outside == 0, (key, out)
        assert pvalue > 1e-4, (key, out)
        if key != "joint":  # 1024 joint bins: TV carries sampling noise of ~0.08 at 1e5 trials
            assert tv < 0.06, (key, out)


MUTANTS = {
    "no_path": "tree_k2_penalties_t0.7",
    "stale_counts": "chain_penalties",
    "min_p_root_row": "tree_k2_min_p",
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_broken_controls_fail_the_check(mutant):
    out = report(MUTANTS[mutant], seed=7, mutant=mutant)
    failed = [key for key in ("pos0", "pos1", "joint")
              if out[key][0] < 1e-12 or (key != "joint" and out[key][1] > 0.06)]
    assert failed, out
