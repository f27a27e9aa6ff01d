"""The launch tables of the skinny and the tiled products (phasegraph/kernels/configs/, read by
tile_tables.py), on the CPU: on an H100 and an H200 (by name; nothing runs on them) they pick,
for a grid of (m, n, k, dtype), what the Python tables they replaced picked (tile_picks.json);
the files ship in the package, a GPU without a file reads generic.json, PHASEGRAPH_TILE_TABLE
names another file, and a bad file is refused with its name and the bad entry."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import pytest
import torch

from phasegraph.kernels import KernelSettingError, _dispatch, check_kernel_settings
from phasegraph.kernels import linear as lin
from phasegraph.kernels import tile_tables as tt
from phasegraph.kernels import tiled_linear as tiled

PICKS = json.loads(Path(__file__).with_name("tile_picks.json").read_text())
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Every test reads the files (and the monkeypatched GPU names) anew."""
    tt.clear_cache()
    yield
    tt.clear_cache()


@pytest.fixture
def gpus(monkeypatch):
    """cuda:0 answers to the H100's name, cuda:1 to the H200's."""
    names = (H100, H200)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: names[index])
    return {name: torch.device("cuda", i) for i, name in enumerate(names)}


def test_the_skinny_tables_pick_the_recorded_configs(gpus):
    assert {e[0] for e in PICKS["skinny"]} == {H100, H200}
    for gpu, dtype, m, n, k, pick, rule in PICKS["skinny"]:
        device, dt = gpus[gpu], DTYPES[dtype]
        got = lin._lookup(m, n, k, dt, device)
        where = (gpu, dtype, m, n, k)
        assert list(lin.pick_config(m, n, k, dt, device)) == pick, where
        assert (None if got is None else [got.plain, got.fused]) == rule, where


def test_the_tiled_tables_pick_the_recorded_tiles(gpus):
    for device in gpus.values():
        for m, n, k, defer, tile in PICKS["tiled"]:
            got = tiled.pick_tile(m, n, k, defer, device)
            assert (None if got is None else list(got)) == tile, (device, m, n, k, defer)


def test_the_generic_file_holds_the_h100_rules_that_are_not_for_one_shape():
    h100 = tt.read_tables(tt.shipped_file("NVIDIA_H100_80GB_HBM3.json"))
    generic = tt.read_tables(tt.shipped_file(tt.GENERIC))
    for table in tt.TABLES:
        assert getattr(generic, table) == tuple(r for r in getattr(h100, table) if not _one_shape(r))
    assert generic.tiled_float32 == ()  # cuBLAS keeps 17..512 float32 rows on an unknown GPU


def _one_shape(rule) -> bool:
    return rule.n_range[0] == rule.n_range[1] and rule.k_range[0] == rule.k_range[1]


# ------------------------------------------------------------------------------------------
# The files and their loader

SHIPPED = ("NVIDIA_H100_80GB_HBM3.json", "NVIDIA_H200.json", tt.GENERIC)


def test_the_files_ship_in_the_package_and_read_back_as_written():
    """importlib.resources finds them where an installed package keeps its data; each file is in
    the writer's form, so a tuner's rewrite changes only the rules it measured."""
    listed = {f.name for f in resources.files("phasegraph.kernels").joinpath("configs").iterdir()}
    assert set(SHIPPED) <= listed
    for name in SHIPPED:
        tables = tt.read_tables(tt.shipped_file(name))
        assert tt.format_tables(tables) == tt.shipped_file(name).read_text(encoding="utf-8"), name
        assert all(tables.sources[t].strip() for t in tt.TABLES), name
        assert tt.match_skinny(tables.skinny_half, 16, 3000, 5000) is not None, name  # a default


