"""The tuned launch tables of the skinny and the tiled products, on the CPU: on an H100 and an
H200 (by name; nothing runs on them) they pick, for a grid of (m, n, k, dtype), what they picked
when the tables were recorded in tile_picks.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phasegraph.kernels import linear as lin
from phasegraph.kernels import tiled_linear as tiled

PICKS = json.loads(Path(__file__).with_name("tile_picks.json").read_text())
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture
def gpus(monkeypatch):
    """cuda:0 answers to the H100's name, cuda:1 to the H200's."""
    names = (H100, H200)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: names[index])
    monkeypatch.setattr(lin, "_H200_BY_DEVICE", {})
    return {name: torch.device("cuda", i) for i, name in enumerate(names)}


def test_the_skinny_tables_pick_the_recorded_configs(gpus):
    assert {e[0] for e in PICKS["skinny"]} == {H100, H200}
    for gpu, dtype, m, n, k, pick, rule in PICKS["skinny"]:
        device, dt = gpus[gpu], DTYPES[dtype]
        got = lin._lookup(m, n, k, dt, device)
        where = (gpu, dtype, m, n, k)
        assert list(lin.pick_config(m, n, k, dt, device)) == pick, where
        assert (None if got is None else [got.plain, got.fused]) == rule, where


def test_the_tiled_table_picks_the_recorded_tiles():
    for m, n, k, defer, tile in PICKS["tiled"]:
        got = tiled.pick_tile(m, n, k, defer)
        assert (None if got is None else list(got)) == tile, (m, n, k, defer)
