"""Typed schemas for the values that cross phase boundaries.

A schema is an attrs class (``frozen=True, eq=False``) whose tensor fields carry jaxtyping
annotations (``Int64[torch.Tensor, "B N"]``). :func:`schema` compiles those annotations once into
a fast checker: dtype, rank, symbolic dimensions unified across every field of one instance (one
``B`` for all of them), device (every compute tensor on one device; ``host=True`` fields on the
CPU), and the field's role (its leading dimension). Value-level invariants are methods marked
with :func:`invariant`; they run only in strict mode because they read tensor values.

This module is generic: it knows nothing of speculative decoding. torch is imported lazily so
that the pytest plugin can load the package without it.
"""

from __future__ import annotations

import ast
import re
import typing
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import attrs

from phasegraph.statemachine.errors import (
    InvalidSchema,
    InvariantViolation,
    PhaseGraphError,
    SchemaViolation,
    one_line,
)
from phasegraph.statemachine.modes import ValidationMode

_META_KEY = "phasegraph"


@attrs.frozen
class Role:
    """What a tensor's leading dimension indexes, e.g. one row per request (``"B"``)."""

    name: str
    leading: str  # the dim token the first axis must carry, e.g. "B" or "B*N"


@attrs.frozen
class Pad:
    """What the rows of a padded request hold in a field, when a batch of ``B`` requests is
    padded up to a larger fixed size (a captured CUDA graph's bucket). Declared on every field
    that has a role, so that no padded row takes a default that happens to address a live one
    (vLLM #43682's class: padded graph rows that read or wrote another request's state).

    - ``Pad.fill(v)``: the constant ``v``;
    - ``Pad.index(role)``: the field holds row numbers of ``role``'s fields (a request's own
      block of them): a padded request ``b`` points into its own block, ``b * per + column``,
      never at a live request's rows;
    - ``Pad.sink(v)``: the field holds rows of a table outside the batch in which row ``v`` is
      reserved for padding: every padded row holds ``v``, and no live row may;
    - ``Pad.IDENTITY``: an identity matrix over the last two dims (a tree that sees only itself);
    - ``Pad.UNIFORM``: ``1 / size`` of the last dim (a valid distribution).
    """

    kind: str  # "fill" | "index" | "sink" | "identity" | "uniform"
    fill: Any = 0
    indexes: Role | None = None

    @classmethod
    def constant(cls, value: Any) -> Pad:
        return cls("fill", value)

    @classmethod
    def index(cls, role: Role) -> Pad:
        return cls("index", -1, role)

    @classmethod
    def sink(cls, row: int) -> Pad:
        return cls("sink", row)


Pad.IDENTITY = Pad("identity")  # type: ignore[attr-defined]
Pad.UNIFORM = Pad("uniform")  # type: ignore[attr-defined]


@attrs.frozen
class _FieldMeta:
    role: Role | None
    host: bool
    doc: str
    pad: Pad | None = None
    per_step: bool = False
    absent_is_pad: bool = False


def tensor(
    *,
    role: Role | None = None,
    pad: Pad | Any = None,
    host: bool = False,
    per_step: bool = False,
    absent_is_pad: bool = False,
    doc: str = "",
    default: Any = attrs.NOTHING,
) -> Any:
    """Declare a tensor field. ``host=True`` marks a CPU-side tensor (reading it never syncs).

    A field with a ``role`` (its leading dim indexes requests, nodes, tokens, ...) must say what
    a padded request's rows hold: ``pad=`` a :class:`Pad`, or a plain number or bool for
    ``Pad.constant``. ``per_step=True`` marks an optional output of the last phase only (not
    state): concatenating a batch that has it with one that has not drops it instead of
    refusing. ``absent_is_pad=True`` marks an optional field whose absence means its constant
    pad in every row (state of a feature no request of that batch uses, such as zero token
    counts): concatenating a batch that has it with one that has not gives the other's rows
    the pad.
    """
    if pad is not None and not isinstance(pad, Pad):
        pad = Pad.constant(pad)
    meta = _FieldMeta(role, host, doc, pad, per_step, absent_is_pad)
    return attrs.field(default=default, metadata={_META_KEY: meta})


def value(*, doc: str = "", default: Any = attrs.NOTHING) -> Any:
    """Declare a non-tensor field (int, float, enum, ...)."""
    return attrs.field(default=default, metadata={_META_KEY: _FieldMeta(None, False, doc)})


