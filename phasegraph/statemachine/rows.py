"""Row operations on batch schemas, driven by each field's declared role and padding.

A schema's tensor fields say what their leading dim indexes (a :class:`Role`) and what a
padded request's rows hold (a :class:`Pad`). From those declarations alone this module selects
rows (filter, retract), concatenates batches (merge) and pads a batch up to a fixed size (CUDA
graph buckets), so a field added to a schema is carried by all of them without another edit:
the class of SGLang #26866, where a per-request side output was copied field by field and one
place forgot it.

Row numbers that a field holds (``Pad.index``) point into the request's own block of another
role's rows; selection and concatenation renumber them, padding points them into the padded
request's own block. torch is imported where it is used (the statemachine package loads without).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phasegraph.statemachine.errors import PaddingViolation, PhaseGraphError
from phasegraph.statemachine.schema import Pad, Role, Schema, _TensorSpec, child_schemas


def batch_of(obj: Schema) -> int:
    """The number of requests in ``obj`` (0 where no field leads with the batch dim)."""
    return obj.batch_size or 0


def role_rows(obj: Schema, role: Role) -> int | None:
    """Rows of ``role``'s fields in ``obj`` or a schema nested in it (None: no such field set)."""
    for t in type(obj).__schema__.tensors:
        x = getattr(obj, t.name)
        if x is not None and t.role == role:
            return int(x.shape[0])
    for inner in child_schemas(obj):
        rows = role_rows(inner, role)
        if rows is not None:
            return rows
    return None


def rows_per_request(obj: Schema, role: Role, batch: int) -> int:
    """How many rows of ``role`` one request of ``obj`` (``batch`` requests) owns."""
    if role.leading == type(obj).__batch_dim__:
        return 1
    rows = role_rows(obj, role)
    if rows is None or batch <= 0:
        raise PhaseGraphError(
            f"{type(obj).__name__}: cannot tell how many {role.name} rows a request owns "
            f"(no {role.name} field is set, or the batch is empty)"
        )
    return rows // batch


def _private_dims(spec) -> set[str]:
    """Dims named by exactly one tensor field of a schema: that field's own width."""
    seen: dict[str, int] = {}
    for t in spec.tensors:
        for d in {d.text for d in t.dims[1:] if d.kind == "name"}:
            seen[d] = seen.get(d, 0) + 1
    return {d for d, n in seen.items() if n == 1}


# ----------------------------------------------------------------------------- padding values


def pad_values(t: _TensorSpec, like: Any, owners: Any, per_index: int | None) -> Any:
    """The values of padded rows of field ``t``: a tensor shaped and typed like ``like``
    ``[M, ...]``, row ``m`` belonging to padded request ``owners[m]`` ``[M]``. ``per_index``:
    rows of the indexed role per request, for ``Pad.index`` fields."""
    import torch

    pad: Pad = t.pad  # type: ignore[assignment]
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    if pad.kind in ("fill", "sink"):
        return out.fill_(pad.fill)
    if pad.kind == "uniform":
        return out.fill_(1.0 / max(like.shape[-1], 1))
    if pad.kind == "identity":
        out.zero_()
        out.diagonal(dim1=-2, dim2=-1).fill_(1)
        return out
    # "index": the padded request's own block of the indexed role's rows, column by column
    if not per_index:
        raise PhaseGraphError(f"field {t.name!r} numbers {pad.indexes.name} rows, but there are none to point into")
    base = owners.to(device=like.device, dtype=like.dtype) * per_index  # [M]
    if like.dim() == 1:
        return out.copy_(base)
    cols = torch.arange(like.shape[1], device=like.device, dtype=like.dtype) % per_index  # [C]
    return out.copy_(base[:, None] + cols[None, :])


