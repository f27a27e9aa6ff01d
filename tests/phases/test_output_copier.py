"""OutputCopier: what a graph replay hands to the phases after it. The first ``batch`` requests'
rows of every static output, in fresh 16-byte-aligned memory (never the static buffers, which
the next replay overwrites); nested schemas that are the static input, or the previous output
of the chain, replaced by the real objects; everything else copied."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float32, Int64

from phasegraph.phases.schemas import NODE, REQUEST
from phasegraph.runtime.cuda_graphs import OUTPUT_SETS_KEPT, OutputCopier
from phasegraph.statemachine import Schema, schema, tensor, value

Tensor = torch.Tensor


@schema
class Knobs(Schema):
    seed: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=0)


@schema
class Start(Schema):
    x: Float32[Tensor, "B 3"] = tensor(role=REQUEST, pad=0)
    knobs: Knobs = value()


@schema
class Middle(Schema):
    nodes: Float32[Tensor, "B*N 2"] = tensor(role=NODE, pad=0)
    picked: Bool[Tensor, "B"] = tensor(role=REQUEST, pad=0)
    table: Float32[Tensor, "5"] = tensor()  # not batch-indexed: copied whole
    strided: Float32[Tensor, "B 4"] = tensor(role=REQUEST, pad=0)
    missing: Float32[Tensor, "B"] | None = tensor(role=REQUEST, pad=0.0, default=None)
    knobs: Knobs = value()
    source: Start = value()
    step: int = value()


@schema
class End(Schema):
    y: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=0)
    middle: Middle = value()
    knobs: Knobs = value()


def _statics(bucket: int = 4, nodes: int = 3):
    g = torch.Generator().manual_seed(0)
    knobs = Knobs(seed=torch.arange(bucket) + 10)
    start = Start(x=torch.randn(bucket, 3, generator=g), knobs=knobs)
    middle = Middle(nodes=torch.randn(bucket * nodes, 2, generator=g), picked=torch.rand(bucket, generator=g) > 0.5,
                    table=torch.randn(5, generator=g), strided=torch.randn(4, bucket, generator=g).t(),
                    knobs=knobs, source=start, step=7)
    end = End(y=torch.randint(0, 99, (bucket,), generator=g), middle=middle, knobs=Knobs(seed=torch.arange(bucket)))
    return start, middle, end


def _storages(obj: Schema) -> set[int]:
    return {x.untyped_storage().data_ptr() for _, x in obj.tensors() if x.numel()}


def test_copies_the_real_rows_into_fresh_aligned_memory():
    start, middle, end = _statics()
    real = Start(x=torch.randn(2, 3), knobs=Knobs(seed=torch.tensor([5, 6])))
    copier = OutputCopier([middle, end], start, batch=2, bucket=4)
    got_middle, got_end = copier(real)
    # rows of the first two requests (3 nodes each), tables whole, the strided field contiguous
    assert torch.equal(got_middle.nodes, middle.nodes[:6])
    assert torch.equal(got_middle.picked, middle.picked[:2])
    assert torch.equal(got_middle.table, middle.table)
    assert torch.equal(got_middle.strided, middle.strided[:2]) and got_middle.strided.is_contiguous()
    assert got_middle.missing is None and got_middle.step == 7
    assert torch.equal(got_end.y, end.y[:2])
    # nested schemas standing for the static input are the real objects, down the chain too
    assert got_middle.source is real and got_middle.knobs is real.knobs
    assert got_end.middle is got_middle
    # a nested schema nobody stands for is copied (sliced) like the rest
    assert got_end.knobs is not end.knobs and torch.equal(got_end.knobs.seed, end.knobs.seed[:2])
    statics = _storages(start) | _storages(middle) | _storages(end)
    for out in (got_middle, got_end, got_end.knobs):
        assert not _storages(out) & statics
        for _, x in out.tensors():
            assert x.data_ptr() % 16 == 0
    # a replay overwrites the static buffers; what was handed out stays
    before = got_middle.nodes.clone()
    middle.nodes.add_(1.0)
    assert torch.equal(got_middle.nodes, before)


def test_each_call_hands_out_new_memory_from_the_same_plan():
    start, middle, end = _statics()
    copier = OutputCopier([middle], start, batch=3, bucket=4)
    real = Start(x=torch.randn(3, 3), knobs=Knobs(seed=torch.tensor([1, 2, 3])))
    first = copier(real)[0]
    middle.picked.logical_not_()
    second = copier(real)[0]
    assert torch.equal(second.picked, middle.picked[:3]) and torch.equal(first.picked, ~second.picked)
    assert not _storages(first) & _storages(second)


def test_a_tensor_passed_on_unchanged_is_copied_once_and_shared():
    """A phase that hands a tensor on unchanged puts one static tensor in two output fields; the
    copier copies it once and both fields hold that copy, as the eager phases' outputs share
    theirs. Equal values in different tensors stay separate copies."""
    start, middle, end = _statics()
    shared = End(y=end.y, middle=middle, knobs=Knobs(seed=end.y))  # the same tensor twice
    copier = OutputCopier([middle, shared], start, batch=2, bucket=4)
    assert copier.count == 5  # nodes, picked, table, strided; y once
    real = Start(x=torch.randn(2, 3), knobs=Knobs(seed=torch.tensor([5, 6])))
    got_end = copier(real)[1]
    assert got_end.knobs.seed is got_end.y and torch.equal(got_end.y, end.y[:2])
    assert not _storages(got_end) & _storages(shared)  # still fresh memory
    equal = End(y=end.y, middle=middle, knobs=Knobs(seed=end.y.clone()))  # equal values only
    other = OutputCopier([middle, equal], start, batch=2, bucket=4)
    assert other.count == 6
    got = other(real)[1]
    assert got.knobs.seed is not got.y and torch.equal(got.knobs.seed, got.y)


def _first_ptr(out: Schema) -> int:
    return out.nodes.untyped_storage().data_ptr()


def test_memory_nobody_refers_to_any_more_is_refilled():
    """At batch 1 an iteration's copy-out is host time on the critical path: the copier keeps
    its memory and refills it once the outputs handed out from it are gone."""
    start, middle, end = _statics()
    copier = OutputCopier([middle, end], start, batch=2, bucket=4)
    real = Start(x=torch.randn(2, 3), knobs=Knobs(seed=torch.tensor([5, 6])))
    ptr = _first_ptr(copier(real)[0])  # the outputs die here
    middle.nodes.add_(1.0)
    again = copier(real)[0]
    assert _first_ptr(again) == ptr and torch.equal(again.nodes, middle.nodes[:6])


def test_what_is_still_held_is_never_overwritten():
    """A held output schema, or a view made from one of its tensors (nothing refers to the
    copier's own tensor objects then, only to their memory), keeps its values through later
    calls, also past the number of sets the copier keeps."""
    start, middle, end = _statics()
    copier = OutputCopier([middle, end], start, batch=2, bucket=4)
    real = Start(x=torch.randn(2, 3), knobs=Knobs(seed=torch.tensor([5, 6])))
    held = copier(real)[1]  # the End; its Middle with it
    derived = copier(real)[0].nodes[:2]  # a view of the second call's memory, the schema gone
    values = (held.middle.nodes.clone(), held.y.clone(), derived.clone())
    later = []
    for _ in range(OUTPUT_SETS_KEPT + 3):
        middle.nodes.add_(1.0)
        end.y.add_(1)
        later.append(copier(real))
        assert torch.equal(later[-1][0].nodes, middle.nodes[:6])
    assert torch.equal(held.middle.nodes, values[0]) and torch.equal(held.y, values[1])
    assert torch.equal(derived, values[2])
    ptrs = {_first_ptr(outs[0]) for outs in later} | {_first_ptr(held.middle), derived.untyped_storage().data_ptr()}
    assert len(ptrs) == len(later) + 2  # every call while all are held: memory of its own
    del later, held, derived
    assert _first_ptr(copier(real)[0]) in ptrs  # and kept memory comes back once released