def invariant(name: str) -> Callable[[Callable], Callable]:
    """Mark a method ``(self) -> str | None`` as a strict-mode invariant.

    The method returns ``None`` when the invariant holds, otherwise a description of what failed.
    """

    def mark(fn: Callable) -> Callable:
        fn.__phasegraph_invariant__ = name  # type: ignore[attr-defined]
        return fn

    return mark


# ----------------------------------------------------------------------------- compiled specs

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INT = re.compile(r"^[0-9]+$")


@attrs.frozen
class _Dim:
    text: str
    kind: str  # "int" | "name" | "expr" | "any"
    size: int = -1
    code: Any = None
    names: tuple[str, ...] = ()
    factors: tuple[str, ...] | None = None  # set when the expr is a pure product of names/ints


_DIM_OPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)


def _is_dim_expr(node: ast.AST) -> bool:
    """Whether ``node`` is integer arithmetic (+, -, *, //) over dim names and integers."""
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _DIM_OPS) and _is_dim_expr(node.left) and _is_dim_expr(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.USub) and _is_dim_expr(node.operand)
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    return isinstance(node, ast.Name)


def _parse_dim(token: str) -> _Dim:
    """One dim of a shape string; ``ValueError`` (the reason) for what schemas do not support."""
    if token == "_":
        return _Dim(token, "any")
    if _INT.match(token):
        return _Dim(token, "int", size=int(token))
    if _NAME.match(token):
        return _Dim(token, "name")
    if token.startswith(("*", "...")):
        raise ValueError(f"{token!r}: variadic dims are not supported (a schema fixes every rank)")
    if token.startswith("#"):
        raise ValueError(f"{token!r}: broadcastable dims are not supported")
    try:
        tree = ast.parse(token, mode="eval")
    except SyntaxError:
        raise ValueError(f"{token!r} is not a dim") from None
    if not _is_dim_expr(tree.body):
        raise ValueError(
            f"{token!r}: a dim is _, an integer, a name, or +, -, *, // over names and integers"
        )
    code = compile(token, f"<dim {token}>", "eval")
    factors = tuple(f.strip() for f in token.split("*"))
    pure_product = all(_NAME.match(f) or _INT.match(f) for f in factors)
    return _Dim(token, "expr", code=code, names=code.co_names, factors=factors if pure_product else None)


@attrs.frozen(kw_only=True)
class _TensorSpec(_FieldMeta):
    """A tensor field: what :func:`tensor` declared, plus its compiled annotation."""

    name: str
    dtypes: frozenset | None  # of torch.dtype; None = any
    dtype_text: str
    dims: tuple[_Dim, ...]
    dim_text: str
    optional: bool


@attrs.frozen
class _ValueSpec:
    name: str
    types: tuple[type, ...] | None  # for isinstance; None = unchecked
    type_text: str
    optional: bool
    doc: str
    nested: bool = False  # the value is itself a Schema instance


@attrs.frozen
class CompiledSchema:
    name: str
    tensors: tuple[_TensorSpec, ...]
    values: tuple[_ValueSpec, ...]
    invariants: tuple[tuple[str, Callable], ...]
    fast_check: Callable[[Any, Any], dict[str, int] | None] | None = None
    batch_fields: tuple[str, ...] = ()  # tensor fields whose first dim is the batch dim, in order

    def field_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.tensors) + tuple(s.name for s in self.values)


_JAX_DTYPE_GROUPS = {
    "float": ("bfloat16", "float16", "float32", "float64"),
    "int": ("int8", "int16", "int32", "int64", "uint8"),
    "uint": ("uint8",),
    "bool": ("bool",),
}


def _torch_dtypes(names: tuple[str, ...]) -> frozenset | None:
    import torch

    result = set()
    for n in names:
        if n in ("any",):
            return None
        for m in _JAX_DTYPE_GROUPS.get(n, (n,)):
            dt = getattr(torch, m, None)
            if isinstance(dt, torch.dtype):
                result.add(dt)
    return frozenset(result)


def _is_array_annotation(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "dim_str") and hasattr(tp, "dtypes")


def _split_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), True  # noqa: UP007
    return tp, False


_PAD_KINDS = ("fill", "index", "sink", "identity", "uniform")