def padding_plan(static: Schema, batch: int) -> list[tuple[str, Any, Any]]:
    """For a padded instance ``static`` whose first ``batch`` requests are real: (field path,
    padded rows of the static buffer, their values) for every role field of ``static`` and of
    the schemas nested in it. Copying the values into the rows pads the instance."""
    bucket = batch_of(static)
    plan: list[tuple[str, Any, Any]] = []
    import torch

    def visit(obj: Schema, path: str, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for t in type(obj).__schema__.tensors:
            x = getattr(obj, t.name)
            if x is None or t.role is None:
                continue
            per = x.shape[0] // bucket
            rows = x[batch * per:]
            if rows.shape[0] == 0:
                continue
            owners = torch.arange(batch * per, bucket * per, device=x.device) // per  # [M]
            per_index = rows_per_request(static, t.pad.indexes, bucket) if t.pad.kind == "index" else None
            plan.append((f"{path}{t.name}", rows, pad_values(t, rows, owners, per_index)))
        for v in type(obj).__schema__.values:
            inner = getattr(obj, v.name)
            if v.nested and inner is not None:
                visit(inner, f"{path}{v.name}.", seen)

    visit(static, "", set())
    return plan


def check_padding(static: Schema, batch: int, where: str = "",
                  live_rows: Callable[[Role], int] | None = None) -> None:
    """Raise :class:`PaddingViolation` where a padded request's row of ``static`` addresses a
    live request: a ``Pad.index`` value among the live rows of the role it numbers, or a
    ``Pad.sink`` field whose padded rows leave the sink or whose live rows hold it.

    The first ``batch`` requests are live; ``live_rows(role)`` says how many rows of a role
    they own (default: ``batch`` times the rows per request; a ragged layout passes its own).
    Reads values: call it when a graph is planned or captured, not on every replay."""
    bucket = batch_of(static)
    if live_rows is None:
        def live_rows(role: Role) -> int:
            return batch * rows_per_request(static, role, bucket)

    def visit(obj: Schema, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        name = type(obj).__name__
        for t in type(obj).__schema__.tensors:
            x = getattr(obj, t.name)
            if x is None or t.role is None or t.pad.kind not in ("index", "sink"):
                continue
            n = live_rows(t.role)
            live, padded = x[:n], x[n:]
            if t.pad.kind == "sink":
                sink = t.pad.fill
                if bool((padded != sink).any()):
                    raise PaddingViolation(name, t.name, where, f"padded rows hold {padded.unique().tolist()}, "
                                           f"not the reserved row {sink}")
                if bool((live == sink).any()):
                    raise PaddingViolation(name, t.name, where, f"a live request holds the reserved row {sink}")
                continue
            first = live_rows(t.pad.indexes)
            bad = (padded >= 0) & (padded < first)
            if bool(bad.any()):
                raise PaddingViolation(
                    name, t.name, where,
                    f"a padded row holds {t.pad.indexes.name} row {int(padded[bad][0])}, one of the "
                    f"{first} live {t.pad.indexes.name} rows",
                )
        for inner in child_schemas(obj):
            visit(inner, seen)

    visit(static, set())


# ----------------------------------------------------------------------------- select and concat


def select_rows(obj: Schema, rows: Any) -> Schema:
    """A new instance of ``obj``'s schema holding requests ``rows`` [R] (in that order), and
    the same of every schema nested in it; role-less fields and plain values are kept."""
    batch = batch_of(obj)
    return _select(obj, obj, rows, batch)


def _select(obj: Schema, root: Schema, rows: Any, batch: int) -> Schema:
    fields: dict[str, Any] = {}
    for t in type(obj).__schema__.tensors:
        x = getattr(obj, t.name)
        if x is None or t.role is None:
            fields[t.name] = x
            continue
        per = x.shape[0] // batch if batch else 1
        picked = _pick(x, rows, per)
        if t.pad.kind == "index":
            picked = _renumber(picked, rows, per, rows_per_request(root, t.pad.indexes, batch))
        fields[t.name] = picked
    for v in type(obj).__schema__.values:
        inner = getattr(obj, v.name)
        fields[v.name] = _select(inner, root, rows, batch) if v.nested and inner is not None else inner
    return type(obj)(**fields)


def _pick(x: Any, rows: Any, per: int) -> Any:
    if per == 1:
        return x[rows]
    return x.view(-1, per, *x.shape[1:])[rows].reshape(-1, *x.shape[1:])


def _renumber(values: Any, rows: Any, per: int, per_index: int) -> Any:
    """Row numbers of the selected requests' own blocks, moved to their new places."""
    import torch

    new_owner = torch.arange(len(rows), device=values.device).repeat_interleave(per)  # [R*per]
    old_owner = rows.to(values.device).repeat_interleave(per)
    shift = ((new_owner - old_owner) * per_index).view(-1, *([1] * (values.dim() - 1)))
    return torch.where(values >= 0, values + shift, values)


def concat_rows(a: Schema, b: Schema) -> Schema:
    """``a``'s requests followed by ``b``'s, field by field from the declarations.

    A width private to one field (the ``Z`` of a -1 padded list of stop ids) widens to the
    larger with the field's pad; any other difference of shape is refused. An optional field
    set on one side only is taken from it when the other side is empty, dropped when declared
    ``per_step``, filled with its pad on the other side when declared ``absent_is_pad``, and
    refused otherwise. Plain values must agree.
    """
    if type(a) is not type(b):
        raise PhaseGraphError(f"cannot concatenate a {type(a).__name__} with a {type(b).__name__}")
    return _concat(a, b, a, b, batch_of(a), batch_of(b))


def _concat(a: Schema, b: Schema, root_a: Schema, root_b: Schema, na: int, nb: int) -> Schema:
    import torch

    spec = type(a).__schema__
    name = spec.name
    private = _private_dims(spec)
    fields: dict[str, Any] = {}
    for t in spec.tensors:
        x, y = getattr(a, t.name), getattr(b, t.name)
        if x is None or y is None:
            fields[t.name] = _one_sided(name, t, x, y, na, nb)
            continue
        if t.role is None:
            raise PhaseGraphError(f"cannot concatenate {name}.{t.name}: it has no role (its rows are not requests)")
        x, y = _same_width(name, t, x, y, private)
        if t.pad.kind == "index" and na:
            per_index = rows_per_request(root_a, t.pad.indexes, na)
            y = torch.where(y >= 0, y + na * per_index, y)
        fields[t.name] = torch.cat([x, y])
    for v in spec.values:
        x, y = getattr(a, v.name), getattr(b, v.name)
        if v.nested and x is not None and y is not None:
            fields[v.name] = _concat(x, y, root_a, root_b, na, nb)
        elif x == y or x is y:
            fields[v.name] = x
        else:
            raise PhaseGraphError(f"cannot concatenate {name}s whose {v.name} differ ({x!r} and {y!r})")
    return type(a)(**fields)


def _one_sided(name: str, t: _TensorSpec, x: Any, y: Any, na: int, nb: int) -> Any:
    """An optional field set on at most one side: the set side's rows where the other side
    has none, nothing where the set side has none or the field is ``per_step``, the set side's
    rows beside pad rows for the other where it is ``absent_is_pad``."""
    if (x is None and y is None) or t.per_step:
        return None
    if x is None:
        if na == 0:
            return y
        if nb == 0:
            return None
    elif nb == 0:
        return x
    elif na == 0:
        return None
    if t.absent_is_pad:
        import torch

        have, have_n, lacking_n = (x, na, nb) if x is not None else (y, nb, na)
        rows = have.shape[0] // have_n * lacking_n
        filled = have.new_full((rows, *have.shape[1:]), t.pad.fill)
        return torch.cat([have, filled] if x is not None else [filled, have])
    raise PhaseGraphError(
        f"cannot concatenate {name}s: {t.name} is set in one batch and not in the other "
        "(they come from different drafts or configurations)"
    )


def _same_width(name: str, t: _TensorSpec, x: Any, y: Any, private: set[str]) -> tuple[Any, Any]:
    if x.shape[1:] == y.shape[1:]:
        return x, y
    widen = (x.dim() == 2 and t.dims[1].text in private and t.pad.kind == "fill")
    if not widen:
        dims = " ".join(d.text for d in t.dims[1:])
        raise PhaseGraphError(
            f"cannot concatenate {name}s whose {t.name} [{t.dims[0].text} {dims}] differ: "
            f"{list(x.shape[1:])} and {list(y.shape[1:])} (another topk or tree shape)"
        )
    width = max(x.shape[1], y.shape[1])
    return _widen(x, width, t.pad.fill), _widen(y, width, t.pad.fill)


def _widen(x: Any, width: int, fill: Any) -> Any:
    import torch

    if x.shape[1] == width:
        return x
    return torch.cat([x, x.new_full((x.shape[0], width - x.shape[1]), fill)], dim=1)

