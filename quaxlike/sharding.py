"""Shard a whole model of Values by rules over paths and logical shapes.

Every array and Value of a model gets the `PartitionSpec` of the array it stands
for, chosen by rules written in the one selection language of `select` and
`where=` (`quaxlike.selection`): a path pattern, a module type,
`module(...)`, a predicate, or combinations. Each Value's leaves then follow its
type's declaration (`quaxlike.leaf_specs`): a QLoRA weight's codes, scales and
factors all split along the same logical rows.

- `model_shardings(model, mesh, rules)`: a `NamedSharding` of the logical array for
  each leaf (a Value counts as one), for `quaxlike.device_put`,
  `quaxlike.leaf_shardings` (then `jax.jit`'s `in_shardings`) or
  `quaxlike.with_sharding_constraint`;
- `shard(model, mesh, rules)`: the model placed that way;
- the spec rules `fsdp(mesh, axis)` (every weight split along its rows, or its
  columns, for fully sharded data parallelism), `rows(axis)` and `columns(axis)`
  (tensor parallelism); and `gathered(layer, mesh)`, which, called on a layer
  inside the layer loop, gathers its weights (as stored: a quantised weight's
  packed codes, never the dequantised weight) for that layer only.

A rule's spec is a `PartitionSpec`, a list of them (the first the leaf can follow
is taken), or a function `(path, shape)` of the dotted path and the logical
shape returning either (or `None`: ask the next rule). The first rule that
selects a leaf and gives a spec wins; other leaves are replicated. A spec no
candidate of which the leaf can follow is an error (`LogicalShardingError`).
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

import quaxlike
from quaxlike.internal import has_explicit_axes

from .selection import as_selection, dotted_path, is_value, selected


__all__ = ["columns", "fsdp", "gathered", "model_shardings", "rows", "shard"]

SpecRule = (
    PartitionSpec
    | list[PartitionSpec]
    | Callable[[str, tuple[int, ...]], PartitionSpec | list[PartitionSpec] | None]
)


def _shape(leaf: Any) -> tuple[int, ...] | None:
    if isinstance(leaf, quaxlike.Value):
        try:
            return tuple(leaf.aval().shape)  # pyright: ignore[reportAttributeAccessIssue]
        except (AttributeError, TypeError):  # half of a partitioned Value
            return None
    shape = getattr(leaf, "shape", None)
    return None if shape is None else tuple(shape)


def model_shardings(model: PyTree, mesh: Any, rules: Sequence[tuple[Any, SpecRule]] = ()) -> PyTree:
    """The sharding of each array and Value of `model`, by `rules`.

    **Arguments:**

    - `model`: any PyTree of arrays and Values (concrete, or abstract from
        `eqx.filter_eval_shape`).
    - `mesh`: a `jax.sharding.Mesh`.
    - `rules`: `(where, spec)` pairs: `where` any selection (a path pattern such as
        `"blocks.*.weight"`, a module type, `module(...)`, a predicate ...), `spec`
        a `PartitionSpec` of the logical array or a function `(path, shape) ->
        PartitionSpec | None`. The first rule that selects a leaf and gives a spec
        wins; leaves no rule places are replicated.

    **Returns:**

    `model`'s structure with a Value as one leaf, holding a `NamedSharding` of the
    logical array at each array or Value (and `None` elsewhere). Pass it to
    `quaxlike.device_put`, `quaxlike.leaf_shardings` or
    `quaxlike.with_sharding_constraint`.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P
        from quaxlike.lora import qlora

        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        mlp = qlora(eqx.nn.MLP(64, 64, 128, depth=1, key=jr.key(0)), bits=4, rank=2, key=jr.key(1))
        specs = model_shardings(mlp, mesh, [("layers.*.weight", P("data")), ("**", fsdp(mesh))])
        assert specs.layers[0].weight.spec == P("data")
        assert specs.layers[0].bias.spec == P("data")  # fsdp: the rest split too
        ```
    """
    leaves, treedef = jtu.tree_flatten_with_path(model, is_leaf=is_value)
    specs: list[PartitionSpec | None] = [None] * len(leaves)
    for where, rule in rules:
        for i in selected(model, as_selection(where, "model_shardings"), "model_shardings"):
            if specs[i] is not None:
                continue
            path, leaf = leaves[i]
            shape = _shape(leaf)
            if shape is None:
                continue
            spec = rule(dotted_path(path), shape) if callable(rule) else rule
            if spec is not None:
                specs[i] = _first_followed(leaf, spec, mesh)
    out = []
    for (_, leaf), spec in zip(leaves, specs):
        placeable = is_value(leaf) or isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)
        out.append(NamedSharding(mesh, spec or PartitionSpec()) if placeable else None)
    return jtu.tree_unflatten(treedef, out)


def _first_followed(leaf: Any, spec: Any, mesh: Any) -> PartitionSpec:
    """`spec`, or of a list of specs the first that `leaf` can follow (a Value's
    leaves, or an array's axes divisible by the mesh); otherwise the first one's
    error."""
    candidates = list(spec) if isinstance(spec, list) else [spec]
    first_error = None
    for candidate in candidates:
        try:
            quaxlike.leaf_specs(leaf, candidate, mesh)
            _check_divisible(leaf, candidate, mesh)
        except quaxlike.LogicalShardingError as error:
            first_error = first_error or error
            continue
        return candidate
    assert first_error is not None
    raise first_error


def _check_divisible(leaf: Any, spec: PartitionSpec, mesh: Any) -> None:
    if is_value(leaf):
        return  # checked leaf by leaf by `leaf_specs`
    for axis, (size, entry) in enumerate(zip(getattr(leaf, "shape", ()), tuple(spec))):
        if entry is not None and size % _axis_size(mesh, entry):
            raise quaxlike.LogicalShardingError(
                f"An array of shape {tuple(leaf.shape)} cannot be split by {spec}: "
                f"{_axis_size(mesh, entry)} devices do not divide axis {axis} ({size})."
            )


def shard(model: PyTree, mesh: Any, rules: Sequence[tuple[Any, SpecRule]] = ()) -> PyTree:
    """`model` placed on `mesh` by `rules` (see `model_shardings`); every Value by
    the spec of the array it stands for.

    **Arguments:**

    - `model`: a PyTree of arrays and Values.
    - `mesh`: a `jax.sharding.Mesh`.
    - `rules`: `(where, spec)` pairs, as for `model_shardings`.

    **Returns:**

    `model`, its arrays placed.

    !!! example

        ```python
        from quaxlike.quantized import quantize

        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        mlp = quantize(eqx.nn.MLP(64, 64, 128, depth=1, key=jr.key(0)), bits="nf4")
        placed = shard(mlp, mesh, [("**", fsdp(mesh))])
        ```
    """
    return quaxlike.device_put(model, model_shardings(model, mesh, rules))


def _axis_size(mesh: Any, axis: Any) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def fsdp(mesh: Any, axis: Any = "data", *, min_size: int = 0) -> SpecRule:
    """A spec rule for fully sharded data parallelism: each leaf split along mesh
    axis `axis` on its rows (the last axis but one), or, where it cannot be
    (`axis`'s size does not divide them, or a Value's leaves cannot follow the
    split), on its last axis, or else, as a last resort asked for by this rule,
    replicated; leading axes (a stack of layers) are kept whole, so that a layer
    loop takes one layer at a time.

    **Arguments:**

    - `mesh`: the mesh (for `axis`'s size).
    - `axis`: the mesh axis (or tuple of them) to split along.
    - `min_size`: leaves with fewer elements are replicated.

    **Returns:**

    A function `(path, shape) -> list of PartitionSpec` for `model_shardings`,
    which takes the first spec the leaf can follow.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        assert fsdp(mesh)("layers.weight", (80, 8192, 1024))[0] == P(None, "data", None)
        ```
    """
    size = _axis_size(mesh, axis)

    def rule(path: str, shape: tuple[int, ...]) -> list[PartitionSpec] | None:
        if not shape or _count(shape) < max(min_size, 1):
            return None
        axes = [len(shape) - 2, len(shape) - 1] if len(shape) >= 2 else [0]
        specs = [
            PartitionSpec(*[axis if j == i else None for j in range(len(shape))])
            for i in axes
            if shape[i] % size == 0
        ]
        return [*specs, PartitionSpec()]

    return rule


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _along(axis: Any, position: int) -> SpecRule:
    def rule(path: str, shape: tuple[int, ...]) -> PartitionSpec | None:
        if len(shape) < 2:
            return None
        entries = [None] * len(shape)
        entries[len(shape) + position] = axis
        return PartitionSpec(*entries)

    return rule


def rows(axis: Any = "model") -> SpecRule:
    """A spec rule for tensor parallelism: a weight `(..., out, in)` split along
    its rows (output features) over mesh axis `axis`: the projections into a
    wider layer (query, key, value, gate, up).

    **Arguments:**

    - `axis`: the mesh axis (or tuple of them).

    **Returns:**

    A function `(path, shape) -> PartitionSpec | None` for `model_shardings`.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        assert rows("model")("up.weight", (4, 256, 128)) == P(None, "model", None)
        ```
    """
    return _along(axis, -2)


def columns(axis: Any = "model") -> SpecRule:
    """A spec rule for tensor parallelism: a weight `(..., out, in)` split along
    its columns (input features) over mesh axis `axis`: the projections out of a
    wider layer (attention output, down), whose products are then summed across
    devices.

    **Arguments:**

    - `axis`: the mesh axis (or tuple of them).

    **Returns:**

    A function `(path, shape) -> PartitionSpec | None` for `model_shardings`.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        assert columns("model")("down.weight", (4, 128, 256)) == P(None, None, "model")
        ```
    """
    return _along(axis, -1)


def gathered(layer: PyTree, mesh: Any) -> PyTree:
    """`layer` with every array and Value constrained to be whole on each device:
    inside a layer loop (the body of a `lax.scan` over stacked layers), the
    gathering step of fully sharded data parallelism. A Value is gathered as
    stored (a quantised weight as its packed codes and scales), never
    dequantised first. Works inside `quaxlike.quaxify` and outside it.

    **Arguments:**

    - `layer`: a PyTree of arrays and Values (one layer's weights).
    - `mesh`: the mesh they are sharded on.

    **Returns:**

    `layer`, constrained to be replicated (resharded, where the mesh's axes are
    `Explicit`).

    !!! example

        ```python
        from quaxlike.quantized import quantize

        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        layer = quantize(eqx.nn.Linear(64, 32, key=jr.key(0)), bits="nf4")
        y = jax.jit(quaxlike.quaxify(lambda m, x: gathered(m, mesh)(x)))(layer, jnp.ones(64))
        ```
    """
    # Behind a barrier, the layer is its own arrays (the slice of this layer out of
    # a stack of layers) when gathered: without it XLA may gather the slice
    # before it is cut out of the stack, and XLA:CPU then copies every stacked
    # weight into the layout that gather wants (16 GiB of a 70B model's codes per
    # device on 2 devices).
    arrays, static = eqx.partition(layer, eqx.is_array)
    arrays = jax.lax.optimization_barrier(arrays)
    whole = NamedSharding(mesh, PartitionSpec())
    if has_explicit_axes(mesh):
        # A sharding is part of the type there, and only `reshard` changes it (a
        # constraint would have to agree with it).
        return eqx.combine(jax.sharding.reshard(arrays, whole), static)
    return eqx.combine(quaxlike.with_sharding_constraint(arrays, whole), static)
