"""take_rows and embed on the CPU: index_select's rows, and a module call where the module is
not a plain embedding table. (On CUDA both forms are checked in test_cuda_parity.py.)"""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.models.take_rows import embed, take_rows


@pytest.mark.parametrize("rows", [0, 1, 2, 16, 64, 300])
def test_take_rows_is_index_select(rows):
    g = torch.Generator().manual_seed(rows)
    table = torch.randn(500, 24, generator=g)
    index = torch.randint(0, 500, (rows,), generator=g)
    assert torch.equal(take_rows(table, index), table.index_select(0, index))


def test_embed_gathers_plain_tables_and_calls_other_modules():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(100, 8, generator=g) * 10
    ids = torch.tensor([3, 7, 7, 99])
    plain = torch.nn.Embedding.from_pretrained(table)
    assert torch.equal(embed(plain, ids), plain(ids))
    renormed = torch.nn.Embedding.from_pretrained(table.clone(), max_norm=1.0)  # renormalises rows it reads
    got = embed(renormed, ids)
    assert torch.allclose(got.norm(dim=-1), torch.ones(4), atol=1e-4)

    class Scaled(torch.nn.Embedding):  # a subclass (e.g. a scaled embedding) keeps its forward
        def forward(self, input_ids):
            return 2 * super().forward(input_ids)

    scaled = Scaled.from_pretrained(table)
    assert torch.equal(embed(scaled, ids), 2 * table[ids])
