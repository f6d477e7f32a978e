"""Logical sharding: a Value is placed by the `PartitionSpec` of the array it
stands for.

A Value's leaves rarely have its shape (a LoRA weight `W + A @ B` has three
leaves, a 4-bit weight packed codes and scales), so a spec written for the
logical array says nothing directly about them. Each type declares how its leaves
follow a logical spec with a method

    def logical_leaf_specs(self, spec: PartitionSpec) -> PyTree[PartitionSpec]

returning a copy of itself with a `PartitionSpec` in place of each array leaf
(`with_leaf_specs` builds it), or raising `LogicalShardingError` (through
`cannot_follow`) for a spec it cannot follow. A type without the method is
followed leaf by leaf: a leaf axis of the Value's size at the same position is
split like it; a split the leaves cannot carry is an error, never a silent
replication.

`leaf_shardings`, `device_put` and `with_sharding_constraint` turn shardings of
logical arrays into shardings of leaves; `jax.jit`'s `in_shardings` and
`out_shardings` take what `leaf_shardings` returns. Inside `quaxify`,
`jax.lax.with_sharding_constraint` on a Value follows the same declaration (the
rule in `_higher_order/_sharding.py`), as does `shard_map` for its inputs.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from ._diagnostics import LogicalShardingError
from ._values import Value


__all__ = [
    "cannot_follow",
    "device_put",
    "follow_axes",
    "leaf_shardings",
    "leaf_specs",
    "logical_entries",
    "with_leaf_specs",
    "with_sharding_constraint",
]

_NOT_FOLLOWED_MSG = (
    "{type_name} cannot follow the logical sharding {spec} of the array it stands "
    "for ({shape}): {why} Ways out: shard another logical axis (or replicate this "
    "one, `None` at position {axis}), give a divisible shape, or materialise the "
    "Value first. A type says how its leaves follow a spec with "
    "`logical_leaf_specs(spec)` (see `quaxlike.leaf_specs`)."
)
_BAD_DECLARATION_MSG = (
    "{type_name}.logical_leaf_specs({spec}) returned {got!r}, which is not shaped "
    "like the Value: it must return the Value with a `PartitionSpec` in place of each "
    "array leaf (`quaxlike.internal.with_leaf_specs`)."
)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _names(entry: Any) -> tuple:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def logical_entries(spec: PartitionSpec | None, ndim: int) -> tuple:
    """The entries of `spec`, one per logical axis (padded with `None`).

    **Arguments:**

    - `spec`: a `PartitionSpec` (or `None`, all replicated).
    - `ndim`: the number of logical axes.

    **Returns:**

    A tuple of `ndim` entries (a mesh axis name, a tuple of them, or `None`).

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        assert logical_entries(P("data"), 3) == ("data", None, None)
        ```
    """
    entries = tuple(spec) if spec is not None else ()
    if len(entries) > ndim:
        raise ValueError(f"the sharding {spec} has more entries than the array's {ndim} axes")
    return entries + (None,) * (ndim - len(entries))


def follow_axes(entries: Sequence[Any], axes: Sequence[int | None]) -> PartitionSpec:
    """The spec of a leaf whose axis `i` runs along logical axis `axes[i]` (or
    along none of them, `None`: that leaf axis is replicated).

    **Arguments:**

    - `entries`: the logical spec's entries (`logical_entries`).
    - `axes`: for each axis of the leaf, a logical axis (negative counts from the
        end) or `None`.

    **Returns:**

    A `PartitionSpec`, without trailing `None`s (as JAX writes specs).

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        # A factor `(rows, rank)` of a `(rows, columns)` value: its rows follow
        # the value's rows, its rank axis is replicated.
        entries = logical_entries(P("data", "model"), 2)
        assert follow_axes(entries, [0, None]) == P("data")
        ```
    """
    out = [None if a is None else entries[a] for a in axes]
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def with_leaf_specs(value: Any, **fields: Any) -> Any:
    """`value` (an Equinox module) with the named fields replaced, without running
    its `__init__` or checks: how a type's `logical_leaf_specs` returns itself with
    a spec in place of each array leaf. A field left `None` stays `None`.

    **Arguments:**

    - `value`: the Value.
    - `**fields`: field name to its spec (a `PartitionSpec`, or the specs of a
        nested Value).

    **Returns:**

    A copy of `value` holding the given fields.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        class Pair(quaxlike.ArrayValue):  # two arrays of the value's shape
            x: jax.Array
            y: jax.Array

            def aval(self):
                return jax.core.ShapedArray(self.x.shape, self.x.dtype)

            def materialise(self):
                return self.x + self.y

            def logical_leaf_specs(self, spec):
                return with_leaf_specs(self, x=spec, y=spec)

        pair = Pair(jnp.ones((4, 2)), jnp.ones((4, 2)))
        assert quaxlike.leaf_specs(pair, P("data")).y == P("data")
        ```
    """
    out = object.__new__(type(value))
    for field in dataclasses.fields(value):
        current = getattr(value, field.name)
        new = fields.get(field.name, current)
        object.__setattr__(out, field.name, None if current is None else new)
    return out


def cannot_follow(value: Any, spec: Any, axis: int, why: str) -> LogicalShardingError:
    """The error a type raises (`raise cannot_follow(...)`) for a logical spec its
    leaves cannot follow.

    **Arguments:**

    - `value`: the Value.
    - `spec`: the logical `PartitionSpec`.
    - `axis`: the logical axis that cannot be followed.
    - `why`: one sentence saying why, naming the leaf.

    **Returns:**

    A `LogicalShardingError` naming the type, the spec and the axis.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        value = quaxlike.DenseArrayValue(jnp.ones((4, 2)))
        error = cannot_follow(value, P(None, "model"), 1, "its leaf has one column block.")
        assert isinstance(error, quaxlike.LogicalShardingError)
        ```
    """
    try:
        shape = value.aval().str_short()
    except Exception:  # a half of a partitioned Value: no shape to show
        shape = "shape unknown"
    return LogicalShardingError(
        _NOT_FOLLOWED_MSG.format(
            type_name=type(value).__qualname__, spec=spec, shape=shape, why=why, axis=axis
        )
    )


def has_explicit_axes(mesh: Any) -> bool:
    """Whether `mesh` (concrete or abstract) has an `Explicit` axis (JAX's default
    from 0.7, `jax.sharding.AxisType`): there a sharding is part of an array's
    type, a program must name the shardings JAX cannot tell, and only `reshard`
    moves an array to another one.

    **Arguments:**

    - `mesh`: a mesh, or `None`.

    **Returns:**

    A bool (`False` for `None`, and where this JAX has no axis types).

    !!! example

        ```python
        from jax.sharding import AxisType

        assert has_explicit_axes(jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,)))
        assert not has_explicit_axes(jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,)))
        ```
    """
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return explicit is not None and explicit in getattr(mesh, "axis_types", ())


def _array_leaves_with_paths(value: Any) -> list[tuple[str, Any]]:
    found = jtu.tree_flatten_with_path(value)[0]
    return [(jtu.keystr(p), leaf) for p, leaf in found]


def _generic_leaf_specs(value: Value, spec: PartitionSpec) -> Any:
    """A type with no declaration: a leaf axis of the Value's size at the same
    position follows it; any other split is an error."""
    shape = tuple(value.aval().shape)  # pyright: ignore
    entries = logical_entries(spec, len(shape))
    specs = []
    free = PartitionSpec.UNCONSTRAINED
    for path, leaf in _array_leaves_with_paths(value):
        leaf_shape = tuple(getattr(leaf, "shape", ()))
        if len(leaf_shape) != len(shape) and not any(map(_names, entries)):
            # No split to follow; an axis left to the compiler leaves the leaf to it.
            specs.append(
                PartitionSpec(*[free] * len(leaf_shape)) if free in entries else PartitionSpec()
            )
            continue
        leaf_entries = []
        for axis, entry in enumerate(entries):
            if not _names(entry):
                leaf_entries.append(entry if entry is free else None)
                continue
            if len(leaf_shape) != len(shape) or leaf_shape[axis] != shape[axis]:
                raise cannot_follow(
                    value,
                    spec,
                    axis,
                    f"its leaf `{path}` (shape {leaf_shape}) has no axis {axis} of size "
                    f"{shape[axis]} to split, and {type(value).__qualname__} declares no "
                    "`logical_leaf_specs` saying how its leaves follow the logical axes.",
                )
            leaf_entries.append(entry)
        specs.append(follow_axes(leaf_entries, range(len(leaf_entries))))
    return jtu.tree_unflatten(jtu.tree_structure(value), specs)


def _axis_size(mesh: Any, entry: Any) -> int:
    return math.prod(mesh.shape[name] for name in _names(entry))


def _checked(value: Any, spec: PartitionSpec, specs: Any, mesh: Any) -> Any:
    """`specs` with each leaf axis of size 1 under a split unsplit (a broadcast
    axis: every device needs it whole), after checking that the mesh divides every
    other split leaf axis."""
    leaves = _array_leaves_with_paths(value)
    flat = jtu.tree_leaves(specs, is_leaf=_is_spec)
    if len(flat) != len(leaves) or not all(map(_is_spec, flat)):
        raise LogicalShardingError(
            _BAD_DECLARATION_MSG.format(type_name=type(value).__qualname__, spec=spec, got=specs)
        )
    out = []
    for (path, leaf), leaf_spec in zip(leaves, flat):
        leaf_shape = tuple(getattr(leaf, "shape", ()))
        entries = list(logical_entries(leaf_spec, len(leaf_shape)))
        for axis, entry in enumerate(entries):
            if not _names(entry):
                continue
            if leaf_shape[axis] == 1:
                entries[axis] = None
                continue
            size = _axis_size(mesh, entry) if mesh is not None else 1
            if leaf_shape[axis] % size:
                logical = _logical_axis_of(spec, entry)
                raise cannot_follow(
                    value,
                    spec,
                    logical,
                    f"its leaf `{path}` (shape {leaf_shape}) would be split along its "
                    f"axis {axis} over mesh axis {entry!r} ({size} devices), which does "
                    f"not divide {leaf_shape[axis]}.",
                )
        out.append(follow_axes(entries, range(len(entries))))
    return jtu.tree_unflatten(jtu.tree_structure(specs, is_leaf=_is_spec), out)


def _logical_axis_of(spec: Any, entry: Any) -> int:
    for i, e in enumerate(tuple(spec)):
        if e == entry:
            return i
    return 0


def leaf_specs(value: Any, spec: PartitionSpec | None, mesh: Any = None) -> Any:
    """The spec of each leaf of `value` when the array it stands for is sharded by
    `spec`.

    **Arguments:**

    - `value`: a Value (or an array, whose spec is `spec` itself).
    - `spec`: a `PartitionSpec` of the logical array (its `aval()`'s shape).
    - `mesh`: the mesh, if known: then every split leaf axis must be divisible by
        its mesh axes' size, and a leaf axis of size 1 (a broadcast, such as one
        second-level scale shared by a whole row) is replicated.

    **Returns:**

    `value` with a `PartitionSpec` in place of each array leaf, as the type
    declares (`logical_leaf_specs`) or, for a type declaring nothing, each leaf
    axis of the Value's size at the same position split like it.

    **Raises:**

    `LogicalShardingError`, naming the type and the axis, for a spec its leaves
    cannot follow.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P
        from quaxlike.lora import LoraArray

        lora = LoraArray(jnp.ones((8, 4)), rank=2, key=jr.key(0))
        specs = quaxlike.leaf_specs(lora, P("data", None))
        assert (specs.w, specs.a, specs.b) == (P("data"), P("data"), P())
        ```
    """
    spec = PartitionSpec() if spec is None else spec
    if not isinstance(value, Value):
        return spec
    if not jtu.tree_leaves(value):
        return value  # no arrays (a symbolic zero, one half of a partitioned Value)
    declared = getattr(value, "logical_leaf_specs", None)
    specs = declared(spec) if declared is not None else _generic_leaf_specs(value, spec)
    return _checked(value, spec, specs, mesh)


def _is_sharding(x: Any) -> bool:
    return isinstance(x, Sharding) or x is None


def _expand(sharding: Any, subtree: Any) -> Any:
    """The leaf shardings of `subtree` under the logical `sharding` of each of its
    arrays and Values."""
    if sharding is None:
        return jtu.tree_map(lambda _: None, subtree)

    def one(x):
        if not isinstance(x, Value):
            return sharding if eqx.is_array(x) or _is_abstract(x) else None
        if not isinstance(sharding, NamedSharding):
            raise TypeError(
                f"A {type(x).__qualname__} is placed by a `NamedSharding` of the array it "
                f"stands for (its mesh and `PartitionSpec`); got {sharding!r}."
            )
        specs = leaf_specs(x, sharding.spec, sharding.mesh)
        return jtu.tree_map(lambda s: NamedSharding(sharding.mesh, s), specs, is_leaf=_is_spec)

    return jtu.tree_map(one, subtree, is_leaf=lambda x: isinstance(x, Value))


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def leaf_shardings(tree: Any, shardings: Any) -> Any:
    """The sharding of every array leaf of `tree`, from shardings of the logical
    arrays: a Value's leaves follow its type's declaration (`leaf_specs`).

    **Arguments:**

    - `tree`: a PyTree of arrays and Values (a model), concrete or abstract
        (`jax.ShapeDtypeStruct` leaves, as `eqx.filter_eval_shape` gives).
    - `shardings`: one `NamedSharding` for everything, or a PyTree prefix of `tree`
        (a Value counts as one leaf) of `NamedSharding`s of the logical arrays;
        `None` leaves a subtree unplaced.

    **Returns:**

    A PyTree shaped like `tree` with a `NamedSharding` at each array leaf (and
    `None` at others): what `jax.device_put`, and `jax.jit`'s `in_shardings` and
    `out_shardings`, take.

    !!! example

        ```python
        from jax.sharding import NamedSharding, PartitionSpec as P
        from quaxlike.lora import LoraArray

        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        lora = LoraArray(jnp.ones((8, 4)), rank=2, key=jr.key(0))
        shardings = quaxlike.leaf_shardings(lora, NamedSharding(mesh, P("data")))
        assert shardings.b.spec == P()
        ```
    """
    if _is_sharding(shardings):
        return _expand(shardings, tree)
    return jtu.tree_map(
        _expand, shardings, tree, is_leaf=lambda x: _is_sharding(x) or isinstance(x, Value)
    )


def device_put(tree: Any, shardings: Any) -> Any:
    """Put `tree`'s arrays and Values on devices by the shardings of the logical
    arrays (`leaf_shardings`); leaves that are not arrays are kept.

    **Arguments:**

    - `tree`: a PyTree of arrays and Values (a model).
    - `shardings`: as for `leaf_shardings`.

    **Returns:**

    `tree`, its array leaves placed.

    !!! example

        ```python
        from jax.sharding import NamedSharding, PartitionSpec as P
        from quaxlike.lora import LoraArray

        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        lora = LoraArray(jnp.ones((8, 4)), rank=2, key=jr.key(0))
        placed = quaxlike.device_put(lora, NamedSharding(mesh, P("data")))
        assert placed.w.sharding.spec == P("data")
        ```
    """
    leaves, treedef = jtu.tree_flatten(tree)
    targets = treedef.flatten_up_to(leaf_shardings(tree, shardings))
    placed = [
        jax.device_put(x, s) if s is not None and eqx.is_array(x) else x
        for x, s in zip(leaves, targets)
    ]
    return jtu.tree_unflatten(treedef, placed)


def with_sharding_constraint(tree: Any, shardings: Any) -> Any:
    """`jax.lax.with_sharding_constraint` by the shardings of the logical arrays,
    inside or outside `quaxify`: a Value's leaves are constrained as its type
    declares (inside `quaxify`, a Value met as a tracer is constrained by the
    same declaration, through the rule for `sharding_constraint_p`).

    **Arguments:**

    - `tree`: a PyTree of arrays and Values.
    - `shardings`: as for `leaf_shardings`.

    **Returns:**

    `tree`, constrained.

    !!! example

        ```python
        from jax.sharding import NamedSharding, PartitionSpec as P
        from quaxlike.quantized import quantize_nf4

        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        rows = NamedSharding(mesh, P("data"))
        weight = quantize_nf4(jnp.ones((8, 64)), double_quant=True)

        @jax.jit
        @quaxlike.quaxify
        def apply(w, x):
            w = jax.lax.with_sharding_constraint(w, rows)  # codes and scales by rows
            return x @ w.T

        apply(weight, jnp.ones((2, 64)))
        jax.jit(lambda w: quaxlike.with_sharding_constraint(w, rows))(weight)  # outside too
        ```
    """
    leaves, treedef = jtu.tree_flatten(tree)
    targets = treedef.flatten_up_to(leaf_shardings(tree, shardings))
    out = [
        jax.lax.with_sharding_constraint(x, s) if s is not None and eqx.is_array(x) else x
        for x, s in zip(leaves, targets)
    ]
    return jtu.tree_unflatten(treedef, out)
