"""Greedy generation with the target, and a reference simulation of speculative decoding.

Greedy speculative decoding emits exactly the target's greedy continuation, so the acceptance
length it would reach can be measured offline: generate the continuation once, then replay the
draft loop against it. For the EAGLE-3 head the replay is the real draft loop (EAGLE-2 dynamic
tree; a chain is ``topk = 1``), run in lockstep over all sequences:

1. base row ``b = prompt_len - 1`` (its token is the bonus token ``t_{b+1}``); the head's
   step-0 pass over the whole sequence supplies the KV of rows ``<= b`` and row ``b``'s output;
2. step-0 candidates: the top-``K`` of row ``b``; then ``S - 1`` draft forwards, each feeding
   the ``K`` frontier beams (token, parent's ``out``) at position ``b + i`` with attention to
   rows ``<= b`` and the beam's own chain; every beam proposes its top-``K`` children (score =
   product of draft probabilities); the best ``K`` children form the next frontier;
3. the ``N - 1`` best of the ``K + (S-1)K²`` candidates (stable sort, ties to the lower index)
   plus the root form the tree; greedy verification accepts the deepest node whose path
   matches the continuation; ``accept_len = accepted + 1`` and ``b += accept_len``.

Verify steps whose ``S`` look-ahead tokens would run past the generated text are not counted.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from phasegraph.train.eagle3_head import Eagle3Head
from phasegraph.train.eagle3_train import FrozenTarget
from phasegraph.train.loop import autocast
from phasegraph.train.presets import max_tree_nodes

__all__ = [
    "AcceptStats",
    "DraftTree",
    "HeadPrefix",
    "accept_lengths",
    "draft_tree",
    "head_prefix",
    "generate_continuations",
    "greedy_generate",
    "simulate_eagle3",
    "simulate_standalone_chain",
]


# The KV cache's keyword argument and output field: transformers 5.24 renamed `past_key_values`
# to `cache` (the old name is deprecated, to go in 5.40); the GPU machine's 5.17 has the old one.
_CACHE = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters \
    else "past_key_values"


@dataclass
class AcceptStats:
    tau: float  # mean accept length (accepted drafts + bonus) per verify step
    verify_steps: int
    histogram: list[int]  # verify steps by accept length 1..S+1

    def to_dict(self) -> dict:
        return {"tau": round(self.tau, 4), "verify_steps": self.verify_steps,
                "accept_len_histogram": self.histogram}


@torch.no_grad()
def greedy_generate(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    new_tokens: int,
) -> torch.Tensor:
    """Greedy continuation ``[B, new_tokens]`` of left-padded prompts (KV cache, no EOS stop)."""
    device = input_ids.device
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with autocast(device):
        out = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
            use_cache=True, logits_to_keep=1,
        )
    cache = getattr(out, _CACHE)
    token = out.logits[:, -1].argmax(-1)
    generated = [token]
    last = positions[:, -1]
    mask = attention_mask
    for _ in range(new_tokens - 1):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        last = last + 1
        with autocast(device):
            out = model(
                input_ids=token[:, None], attention_mask=mask, position_ids=last[:, None],
                use_cache=True, logits_to_keep=1, **{_CACHE: cache},
            )
        cache = getattr(out, _CACHE)
        token = out.logits[:, -1].argmax(-1)
        generated.append(token)
    return torch.stack(generated, dim=1)


def generate_continuations(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    new_tokens: int,
    device: torch.device,
    batch_size: int,
    pad_id: int,
) -> list[list[int]]:
    """Prompt + greedy continuation for each prompt (batched with left padding)."""
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(chunk), width), dtype=torch.int64)
        for r, p in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        new = greedy_generate(model, ids.to(device), mask.to(device), new_tokens).cpu()
        out.extend(p + new[r].tolist() for r, p in enumerate(chunk))
    return out


def _pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in seqs])


def _finish_stats(lengths: list[int], max_len: int) -> AcceptStats:
    hist = [0] * max_len
    for a in lengths:
        hist[a - 1] += 1
    tau = sum(lengths) / len(lengths) if lengths else float("nan")
    return AcceptStats(tau, len(lengths), hist)


@dataclass
class DraftTree:
    """Draft candidates of one verify step, ``[n, C]`` each, ``C = K + (S-1)*K*K``, in the
    candidate order of ``docs/internals.md`` (step-0 candidates, then per step beam-major)."""

    tokens: torch.Tensor  # target vocabulary ids
    scores: torch.Tensor  # product of draft probabilities along the path (fp32)
    parents: torch.Tensor  # parent candidate index, -1 for step-0 candidates
    depth: torch.Tensor  # 1..S


@dataclass
class HeadPrefix:
    """The head's teacher-forced (step-0) pass over whole sequences: rows ``0..W-2``."""

    out: torch.Tensor  # [n, W-1, Hd]
    k: torch.Tensor  # [n, kv_heads, W-1, D]
    v: torch.Tensor
    logits: torch.Tensor  # [n, W-1, Vd] fp32