def _pad_problems(name: str, meta: _FieldMeta, dims: list[str]) -> list[str]:
    """What is wrong with a field's padding declaration ([] = nothing)."""
    pad = meta.pad
    if meta.role is None:
        return [f"field {name!r} declares pad= but no role: only rows of a role are padded"] if pad else []
    if pad is None:
        return [
            f"field {name!r} has role {meta.role.name!r} but declares no pad=: say what a padded "
            "request's rows hold (e.g. pad=0, pad=Pad.index(REQUEST) for a row number, "
            "pad=Pad.sink(0) for a reserved outside row)"
        ]
    if pad.kind not in _PAD_KINDS:
        return [f"field {name!r}: unknown pad kind {pad.kind!r} (one of {', '.join(_PAD_KINDS)})"]
    if pad.kind == "index" and not isinstance(pad.indexes, Role):
        return [f"field {name!r}: Pad.index takes the Role whose rows the field numbers"]
    if pad.kind == "index" and len(dims) > 2:
        return [f"field {name!r}: Pad.index fields have one or two dims, not {len(dims)}"]
    if pad.kind == "identity" and len(dims) < 3:
        return [f"field {name!r}: Pad.IDENTITY needs two dims past the leading one"]
    if meta.absent_is_pad and (pad.kind != "fill" or meta.per_step):
        return [f"field {name!r}: absent_is_pad needs a constant pad (Pad.constant) and no per_step"]
    return []


def _compile(cls: type) -> CompiledSchema:
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception as exc:  # an annotation that names what the module does not define
        raise InvalidSchema(cls.__name__, [
            f"its annotations cannot be resolved ({type(exc).__name__}: {exc}); a name used in "
            "an annotation must be importable from the schema's module"
        ]) from None
    problems: list[str] = []
    tensors: list[_TensorSpec] = []
    values: list[_ValueSpec] = []
    for f in attrs.fields(cls):
        meta: _FieldMeta = f.metadata.get(_META_KEY) or _FieldMeta(None, False, "")
        tp, optional = _split_optional(hints.get(f.name, Any))
        if any(_is_array_annotation(a) for a in typing.get_args(tp)):
            problems.append(
                f"field {f.name!r}: a union of array types is not supported; declare one "
                "jaxtyping annotation (optionally | None)"
            )
            continue
        if _is_array_annotation(tp):
            dim_text = tp.dim_str
            tokens = dim_text.split()
            try:
                dims = tuple(_parse_dim(t) for t in tokens)
            except ValueError as why:
                problems.append(f"field {f.name!r}: cannot parse shape {dim_text!r}: {why}")
                continue
            import torch  # only schemas with tensor fields need it

            array_type = getattr(tp, "array_type", torch.Tensor)
            if array_type is not torch.Tensor:
                problems.append(
                    f"field {f.name!r} is annotated with {getattr(array_type, '__name__', array_type)}; "
                    "schema tensors are torch.Tensor"
                )
                continue
            if meta.role is not None and (not tokens or tokens[0] != meta.role.leading):
                problems.append(
                    f"field {f.name!r} has role {meta.role.name!r}, so its first dim must be "
                    f"{meta.role.leading!r}, but its shape is {dim_text!r}"
                )
            problems += _pad_problems(f.name, meta, tokens)
            if meta.absent_is_pad and not optional:
                problems.append(f"field {f.name!r} declares absent_is_pad but is not optional (| None)")
            # jaxtyping's Shaped (any dtype) carries no list of dtype names
            names = tuple(tp.dtypes) if isinstance(tp.dtypes, (tuple, list)) else ("any",)
            dtypes = _torch_dtypes(names)
            tensors.append(
                _TensorSpec(
                    name=f.name, dtypes=dtypes, dtype_text="|".join(names), dims=dims,
                    dim_text=dim_text, optional=optional, **attrs.asdict(meta, recurse=False),
                )
            )
        else:
            if meta.role is not None or meta.host or meta.pad is not None:
                problems.append(f"field {f.name!r} has a tensor role but no jaxtyping annotation")
            checkable = tp if isinstance(tp, type) and tp is not Any else None
            types = (checkable,) if checkable is not None else None
            if types == (float,):
                types = (float, int)
            type_text = getattr(tp, "__name__", str(tp))
            nested = checkable is not None and issubclass(checkable, Schema)
            values.append(_ValueSpec(f.name, types, type_text, optional, meta.doc, nested))
    if problems:
        raise InvalidSchema(cls.__name__, problems)
    invariants = []
    seen: set[str] = set()
    for klass in reversed(cls.__mro__):
        for attr_name, fn in vars(klass).items():
            label = getattr(fn, "__phasegraph_invariant__", None)
            if label is not None and attr_name not in seen:
                seen.add(attr_name)
                invariants.append((label, fn))
    batch_fields = tuple(t.name for t in tensors if t.dims and t.dims[0].text == cls.__batch_dim__)
    spec = CompiledSchema(cls.__name__, tuple(tensors), tuple(values), tuple(invariants),
                          batch_fields=batch_fields)
    return attrs.evolve(spec, fast_check=_generate_fast_check(spec, cls.__batch_dim__))


