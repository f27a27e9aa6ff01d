"""Schema declaration and checking: dtype, shape, symbolic dims, device, roles, invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jaxtyping import Float32, Int64

from phasegraph.statemachine import (
    InvalidSchema,
    InvariantViolation,
    Role,
    Schema,
    SchemaViolation,
    invariant,
    schema,
    tensor,
    value,
)

REQ = Role("request", "B")
NODE = Role("node", "B*N")


@schema
class Toy(Schema):
    ids: Int64[torch.Tensor, "B"] = tensor(role=REQ, pad=0)
    scores: Float32[torch.Tensor, "B K"] = tensor(role=REQ, pad=0)
    per_node: Int64[torch.Tensor, "B*N"] = tensor(role=NODE, pad=0)
    table: Int64[torch.Tensor, "B N"] = tensor(role=REQ, pad=0)
    opt: Float32[torch.Tensor, "B H"] | None = tensor(role=REQ, pad=0.0, default=None)
    host_lens: Int64[torch.Tensor, "B"] | None = tensor(role=REQ, pad=0, host=True, default=None)
    steps: int = value(default=3)

    @invariant("ids are non-negative")
    def _nonneg(self):
        return None if bool((self.ids >= 0).all()) else f"ids {self.ids.tolist()}"


def toy(B=4, K=2, N=3, **over):
    fields = dict(
        ids=torch.arange(B),
        scores=torch.rand(B, K),
        per_node=torch.zeros(B * N, dtype=torch.int64),
        table=torch.zeros(B, N, dtype=torch.int64),
    )
    fields.update(over)
    return Toy(**fields)


def test_valid_instance_binds_every_dim():
    assert toy().validate() == {"B": 4, "K": 2, "N": 3}


def test_wrong_dtype_names_schema_field_and_dtypes():
    with pytest.raises(SchemaViolation) as err:
        toy(ids=torch.arange(4, dtype=torch.int32)).validate()
    e = err.value
    assert (e.schema, e.field) == ("Toy", "ids")
    assert "int64" in e.expected and "int32" in e.actual
    assert str(e).startswith("Toy.ids: expected dtype int64, got dtype int32")


def test_wrong_rank():
    with pytest.raises(SchemaViolation, match=r"Toy.scores: expected shape \[B K\] \(2 dims\), got shape \[4\]"):
        toy(scores=torch.rand(4)).validate()


def test_inconsistent_batch_dim_across_fields():
    with pytest.raises(SchemaViolation) as err:
        toy(scores=torch.rand(5, 2)).validate()
    assert err.value.field == "scores"
    assert "B=4" in err.value.expected and "bound by field 'ids'" in err.value.expected
    assert "B=5" in err.value.actual


def test_product_dim_is_solved_and_checked():
    # N is bound by `table`, so per_node must have B*N = 12 rows.
    with pytest.raises(SchemaViolation, match="B\\*N=12"):
        toy(per_node=torch.zeros(11, dtype=torch.int64)).validate()


def test_product_dim_alone_must_divide():
    @schema
    class OnlyNodes(Schema):
        b: Int64[torch.Tensor, "B"] = tensor()
        n: Int64[torch.Tensor, "B*N"] = tensor()

    assert OnlyNodes(b=torch.zeros(3, dtype=torch.int64), n=torch.zeros(6, dtype=torch.int64)).validate() == {"B": 3, "N": 2}
    with pytest.raises(SchemaViolation, match="a multiple of 3"):
        OnlyNodes(b=torch.zeros(3, dtype=torch.int64), n=torch.zeros(7, dtype=torch.int64)).validate()
    # an empty batch (B=0) is legal and leaves N free
    assert OnlyNodes(b=torch.zeros(0, dtype=torch.int64), n=torch.zeros(0, dtype=torch.int64)).validate() == {"B": 0}


def test_optional_field_may_be_none_but_is_checked_when_set():
    toy(opt=None).validate()
    toy(opt=torch.rand(4, 7)).validate()
    with pytest.raises(SchemaViolation, match="Toy.opt"):
        toy(opt=torch.rand(3, 7)).validate()


def test_not_a_tensor():
    with pytest.raises(SchemaViolation, match="got list"):
        toy(ids=[0, 1, 2, 3]).validate()


def test_required_field_none():
    with pytest.raises(SchemaViolation, match="Toy.ids: expected a tensor int64\\[B\\], got None"):
        toy(ids=None).validate()


def test_device_mismatch_with_machine_device():
    with pytest.raises(SchemaViolation) as err:
        toy().validate(device="meta")
    assert "device meta" in err.value.expected and "device cpu" in err.value.actual


def test_device_mismatch_between_fields():
    with pytest.raises(SchemaViolation, match="device cpu \\(as set by field 'ids'\\)"):
        toy(scores=torch.rand(4, 2, device="meta")).validate()


def test_host_field_must_be_on_cpu():
    toy(host_lens=torch.zeros(4, dtype=torch.int64)).validate()
    with pytest.raises(SchemaViolation, match="host \\(cpu\\) tensor"):
        toy(host_lens=torch.zeros(4, dtype=torch.int64, device="meta")).validate()


def test_value_field_type_is_checked():
    with pytest.raises(SchemaViolation, match="Toy.steps: expected int, got str"):
        toy(steps="3").validate()


def test_invariants_run_in_strict_mode_only():
    bad = toy(ids=torch.tensor([0, -1, 2, 3]))
    with pytest.raises(InvariantViolation) as err:
        bad.validate("strict")
    assert err.value.invariant == "ids are non-negative"
    bad.validate("boundary")
    assert bad.validate("off") == {}


def test_role_and_shape_must_agree_at_declaration():
    with pytest.raises(InvalidSchema, match="role 'node', so its first dim must be 'B\\*N'"):

        @schema
        class Bad(Schema):
            x: Int64[torch.Tensor, "B N"] = tensor(role=NODE, pad=0)


def test_schemas_are_frozen_and_replace_copies():
    t = toy()
    with pytest.raises(AttributeError):
        t.ids = torch.arange(4)  # type: ignore[misc]
    t2 = t.replace(steps=5)
    assert t2.steps == 5 and t.steps == 3 and t2.ids is t.ids


def test_summary_and_repr_never_read_values():
    """On meta tensors (shapes and dtypes, no values: any read raises) summary, repr and
    batch_size still work."""
    meta = dict(device="meta")
    t = toy(ids=torch.empty(4, dtype=torch.int64, **meta), scores=torch.empty(4, 2, **meta),
            per_node=torch.empty(12, dtype=torch.int64, **meta), table=torch.empty(4, 3, dtype=torch.int64, **meta))
    assert all(x.is_meta for _, x in t.tensors())
    assert t.summary() == "Toy(B=4, K=2, N=3)"
    assert "ids=int64[4]@meta" in repr(t)
    assert t.batch_size == 4


def test_the_generated_fast_check_accepts_what_the_reporting_path_accepts():
    """check_fields tries the generated straight-line check first and falls back to the
    reporting path only on a mismatch; a fast check that refused a valid instance would make
    every boundary check slow without failing any other test."""
    from phasegraph.statemachine.schema import _check_fields_reporting

    spec = Toy.__schema__
    valid = [toy(), toy(B=1, K=5, N=2), toy(opt=torch.rand(4, 7)),
             toy(host_lens=torch.zeros(4, dtype=torch.int64))]
    for obj in valid:
        assert spec.fast_check(obj, None) == _check_fields_reporting(obj, spec, None)
    assert spec.fast_check(toy(), "cpu") == {"B": 4, "K": 2, "N": 3}
    invalid = [toy(ids=torch.arange(4, dtype=torch.int32)), toy(scores=torch.rand(5, 2)),
               toy(per_node=torch.zeros(11, dtype=torch.int64)),
               toy(host_lens=torch.zeros(4, dtype=torch.int64, device="meta"))]
    for obj in invalid:
        assert spec.fast_check(obj, None) is None
        with pytest.raises(SchemaViolation):
            _check_fields_reporting(obj, spec, None)


def test_batch_size_reads_the_first_set_field_that_leads_with_the_batch_dim():
    assert Toy.__schema__.batch_fields == ("ids", "scores", "table", "opt", "host_lens")
    assert toy(B=6).batch_size == 6


def _declare(annotation, **field):
    return schema(type("S", (Schema,), {"__annotations__": {"x": annotation}, "x": tensor(**field)}))


def test_shapes_schemas_cannot_check_are_refused_at_declaration():
    """'...' was read as the expression Ellipsis (every tensor then failed with "...=Ellipsis"),
    'B[0]' and 'foo()' failed at check time with a raw TypeError."""
    for shape, why in [("B ...", "'...': variadic dims are not supported"),
                       ("*B", "'\\*B': variadic dims are not supported"),
                       ("#B", "'#B': broadcastable dims are not supported"),
                       ("B B[0]", "'B\\[0\\]': a dim is _, an integer, a name, or \\+, -, \\*, // over"),
                       ("foo()", "'foo\\(\\)': a dim is _"),
                       ("B=3", "'B=3' is not a dim")]:
        with pytest.raises(InvalidSchema, match=f"field 'x': cannot parse shape .*: {why}"):
            _declare(Float32[torch.Tensor, shape])


def test_a_division_by_zero_in_a_dim_is_a_schema_violation():
    """Was a raw ZeroDivisionError from the generated check."""
    S = _declare(Float32[torch.Tensor, "B N B//N"])
    assert S(x=torch.zeros(4, 2, 2)).validate() == {"B": 4, "N": 2}
    with pytest.raises(SchemaViolation, match="S.x: expected B//N on axis 2 to be defined, got a division by zero"):
        S(x=torch.zeros(4, 0, 2)).validate()


def test_declarations_that_failed_deep_in_typing_or_jaxtyping_are_invalid_schemas():
    from jaxtyping import Shaped

    S = _declare(Shaped[torch.Tensor, "B"])  # any dtype (was a raw TypeError from jaxtyping's _AnyDtype)
    S(x=torch.zeros(2, dtype=torch.bool)).validate()
    with pytest.raises(InvalidSchema, match="field 'x': a union of array types is not supported"):
        _declare(Float32[torch.Tensor, "B"] | Int64[torch.Tensor, "B"])  # was: an unchecked value
    with pytest.raises(InvalidSchema, match="field 'x' is annotated with ndarray; schema tensors are torch.Tensor"):
        _declare(Float32[np.ndarray, "B"])
    with pytest.raises(InvalidSchema, match="its annotations cannot be resolved \\(NameError: name 'Nope'"):
        schema(type("S", (Schema,), {"__annotations__": {"x": "Nope"}, "x": value()}))
    with pytest.raises(InvalidSchema, match="schema 3 is declared wrongly:\n  - a schema must subclass"):
        schema(3)  # was: TypeError: issubclass() arg 1 must be a class


def test_validate_checks_the_fields_of_nested_schemas():
    """A nested schema of the wrong dtype passed validate() (only its batch size was compared)."""
    from phasegraph.testing import synthetic as syn

    state = syn.draft_state(2)
    state.validate()
    bad = state.replace(params=state.params.replace(seed=torch.zeros(2)))
    with pytest.raises(SchemaViolation, match="BatchParams.seed: expected dtype int64, got dtype float32"):
        bad.validate("boundary")


def test_an_invariant_that_cannot_read_its_values_is_an_invariant_violation():
    """On sparse or meta tensors torch's own error escaped from the invariant."""
    @schema
    class Sparse(Schema):
        ids: Int64[torch.Tensor, "B"] = tensor()

        @invariant("ids are sorted")
        def _sorted(self):
            return None if bool((self.ids[1:] >= self.ids[:-1]).all()) else "unsorted"

    with pytest.raises(InvariantViolation, match="expected invariant 'ids are sorted', got could not be checked \\(NotImplementedError"):
        Sparse(ids=torch.arange(4).to_sparse()).validate("strict")
    meta = Sparse(ids=torch.empty(4, dtype=torch.int64, device="meta"))
    meta.validate("boundary")
    with pytest.raises(InvariantViolation, match="could not be checked"):
        toy(ids=torch.empty(4, dtype=torch.int64, device="meta"), scores=torch.empty(4, 2, device="meta"),
            per_node=torch.empty(12, dtype=torch.int64, device="meta"),
            table=torch.empty(4, 3, dtype=torch.int64, device="meta")).validate("strict")


def test_validate_refuses_a_device_or_mode_it_does_not_know():
    from phasegraph.statemachine import InvalidValidationMode, PhaseGraphError

    with pytest.raises(PhaseGraphError, match="device 'cuda:x' is not a usable torch device \\(Invalid device string"):
        toy().validate(device="cuda:x")  # was: a raw RuntimeError from torch.device
    with pytest.raises(InvalidValidationMode, match="unknown validation mode 'sometimes'"):
        toy().validate("sometimes")
