"""Schema declaration and checking: dtype, shape, symbolic dims, device, roles, invariants."""

from __future__ import annotations

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
    ids: Int64[torch.Tensor, "B"] = tensor(role=REQ)
    scores: Float32[torch.Tensor, "B K"] = tensor(role=REQ)
    per_node: Int64[torch.Tensor, "B*N"] = tensor(role=NODE)
    table: Int64[torch.Tensor, "B N"] = tensor(role=REQ)
    opt: Float32[torch.Tensor, "B H"] | None = tensor(role=REQ, default=None)
    host_lens: Int64[torch.Tensor, "B"] | None = tensor(role=REQ, host=True, default=None)
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
            x: Int64[torch.Tensor, "B N"] = tensor(role=NODE)


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
