"""Logit processing before sampling: logit bias, then repetition, frequency and presence penalties.

The definitions are OpenAI's for frequency and presence (``logit - c * frequency - (c > 0) *
presence``, ``c`` the times the token was emitted) and Hugging Face's / vLLM's for repetition
(CTRL, arXiv 1909.05858: the logit of a token of the prompt or the output is divided by the
penalty where it is positive and multiplied by it where it is not), applied in vLLM's order:
bias, repetition, frequency, presence. Greedy decoding takes the argmax of the processed logits.

Speculation (vLLM #18902: peers ignore penalties while speculating): verify scores every node
of a tree in one forward, and node ``j`` predicts the token after the path root..j, so its
counts are the request's (every emitted token, the bonus token at the root included) plus the
drafted tokens on its path, depth 1..depth(j). :func:`apply_penalties` takes the request's
counts for every node by broadcasting, then rewrites only the entries of tokens drafted in the
tree, from each node's own path counts: ``O(B·N·V + B·N²)`` work and no ``[B·N, V]`` count
table. Torch only, on every device: a fixed sequence of sync-free ops that CUDA graphs capture.
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect, expect_float, expect_shape

# the largest float32: processed logits are clamped into the finite range, so a penalty cannot
# turn a finite row infinite (a tiny repetition penalty divides a positive logit); NaN stays NaN
FLOAT32_MAX = torch.finfo(torch.float32).max


def _penalize(
    x: torch.Tensor,  # float32 logits (bias added)
    count: torch.Tensor,  # float32 times each token was emitted, broadcast against x
    in_prompt: torch.Tensor,  # bool, broadcast against x
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    seen = in_prompt | (count > 0)
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * count - presence * (count > 0).to(x.dtype)


def apply_penalties(
    logits: torch.Tensor,  # [B*N, V] float, the target's logits (N rows per request)
    output_counts: torch.Tensor,  # [B, V] int32, times each token was emitted (bonus included)
    prompt_mask: torch.Tensor,  # [B, V] bool, the token occurs in the prompt
    repetition: torch.Tensor,  # [B] float, 1 = off; > 0
    frequency: torch.Tensor,  # [B] float, 0 = off
    presence: torch.Tensor,  # [B] float, 0 = off
    logit_bias: torch.Tensor | None = None,  # [B, V] float, added first; None = none
    node_tokens: torch.Tensor | None = None,  # [B*N] i64, the token of every tree node (N > 1)
    tree_mask: torch.Tensor | None = None,  # [B, N, N] bool, ancestor-or-self (N > 1)
) -> torch.Tensor:  # [B*N, V] float32
    """Logits after bias and penalties (see the module docstring), clamped to finite float32.

    With one row per request (prefill, decode) the counts are the request's own. With a tree
    (``node_tokens`` and ``tree_mask``, node 0 of each request its root) row ``b*N + j`` is
    penalised with ``output_counts[b]`` plus the tokens of j's ancestors-or-self at depth >= 1
    (the root is the bonus token, already counted).
    """
    expect_float(logits, "logits", 2)
    expect(output_counts, "output_counts", 2, torch.int32)
    expect(prompt_mask, "prompt_mask", 2, torch.bool)
    rows, vocab = logits.shape
    batch = output_counts.shape[0]
    expect_shape(output_counts, "output_counts", (batch, vocab))
    expect_shape(prompt_mask, "prompt_mask", (batch, vocab))
    for name, x in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        expect_float(x, name, 1)
        expect_shape(x, name, (batch,))
    if batch == 0:
        return logits.to(torch.float32)
    if rows % batch:
        raise ValueError(f"logits has {rows} rows, not a multiple of the batch {batch}")
    nodes = rows // batch
    if nodes > 1 and (node_tokens is None or tree_mask is None):
        raise ValueError(f"{nodes} rows per request need node_tokens and tree_mask (a tree)")

    def per_request(x: torch.Tensor) -> torch.Tensor:  # [B] -> [B, 1, 1] float32
        return x.to(torch.float32)[:, None, None]

    rep, freq, pres = per_request(repetition), per_request(frequency), per_request(presence)
    x = logits.to(torch.float32).view(batch, nodes, vocab)
    if logit_bias is not None:
        expect_float(logit_bias, "logit_bias", 2)
        expect_shape(logit_bias, "logit_bias", (batch, vocab))
        x = x + logit_bias.to(torch.float32)[:, None, :]
    counts = output_counts.to(torch.float32)  # [B, V]
    out = _penalize(x, counts[:, None, :], prompt_mask[:, None, :], rep, freq, pres)  # [B, N, V]
    if nodes > 1:
        expect(node_tokens, "node_tokens", 1, torch.int64)
        expect_shape(node_tokens, "node_tokens", (rows,))
        expect(tree_mask, "tree_mask", 3, torch.bool)
        expect_shape(tree_mask, "tree_mask", (batch, nodes, nodes))
        tokens = node_tokens.view(batch, nodes)
        drafted = torch.arange(nodes, device=logits.device) > 0  # depth >= 1: not the root
        ancestors = (tree_mask & drafted[None, None, :]).to(torch.float32)  # [B, N(j), N(a)]
        same = (tokens[:, :, None] == tokens[:, None, :]).to(torch.float32)  # [B, N(a), N(a')]
        # path[b, j, a]: how often node a's token is drafted on node j's path (exact in float32)
        path = torch.bmm(ancestors, same)  # [B, N, N]
        at = tokens[:, None, :].expand(batch, nodes, nodes)  # row j, column a: token of node a
        fixed = _penalize(
            x.gather(2, at),
            counts.gather(1, tokens)[:, None, :] + path,
            prompt_mask.gather(1, tokens)[:, None, :],
            rep, freq, pres,
        )
        out = out.scatter(2, at, fixed)  # a token drafted twice gets the same value twice
    return out.clamp(-FLOAT32_MAX, FLOAT32_MAX).view(rows, vocab)


def count_tokens(
    output_counts: torch.Tensor,  # [B, V] int32
    tokens: torch.Tensor,  # [B] or [B, W] i64, negative entries are no token
) -> torch.Tensor:  # [B, V] int32
    """``output_counts`` with every non-negative token of ``tokens`` counted once more (the
    tokens a step emitted: -1 pads and the non-finite marks are not tokens)."""
    expect(output_counts, "output_counts", 2, torch.int32)
    if tokens.dim() == 1:
        tokens = tokens[:, None]
    expect(tokens, "tokens", 2, torch.int64)
    vocab = output_counts.shape[1]
    valid = (tokens >= 0) & (tokens < vocab)
    return output_counts.scatter_add(1, tokens.clamp(0, max(vocab - 1, 0)), valid.to(torch.int32))


def prefill_token_counts(
    input_ids: torch.Tensor,  # [T] i64, the prefilled tokens of every request
    positions: torch.Tensor,  # [T] i64
    token_req: torch.Tensor,  # [T] i64, batch row of each token
    prompt_lens: torch.Tensor,  # [B] i64
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, V] int32 output counts, [B, V] bool prompt mask
    """The penalty state of prefilled requests before their first token of this prefill: the
    tokens at positions below a request's prompt length are its prompt, the ones after are
    output it emitted before a retraction (counted, so a resumed request goes on with the
    counts it had)."""
    expect(input_ids, "input_ids", 1, torch.int64)
    expect(prompt_lens, "prompt_lens", 1, torch.int64)
    batch = prompt_lens.shape[0]
    in_prompt = positions < prompt_lens[token_req]  # [T]
    flat = token_req * vocab + input_ids.clamp(0, max(vocab - 1, 0))  # [T]
    zeros = torch.zeros(batch * vocab, dtype=torch.int32, device=input_ids.device)
    prompt = zeros.index_add(0, flat, in_prompt.to(torch.int32)) > 0
    counts = zeros.index_add(0, flat, (~in_prompt).to(torch.int32))
    return counts.view(batch, vocab), prompt.view(batch, vocab)


def token_bitmask_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The allowed tokens [R, V] bool of a packed token bitmask [R, ceil(V/32)] int32: bit ``j`` of
    word ``i`` allows token ``32 i + j`` (XGrammar's layout: Dong et al. 2024, arXiv 2411.15100)."""
    expect(bitmask, "bitmask", 2, torch.int32)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, Vw, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(
    logits: torch.Tensor,  # [R, V] float
    bitmask: torch.Tensor,  # [R, ceil(V/32)] int32, bit set = allowed
) -> torch.Tensor:
    """``logits`` with every token the bitmask forbids at -inf (a new tensor): structured
    output's grammar masks (XGrammar, arXiv 2411.15100), applied after bias and penalties so that
    greedy picks and sampling (softmax) see only the allowed tokens. Torch only: a shift, an and
    and a ``masked_fill`` per row, sync-free."""
    expect_float(logits, "logits", 2)
    expect_shape(bitmask, "bitmask", (logits.shape[0], (logits.shape[1] + 31) // 32))
    return logits.masked_fill(~token_bitmask_allowed(bitmask, logits.shape[1]), float("-inf"))


def token_bitmask_allows(
    bitmask: torch.Tensor,  # [R, ceil(V/32)] int32
    rows: torch.Tensor,  # [T] int64 rows of bitmask
    tokens: torch.Tensor,  # [T] int64
) -> torch.Tensor:
    """[T] bool: row ``rows[t]`` of the packed bitmask allows ``tokens[t]`` (one gather, no
    unpacking of whole rows)."""
    expect(bitmask, "bitmask", 2, torch.int32)
    words = bitmask[rows, tokens >> 5]  # [T]
    return ((words >> (tokens & 31).to(torch.int32)) & 1).bool()