@torch.no_grad()
def head_prefix(head: Eagle3Head, target: FrozenTarget, ids: torch.Tensor) -> HeadPrefix:
    """Step-0 pass over ``ids [n, W]`` (right padding is harmless: attention is causal)."""
    with autocast(ids.device):
        feats, _ = target(ids)
        out, k, v = head.extend(feats[:, :-1], target.embed(ids[:, 1:]))
        logits = head.logits(out).float()
    return HeadPrefix(out, k, v, logits)


@torch.no_grad()
def draft_tree(
    head: Eagle3Head,
    target: FrozenTarget,
    prefix: HeadPrefix,
    base: torch.Tensor,
    topk: int,
    steps: int,
) -> DraftTree:
    """EAGLE-2 dynamic-tree drafting from base rows ``base [n]`` (a chain when ``topk == 1``).

    Frontier beam ``k`` at draft forward ``i`` (position ``base + i``) attends the prefix rows
    ``<= base`` and the keys its own chain wrote at forwards ``1..i-1``, plus its own key.
    """
    n, k_top = base.shape[0], topk
    device = base.device
    arange_n = torch.arange(n, device=device)
    rows = torch.arange(prefix.k.shape[2], device=device)
    k0, v0 = prefix.k, prefix.v
    hd, nkv, dh = prefix.out.shape[-1], k0.shape[1], k0.shape[3]
    p, tok = torch.softmax(prefix.logits[arange_n, base], dim=-1).topk(k_top, dim=-1)
    tok = head.to_target_ids(tok)
    tokens, scores = [tok], [p]
    parents = [torch.full_like(tok, -1)]
    depth = [torch.ones_like(tok)]
    f_tok, f_score = tok, p
    f_idx = torch.arange(k_top, device=device).expand(n, -1)  # frontier candidate indices
    f_hidden = prefix.out[arange_n, base][:, None].expand(n, k_top, hd)
    anc_k = k0.new_zeros(n, nkv, k_top, 0, dh)
    anc_v = v0.new_zeros(n, nkv, k_top, 0, dh)
    prefix_mask = (rows[None, :] <= base[:, None])[:, None].expand(n, k_top, -1)
    beams = torch.arange(k_top, device=device)
    for i in range(1, steps):
        n_anc = i - 1
        anc_mask = (torch.arange(k_top * n_anc, device=device) // max(n_anc, 1))[None] == beams[
            :, None
        ]
        ctx_mask = torch.cat([prefix_mask, anc_mask[None].expand(n, -1, -1)], dim=-1)
        ctx_k = torch.cat([k0, anc_k.flatten(2, 3)], dim=2)
        ctx_v = torch.cat([v0, anc_v.flatten(2, 3)], dim=2)
        pos = (base + i)[:, None].expand(n, k_top)
        with autocast(device):
            out, k_new, v_new = head.step(
                f_hidden, target.embed(f_tok), pos, ctx_k, ctx_v, ctx_mask
            )
            cp = torch.softmax(head.logits(out).float(), dim=-1)
        cp, ctok = cp.topk(k_top, dim=-1)  # [n, K, K]
        c_tok = head.to_target_ids(ctok).flatten(1)  # [n, K*K], beam-major
        c_score = (f_score[..., None] * cp).flatten(1)
        first = k_top + (i - 1) * k_top * k_top
        tokens.append(c_tok)
        scores.append(c_score)
        parents.append(f_idx.repeat_interleave(k_top, dim=1))
        depth.append(torch.full_like(c_tok, i + 1))
        if i == steps - 1:
            break
        sel = c_score.topk(k_top, dim=-1).indices  # [n, K]
        parent_beam = sel // k_top
        f_tok, f_score, f_idx = c_tok.gather(1, sel), c_score.gather(1, sel), first + sel
        f_hidden = out.gather(1, parent_beam[..., None].expand(-1, -1, hd))
        pk = parent_beam[:, None, :, None, None].expand(n, nkv, k_top, n_anc, dh)
        pn = parent_beam[:, None, :, None, None].expand(n, nkv, k_top, 1, dh)
        anc_k = torch.cat([anc_k.gather(2, pk), k_new[:, :, :, None].gather(2, pn)], dim=3)
        anc_v = torch.cat([anc_v.gather(2, pk), v_new[:, :, :, None].gather(2, pn)], dim=3)
    return DraftTree(
        torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1), torch.cat(depth, 1)
    )


