"""Random inputs of phasegraph.kernels.commit_path: accepted paths of random length over a small
vocabulary (so stop tokens hit), -1 padding, budgets below and above the path."""

from __future__ import annotations

import torch


def node_finite_case(gen: torch.Generator, batch: int, nodes: int, device="cpu") -> torch.Tensor:
    """[B*N] bool: about one node in six with non-finite logits."""
    return (torch.rand(batch * nodes, generator=gen) > 1 / 6).to(device)


def commit_path_case(gen: torch.Generator, batch: int, width: int, nodes: int, stops: int, lead: int,
                     vocab: int = 6, device="cpu") -> tuple:
    predict = torch.randint(0, vocab, (batch * nodes,), generator=gen)
    accept_lens = torch.randint(1, width + 1, (batch,), generator=gen)
    accept_index = torch.full((batch, width), -1, dtype=torch.int64)
    for b in range(batch):
        n = int(accept_lens[b])
        accept_index[b, :n] = b * nodes + torch.randperm(nodes, generator=gen)[:n]
    stop_ids = torch.randint(0, vocab, (batch, stops), generator=gen)
    stop_ids[torch.rand(batch, stops, generator=gen) < 0.4] = -1  # padding
    remaining = torch.randint(0, 2 * width + 1, (batch,), generator=gen)
    seq_lens = torch.randint(1, 500, (batch,), generator=gen)
    tensors = (predict, accept_index, accept_lens, stop_ids, remaining, seq_lens)
    return (*(t.to(device) for t in tensors), lead)