def _generate_fast_check(
    spec: CompiledSchema, batch_dim: str
) -> Callable[[Any, Any], dict[str, int] | None]:
    """Generate straight-line code that checks ``spec`` and returns the bound dims, or ``None`` at
    the first mismatch (:func:`check_fields` then finds and reports the problem).

    The checks are the same as :func:`check_fields`'; only the error reporting is left out, which
    makes a boundary check of a typical schema a few microseconds.
    """
    import torch

    names = sorted({d.text for t in spec.tensors for d in t.dims if d.kind == "name"}
                   | {n for t in spec.tensors for d in t.dims if d.kind == "expr" for n in d.names})
    var = {n: f"v_{i}" for i, n in enumerate(names)}
    env: dict[str, Any] = {"Tensor": torch.Tensor, "torch_device": torch.device}
    lines = ["def fast_check(obj, device):"]
    lines += [f"    {var[n]} = -1" for n in names]
    lines.append("    dev = None if device is None else torch_device(device)")
    exprs: list[tuple[str, _Dim]] = []
    for i, t in enumerate(spec.tensors):
        lines.append(f"    x = obj.{t.name}")
        lines.append("    if x is None:")
        lines.append("        pass" if t.optional else "        return None")
        lines.append("    else:")
        body = ["if not isinstance(x, Tensor): return None"]
        if t.dtypes is not None:
            env[f"DT_{i}"] = t.dtypes
            body.append(f"if x.dtype not in DT_{i}: return None")
        body.append("s = x.shape")
        body.append(f"if len(s) != {len(t.dims)}: return None")
        for axis, d in enumerate(t.dims):
            if d.kind == "int":
                body.append(f"if s[{axis}] != {d.size}: return None")
            elif d.kind == "name":
                v = var[d.text]
                body.append(f"if {v} < 0: {v} = s[{axis}]")
                body.append(f"elif s[{axis}] != {v}: return None")
            elif d.kind == "expr":
                key = f"e_{i}_{axis}"
                body.append(f"{key} = s[{axis}]")
                exprs.append((key, d))
                lines.insert(1, f"    {key} = -1")
        if t.host:
            body.append("if not x.is_cpu: return None")
        else:
            body.append("if dev is None: dev = x.device")
            body.append("elif x.device != dev: return None")
        lines += [f"        {b}" for b in body]
    for key, d in exprs:
        unknown_ok = d.factors is not None and len(set(d.names)) == len(d.names)
        lines.append(f"    if {key} >= 0:")
        if unknown_ok:
            # a pure product: solve for at most one unbound name
            for n in d.names:
                others = [var[m] if m in var else m for m in d.factors if m != n]
                known = " * ".join(others) if others else "1"
                lines.append(f"        if {var[n]} < 0:")
                cond = " and ".join(f"{var[m]} >= 0" for m in d.names if m != n) or "True"
                lines.append(f"            if not ({cond}): return None")
                lines.append(f"            k = {known}")
                lines.append(f"            if k == 0 or {key} % k: return None")
                lines.append(f"            {var[n]} = {key} // k")
        cond = " and ".join(f"{var[n]} >= 0" for n in d.names) or "True"
        expr = d.text
        for n in sorted(d.names, key=len, reverse=True):
            expr = re.sub(rf"\b{re.escape(n)}\b", var[n], expr)
        lines.append(f"        if not ({cond}): return None")
        lines.append(f"        if {key} != ({expr}): return None")
    for j, v in enumerate(spec.values):
        lines.append(f"    y = obj.{v.name}")
        lines.append("    if y is None:")
        lines.append("        pass" if v.optional else "        return None")
        if v.types is not None:
            env[f"VT_{j}"] = v.types
            lines.append(f"    elif not isinstance(y, VT_{j}): return None")
        if v.nested:
            lines.append("    else:")
            lines.append("        inner = y.batch_size")
            batch = var.get(batch_dim)
            if batch is not None:
                lines.append(f"        if inner is not None and {batch} >= 0 and inner != {batch}: return None")
    lines.append("    out = {}")
    for n in names:
        lines.append(f"    if {var[n]} >= 0: out[{n!r}] = {var[n]}")
    lines.append("    return out")
    code = "\n".join(lines)
    exec(compile(code, f"<fast check {spec.name}>", "exec"), env)  # noqa: S102 - generated above
    return env["fast_check"]