def test_a_gpu_reads_the_file_of_its_name_and_any_other_device_the_generic_one(monkeypatch):
    names = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: names[index])
    assert tt.file_name(names[0]) == "NVIDIA_H100_80GB_HBM3.json"
    assert tt.file_name(names[2]) == "NVIDIA_A100_SXM4_80GB.json"
    files = [tt.table_file(torch.device("cuda", i)) for i in range(3)]
    assert [f.name for f in files] == ["NVIDIA_H100_80GB_HBM3.json", "NVIDIA_H200.json", tt.GENERIC]
    generic = tt.read_tables(tt.shipped_file(tt.GENERIC))
    assert tt.tables_for(torch.device("cuda", 2)) == generic  # no file of its own
    assert tt.tables_for(torch.device("cpu")) == generic
    assert tt.tables_for(torch.device("cuda", 1)) == tt.read_tables(tt.shipped_file(SHIPPED[1]))
    assert tt.tables_for(torch.device("cuda", 1)) is tt.tables_for(torch.device("cuda", 1))


def test_the_environment_names_another_file(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    tile = tt.TileConfig(64, 64, 32, 4, 3, 2)
    mine = tt.TileTables((), (), (tt.TileRule((17, 512), (96, 96), (40, 40), tile, tile),),
                         dict.fromkeys(tt.TABLES, "a test"))
    path = tmp_path / "mine.json"
    tt.write_tables(path, mine)
    monkeypatch.setenv(tt.ENV_VAR, str(path))
    for device in (torch.device("cuda", 0), torch.device("cpu"), None):
        assert tt.table_file(device) == path
        assert tt.tables_for(device) == mine
    monkeypatch.setenv(tt.ENV_VAR, str(tmp_path / "missing.json"))
    with pytest.raises(tt.TileTableError, match=r"missing\.json: cannot read the tile table"):
        tt.tables_for(torch.device("cuda", 0))
    monkeypatch.delenv(tt.ENV_VAR)
    assert tt.tables_for(torch.device("cuda", 0)).path.endswith("NVIDIA_H200.json")


GOOD_SKINNY = {"m_max": 4, "n": 768, "k": [1, 4096], "plain": True, "fused": False,
               "config": {"block_n": 4, "block_k": 512, "num_warps": 4, "num_stages": 3, "dot": False}}
GOOD_TILE = {"m": [17, 32], "n": 1280, "k": 768,
             "summed": {"block_m": 32, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}}


def _good() -> dict:
    """A file of three tables, one good rule each."""
    rules = {"skinny_half": GOOD_SKINNY, "skinny_float32": GOOD_SKINNY, "tiled_float32": GOOD_TILE}
    return {name: {"source": "a test", "rules": [rule]} for name, rule in rules.items()}


def _with(**tables) -> dict:
    """The good file with the given rules after each table's good one (so each is rule 1)."""
    data = _good()
    for name, rules in tables.items():
        data[name]["rules"] += rules
    return data


def _skinny(**change):
    return {**GOOD_SKINNY, **change}


def _config(**change):
    return _skinny(config={**GOOD_SKINNY["config"], **change})


BAD_FILES = {  # the file (its text, or the data it encodes) -> the words of the error
    "not JSON": ('{"skinny_half": [', "not a JSON tile table"),
    "a list": ([], "expected an object with skinny_float32, skinny_half, tiled_float32"),
    "a missing table": ({"skinny_half": _good()["skinny_half"]}, "missing skinny_float32, tiled_float32"),
    "an unknown table": ({**_good(), "skinny_bf16": {}}, "unknown skinny_bf16"),
    "rules not a list": ({**_good(), "skinny_half": {"source": "", "rules": {}}},
                         "skinny_half: rules: expected a list"),
    "no source": ({**_good(), "skinny_half": {"rules": []}}, "skinny_half: missing source"),
    "a bad range": (_with(skinny_half=[_skinny(n=[800, 700])]),
                    r"skinny_half rule 1: n: expected an integer, \[lo, hi\] with lo <= hi"),
    "a zero m_max": (_with(skinny_half=[_skinny(m_max=0)]),
                     "skinny_half rule 1: m_max: expected a positive integer, got 0"),
    "a string flag": (_with(skinny_float32=[_skinny(plain="yes")]),
                      "skinny_float32 rule 1: plain: expected true or false, got 'yes'"),
    "an odd block": (_with(skinny_half=[_config(block_n=3)]),
                     r"skinny_half rule 1: config\.block_n: expected a power of two, got 3"),
    "a boolean size": (_with(skinny_half=[_config(num_stages=True)]),
                       r"rule 1: config\.num_stages: expected a positive integer, got True"),
    "a missing field": (_with(skinny_half=[_skinny(config={"block_n": 4})]),
                        "rule 1: config: missing block_k, dot, num_stages, num_warps"),
    "an unknown field": (_with(skinny_half=[_config(stages=3)]), "rule 1: config: unknown stages"),
    "a precision": (_with(skinny_float32=[_config(precision="tf32")]),
                    r"rule 1: config\.precision: expected one of ieee, tf32x3, got 'tf32'"),
    "split-K fused": (_with(skinny_half=[_skinny(fused=True, config={**GOOD_SKINNY["config"], "split_k": 2})]),
                      r"skinny_half rule 1: a split-K config \(split_k 2\) takes no fused prologue"),
    "a tile's block": (_with(tiled_float32=[{**GOOD_TILE, "deferred": {**GOOD_TILE["summed"], "block_m": 48}}]),
                       r"tiled_float32 rule 1: deferred\.block_m: expected a power of two, got 48"),
    "a tile rule's key": (_with(tiled_float32=[{**GOOD_TILE, "m_max": 32}]),
                          "tiled_float32 rule 1: unknown m_max"),
}


def _file_text(spec) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec)


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_is_refused_naming_the_file_and_the_entry(monkeypatch, tmp_path, case):
    text, words = BAD_FILES[case]
    path = tmp_path / "bad.json"
    path.write_text(_file_text(text))
    with pytest.raises(tt.TileTableError, match=re.escape(str(path)) + ": .*" + words):
        tt.read_tables(path)
    monkeypatch.setenv(tt.ENV_VAR, str(path))
    with pytest.raises(tt.TileTableError, match=words):
        tt.tables_for(torch.device("cpu"))


