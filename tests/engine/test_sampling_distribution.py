"""Sampling through the whole engine is lossless: speculative and plain decoding draw their
tokens from the same distribution.

The kernel tests check the tree sampler against exact distributions; this one checks the
wiring around it (which coin draws what, which row's probabilities a node reads) on the real
path: 3000 requests of one prompt with seeds 0..2999 at temperature 1, decoded by the target
alone and by a tree whose draft is the target itself (its drafts are the target's top tokens, so
the accepted and the rejected branches both matter). The first token is drawn by prefill in both
runs, from the same coin; the tokens after it by decode in one and by tree verification in the
other. Per generated position, a two-sample Pearson chi-square test (pooled bins of fewer than
10 samples) must not reject at p = 1e-4. A bonus token drawn with the acceptance coin of its
depth, instead of its own, gives p < 1e-12 here.
"""

from __future__ import annotations

import torch

from phasegraph.runtime.config import SamplingParams
from tests.engine.support import VOCAB, arch_bundle, engine_for

REQUESTS = 3000
NEW_TOKENS = 4
P_THRESHOLD = 1e-4


def two_sample_pvalue(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    """Pearson chi-square test that samples ``a`` and ``b`` share one distribution; tokens seen
    fewer than 10 times in both together are pooled into one bin."""
    ca = torch.bincount(a, minlength=vocab).double()
    cb = torch.bincount(b, minlength=vocab).double()
    rare = (ca + cb) < 10
    ca = torch.cat([ca[~rare], ca[rare].sum()[None]])
    cb = torch.cat([cb[~rare], cb[rare].sum()[None]])
    seen = (ca + cb) > 0
    ca, cb = ca[seen], cb[seen]
    total = ca + cb
    ea = total * ca.sum() / total.sum()
    eb = total * cb.sum() / total.sum()
    stat = ((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum()
    dof = torch.tensor(float(total.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def sampled_tokens(bundle, method: str, **kw) -> torch.Tensor:
    engine = engine_for(bundle, method, max_batch_size=64, **kw)
    prompt = list(bundle.prompts[1])
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(REQUESTS)]
    outs = engine.generate([prompt] * REQUESTS, params)
    return torch.tensor([o.token_ids for o in outs])  # [REQUESTS, NEW_TOKENS]


def test_speculative_sampling_has_the_distribution_of_plain_sampling(engine_root):
    bundle = arch_bundle(engine_root, "llama")
    plain = sampled_tokens(bundle, "none")
    tree = sampled_tokens(bundle, "standalone", draft="self", topk=4, num_steps=3, num_draft_tokens=8)
    assert torch.equal(tree[:, 0], plain[:, 0])  # prefill's token: the same coin in both
    assert not torch.equal(tree[:, 1:], plain[:, 1:])  # later tokens: other coins (a real test)
    pvalues = [two_sample_pvalue(plain[:, i], tree[:, i], VOCAB) for i in range(1, NEW_TOKENS)]
    assert min(pvalues) > P_THRESHOLD, pvalues