# ----------------------------------------------------------------------------- the base class


class Schema:
    """Base of every phase schema. Subclasses are decorated with :func:`schema`."""

    __schema__: ClassVar[CompiledSchema]
    __batch_dim__: ClassVar[str] = "B"

    def validate(
        self, mode: ValidationMode | str = ValidationMode.STRICT, device: Any = None
    ) -> dict[str, int]:
        """Check this instance against its declaration; returns the bound symbolic dims.

        ``device``, when given, is the device every compute tensor must be on.
        Schemas nested in it (e.g. a state's BatchParams) are checked too.
        Raises :class:`SchemaViolation` (or :class:`InvariantViolation`) on the first problem.
        """
        mode = ValidationMode.parse(mode)
        if mode is ValidationMode.OFF:
            return {}
        device = as_device(device)
        dims = check_fields(self, type(self).__schema__, device)
        check_nested_fields(self, device)
        if mode is ValidationMode.STRICT:
            check_invariants(self, type(self).__schema__, nested=True)
        return dims

    def replace(self, **changes: Any):
        """A copy with some fields changed (schemas are frozen)."""
        return attrs.evolve(self, **changes)

    @property
    def batch_size(self) -> int | None:
        """Size of the batch dim, read from the first tensor field that leads with it."""
        for name in type(self).__schema__.batch_fields:
            x = getattr(self, name)
            if x is not None:
                return int(x.shape[0])
        return None

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """(name, tensor) for every tensor field that is set."""
        for t in type(self).__schema__.tensors:
            x = getattr(self, t.name)
            if x is not None:
                yield t.name, x

    def summary(self) -> str:
        """One line such as ``DraftState(B=64, K=4)`` (shapes only; never reads values)."""
        try:
            dims = check_fields(self, type(self).__schema__, None)
        except SchemaViolation:
            dims = {}
        inner = ", ".join(f"{k}={v}" for k, v in dims.items())
        return f"{type(self).__name__}({inner})"

    def __repr__(self) -> str:
        parts = []
        for name in type(self).__schema__.field_names():
            x = getattr(self, name)
            if hasattr(x, "shape") and hasattr(x, "dtype"):
                dtype = str(x.dtype).removeprefix("torch.")
                parts.append(f"{name}={dtype}{list(x.shape)}@{x.device}")
            else:
                parts.append(f"{name}={x!r}")
        return f"{type(self).__name__}({', '.join(parts)})"


def schema(cls: type) -> type:
    """Class decorator: make ``cls`` a frozen attrs schema and compile its field checks."""
    if not (isinstance(cls, type) and issubclass(cls, Schema)):
        shown = cls.__name__ if isinstance(cls, type) else repr(cls)
        raise InvalidSchema(shown, ["a schema must subclass phasegraph.statemachine.Schema"])
    new = attrs.frozen(eq=False, kw_only=True, repr=False)(cls)
    new.__schema__ = _compile(new)
    return new


def compiled(cls: type) -> CompiledSchema:
    return cls.__schema__