def accept_lengths(tree: DraftTree, truth: torch.Tensor, nodes: int) -> torch.Tensor:
    """Greedy verification: keep the ``nodes - 1`` best candidates (stable descending sort, ties
    to the lower index) and return ``[n]`` accepted drafts + 1; ``truth [n, S]`` holds the
    tokens a depth-1..S node must match."""
    n, c = tree.tokens.shape
    match = tree.tokens == truth.gather(1, tree.depth - 1)
    on_path = torch.zeros_like(match)
    for d in range(1, int(tree.depth.max()) + 1):  # parents sit one depth up
        parent_on = torch.where(
            tree.parents >= 0,
            on_path.gather(1, tree.parents.clamp(min=0)),
            torch.ones_like(match),
        )
        on_path = torch.where(tree.depth == d, match & parent_on, on_path)
    keep = torch.sort(tree.scores, dim=1, descending=True, stable=True).indices[:, : nodes - 1]
    return (tree.depth.gather(1, keep) * on_path.gather(1, keep)).amax(dim=1) + 1


@torch.no_grad()
def simulate_eagle3(
    head: Eagle3Head,
    target: FrozenTarget,
    seqs: list[list[int]],
    prompt_lens: list[int],
    topk: int,
    steps: int,
    nodes: int,
    device: torch.device,
    pad_id: int = 0,
) -> AcceptStats:
    """Accept lengths of greedy EAGLE-3 decoding of ``seqs`` (prompt + target greedy text)."""
    most = max_tree_nodes(topk, steps)
    if not 2 <= nodes <= most:
        raise ValueError(f"nodes={nodes} must be in [2, {most}] for topk={topk}, steps={steps}")
    ids, lens = _pad_right(seqs, pad_id)
    ids, lens = ids.to(device), lens.to(device)
    width = ids.shape[1]
    prefix = head_prefix(head, target, ids)
    base = torch.tensor(prompt_lens, device=device) - 1
    active = base + 1 + steps <= lens - 1
    depth_offsets = torch.arange(steps, device=device) + 2
    lengths: list[int] = []
    while bool(active.any()):
        b = torch.where(active, base, torch.zeros_like(base))
        tree = draft_tree(head, target, prefix, b, topk, steps)
        truth = ids.gather(1, (b[:, None] + depth_offsets).clamp(max=width - 1))
        accept_len = accept_lengths(tree, truth, nodes)
        lengths.extend(accept_len[active].tolist())
        base = torch.where(active, base + accept_len, base)
        active = active & (base + 1 + steps <= lens - 1)
    return _finish_stats(lengths, steps + 1)


@torch.no_grad()
def simulate_standalone_chain(
    draft: LlamaForCausalLM,
    seqs: list[list[int]],
    prompt_lens: list[int],
    steps: int,
    device: torch.device,
    pad_id: int = 0,
) -> AcceptStats:
    """Chain acceptance of a standalone draft: with a correct prefix, its ``k``-th proposal is
    its greedy token at that position, so one teacher-forced pass decides every step."""
    ids, lens = _pad_right(seqs, pad_id)
    with autocast(device):
        pred = draft(input_ids=ids.to(device), use_cache=False).logits.argmax(-1).cpu()
    hit = pred[:, :-1] == ids[:, 1:]  # hit[r, p]: proposal for position p+1 is right
    lengths: list[int] = []
    for r, n0 in enumerate(prompt_lens):
        n = n0  # the bonus token sits at position n
        while n + steps <= int(lens[r]) - 1:
            a = 0
            while a < steps and bool(hit[r, n + a]):
                a += 1
            lengths.append(a + 1)
            n += a + 1
    return _finish_stats(lengths, steps + 1)
