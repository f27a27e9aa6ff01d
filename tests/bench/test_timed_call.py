"""phasegraph.bench.common.timed_call: the wall time of one call, with the heap frozen."""

import gc

import pytest

from phasegraph.bench.common import timed_call


def test_returns_the_result_and_counts_collections_inside_the_call():
    def work():
        gc.collect()  # one full collection inside the timed call
        return "done"

    wall, out, pauses = timed_call("cpu", work)
    assert out == "done"
    assert pauses["frozen"] is True and pauses["pauses"] >= 1
    assert 0 < pauses["seconds"] <= wall
    assert gc.get_freeze_count() == 0, "the heap must be unfrozen after the call"


def test_freezing_shrinks_what_a_full_collection_scans():
    garbage_free_heap = [[i] for i in range(200_000)]  # long-lived objects, like imports and models
    _, _, frozen = timed_call("cpu", gc.collect)
    _, _, thawed = timed_call("cpu", gc.collect, freeze_gc=False)
    assert frozen["pauses"] == thawed["pauses"] == 1
    assert frozen["seconds"] < thawed["seconds"]
    del garbage_free_heap


def test_cleans_up_when_the_call_raises():
    callbacks = list(gc.callbacks)

    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        timed_call("cpu", boom)
    assert gc.callbacks == callbacks
    assert gc.get_freeze_count() == 0