# ----------------------------------------------------------------------------- checking


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def as_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` (None stays None), or a :class:`PhaseGraphError` saying
    why torch takes no such device."""
    if device is None:
        return None
    import torch

    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        why = one_line(str(exc)) or type(exc).__name__
        raise PhaseGraphError(f"device {device!r} is not a usable torch device ({why})") from None


def check_fields(obj: Any, spec: CompiledSchema, device: Any) -> dict[str, int]:
    """Metadata checks of every field (no tensor values are read)."""
    if spec.fast_check is not None:
        try:
            found = spec.fast_check(obj, device)
        except ZeroDivisionError:  # a // dim over a zero size: the reporting path says so
            found = None
        if found is not None:
            return found
    return _check_fields_reporting(obj, spec, device)


def check_nested_fields(obj: Any, device: Any, known: frozenset[int] = frozenset()) -> None:
    """:func:`check_fields` of every schema nested in ``obj`` (depth first) except the instances
    whose ``id`` is in ``known`` (already checked)."""
    for inner in nested_schemas(obj):
        if id(inner) not in known:
            check_fields(inner, type(inner).__schema__, device)


def _check_fields_reporting(obj: Any, spec: CompiledSchema, device: Any) -> dict[str, int]:
    """The same checks as the generated fast path, raising a precise :class:`SchemaViolation`."""
    import torch

    name = spec.name
    bindings: dict[str, int] = {}
    bound_by: dict[str, str] = {}
    pending: list[tuple[_TensorSpec, int, _Dim, int]] = []
    compute_device = torch.device(device) if device is not None else None
    device_from = "the machine" if device is not None else None
    for ts in spec.tensors:
        x = getattr(obj, ts.name)
        if x is None:
            if ts.optional:
                continue
            raise SchemaViolation(name, ts.name, f"a tensor {ts.dtype_text}[{ts.dim_text}]", "None")
        if not isinstance(x, torch.Tensor):
            raise SchemaViolation(
                name, ts.name, f"a tensor {ts.dtype_text}[{ts.dim_text}]", type(x).__name__
            )
        if ts.dtypes is not None and x.dtype not in ts.dtypes:
            raise SchemaViolation(
                name, ts.name, f"dtype {ts.dtype_text}", f"dtype {str(x.dtype).removeprefix('torch.')}"
            )
        shape = x.shape
        if len(shape) != len(ts.dims):
            raise SchemaViolation(
                name, ts.name, f"shape [{ts.dim_text}] ({len(ts.dims)} dims)",
                f"shape {_shape_text(shape)} ({len(shape)} dims)",
            )
        for axis, (size, d) in enumerate(zip(shape, ts.dims, strict=True)):
            kind = d.kind
            if kind == "name":
                have = bindings.get(d.text)
                if have is None:
                    bindings[d.text] = size
                    bound_by[d.text] = ts.name
                elif have != size:
                    raise SchemaViolation(
                        name, ts.name,
                        f"{d.text}={have} on axis {axis} (as bound by field {bound_by[d.text]!r})",
                        f"{d.text}={size} (shape {_shape_text(shape)})",
                    )
            elif kind == "int":
                if size != d.size:
                    raise SchemaViolation(
                        name, ts.name, f"size {d.size} on axis {axis} of [{ts.dim_text}]",
                        f"shape {_shape_text(shape)}",
                    )
            elif kind == "expr":
                pending.append((ts, axis, d, size))
        if ts.host:
            if x.device.type != "cpu":
                raise SchemaViolation(name, ts.name, "a host (cpu) tensor", f"device {x.device}")
        elif compute_device is None:
            compute_device = x.device
            device_from = f"field {ts.name!r}"
        elif x.device != compute_device:
            raise SchemaViolation(
                name, ts.name, f"device {compute_device} (as set by {device_from})", f"device {x.device}"
            )
    for ts, axis, d, size in pending:
        _check_expr(name, ts, axis, d, size, bindings, bound_by)
    for vs in spec.values:
        v = getattr(obj, vs.name)
        if v is None:
            if vs.optional:
                continue
            raise SchemaViolation(name, vs.name, vs.type_text, "None")
        if vs.types is not None and not isinstance(v, vs.types):
            raise SchemaViolation(name, vs.name, vs.type_text, type(v).__name__)
        if vs.nested:
            # A nested schema was validated when it was produced; here it must only agree on
            # the batch size with its parent.
            dim = type(obj).__batch_dim__
            inner = v.batch_size
            outer = bindings.get(dim)
            if inner is not None and outer is not None and inner != outer:
                raise SchemaViolation(
                    name, vs.name, f"a {vs.type_text} with {dim}={outer}", f"{dim}={inner}"
                )
    return bindings


def _check_expr(name, ts, axis, d: _Dim, size: int, bindings, bound_by) -> None:
    unknown = [n for n in d.names if n not in bindings]
    if not unknown:
        try:
            want = eval(d.code, {"__builtins__": {}}, bindings)  # noqa: S307 - compiled dim expr
        except ZeroDivisionError:
            env = ", ".join(f"{n}={bindings[n]}" for n in d.names)
            raise SchemaViolation(
                name, ts.name, f"{d.text} on axis {axis} to be defined", f"a division by zero ({env})"
            ) from None
        if want != size:
            env = ", ".join(f"{n}={bindings[n]}" for n in d.names)
            raise SchemaViolation(
                name, ts.name, f"{d.text}={want} on axis {axis} ({env})", f"size {size}"
            )
        return
    if len(unknown) == 1 and d.factors is not None:
        known = 1
        for f in d.factors:
            if f != unknown[0]:
                known *= int(f) if f.isdigit() else bindings[f]
        if known == 0:
            if size != 0:
                raise SchemaViolation(name, ts.name, f"{d.text}=0", f"size {size}")
            return
        if size % known:
            raise SchemaViolation(
                name, ts.name, f"{d.text} on axis {axis} (a multiple of {known})", f"size {size}"
            )
        bindings[unknown[0]] = size // known
        bound_by[unknown[0]] = ts.name
        return
    raise SchemaViolation(
        name, ts.name, f"{d.text} on axis {axis} with {', '.join(unknown)} bound", "unbound dims"
    )


def child_schemas(obj: Any) -> Iterator[Any]:
    """The schema instances held directly in ``obj``'s nested fields (None ones skipped)."""
    for vs in type(obj).__schema__.values:
        if vs.nested:
            inner = getattr(obj, vs.name)
            if inner is not None:
                yield inner


def nested_schemas(obj: Any) -> Iterator[Any]:
    """Every schema instance nested in ``obj``, depth first (``obj`` itself excluded)."""
    for inner in child_schemas(obj):
        yield inner
        yield from nested_schemas(inner)


def check_invariants(
    obj: Any, spec: CompiledSchema, nested: bool = False, known: frozenset[int] = frozenset()
) -> None:
    """The value invariants of ``obj``; with ``nested`` also those of every schema nested in it
    (e.g. a state's BatchParams) except the instances whose ``id`` is in ``known`` (already
    checked: a phase's output carrying its input's params unchanged pays nothing for them)."""
    for label, fn in spec.invariants:
        try:
            problem = fn(obj)
        except PhaseGraphError:
            raise
        except Exception as exc:  # e.g. values torch cannot read (meta or sparse tensors)
            why = one_line(str(exc)) or type(exc).__name__
            raise InvariantViolation(
                spec.name, label, f"could not be checked ({type(exc).__name__}: {why})"
            ) from exc
        if problem:
            raise InvariantViolation(spec.name, label, problem)
    if nested:
        for inner in nested_schemas(obj):
            if id(inner) not in known:
                check_invariants(inner, type(inner).__schema__)


# ----------------------------------------------------------------------------- compatibility


def schema_satisfies(provided: type, required: type) -> list[str]:
    """Why a value of schema ``provided`` cannot stand where ``required`` is expected ([] = fine).

    A subclass always satisfies its base. Otherwise every non-optional field of ``required``
    must exist in ``provided`` with a compatible kind, dtype, shape and role.
    """
    if provided is required or issubclass(provided, required):
        return []
    got = {s.name: s for s in provided.__schema__.tensors}
    got_values = {s.name: s for s in provided.__schema__.values}
    problems = []
    for need in required.__schema__.tensors:
        have = got.get(need.name)
        if have is None:
            if need.optional:
                continue
            kind = "a value" if need.name in got_values else "missing"
            problems.append(f"field {need.name!r} is {kind} in {provided.__name__}")
            continue
        if need.dtypes is not None and (have.dtypes is None or not have.dtypes <= need.dtypes):
            problems.append(
                f"field {need.name!r}: {provided.__name__} gives dtype {have.dtype_text}, "
                f"{required.__name__} needs {need.dtype_text}"
            )
        if have.dim_text != need.dim_text:
            problems.append(
                f"field {need.name!r}: {provided.__name__} gives shape [{have.dim_text}], "
                f"{required.__name__} needs [{need.dim_text}]"
            )
        if have.optional and not need.optional:
            problems.append(f"field {need.name!r} is optional in {provided.__name__} but required")
        if have.role != need.role:
            problems.append(f"field {need.name!r}: roles differ ({have.role} vs {need.role})")
    for need in required.__schema__.values:
        if need.name not in got_values and not need.optional:
            problems.append(f"value field {need.name!r} is missing in {provided.__name__}")
    return problems