def test_a_good_file_reads_as_its_entries(tmp_path):
    path = tmp_path / "good.json"
    path.write_text(_file_text(_good()))
    tables = tt.read_tables(path)
    config = tt.SkinnyConfig(4, 512, 4, 3, False)
    assert tables.skinny_half == (tt.SkinnyRule(4, (768, 768), (1, 4096), config, True, False),)
    tile = tt.TileConfig(32, 64, 64, 4, 3)
    assert tables.tiled_float32 == (tt.TileRule((17, 32), (1280, 1280), (768, 768), tile, tile),)
    assert tables.path == str(path) and tables.sources["tiled_float32"] == "a test"


def test_an_engine_refuses_a_bad_file_before_any_launch(monkeypatch, tmp_path):
    """check_kernel_settings (which Engine calls) reads the tables where Triton kernels will
    launch, so a bad PHASEGRAPH_TILE_TABLE is a KernelSettingError naming the file up front."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_with(skinny_half=[_config(block_k=100)])))
    monkeypatch.setenv(tt.ENV_VAR, str(path))
    check_kernel_settings(torch.device("cpu"))  # the references run: no table is read
    monkeypatch.setattr(_dispatch, "HAS_TRITON", True)  # as where Triton is installed
    monkeypatch.setenv(_dispatch.ENV_VAR, "triton")
    with pytest.raises(KernelSettingError, match=re.escape(str(path)) + r": skinny_half rule 1: config\.block_k"):
        check_kernel_settings(torch.device("cpu"))
    monkeypatch.delenv(tt.ENV_VAR)
    check_kernel_settings(torch.device("cpu"))
