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
  columns, for fully sharded data parallelism; the layer axis of stacked layers,
  read from the model by `stack_depths`, kept whole), `rows(axis)` and `columns(axis)`
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


__all__ = ["columns", "fsdp", "gathered", "model_shardings", "rows", "shard", "stack_depths"]

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
        wins; leaves no rule places are replicated. A function with a method
        `for_model(model)` (as `fsdp`'s has) is first given the model, and the
        function that returns is asked instead.

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
        # A rule that reads the whole model first (`fsdp`: which leaves are stacked
        # layers) gives the rule to ask of its leaves.
        for_model = getattr(rule, "for_model", None)
        rule = for_model(model) if for_model is not None else rule
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


def fsdp(
    mesh: Any, axis: Any = "data", *, min_size: int = 0, stacked: Any = None
) -> Callable[[str, tuple[int, ...]], list[PartitionSpec] | None]:
    """A spec rule for fully sharded data parallelism: each leaf split along mesh
    axis `axis` on its rows (the last axis but one), or, where it cannot be
    (`axis`'s size does not divide them, or a Value's leaves cannot follow the
    split), on its last axis, or else, as a last resort asked for by this rule,
    replicated. The leading axes of stacked layers are kept whole, for vectors
    (a norm's scale, a bias) as for matrices, so that a layer loop takes one
    layer at a time: a stacked vector `(layers, d)` is split along `d`.

    Which leaves are stacked is read from the model (by `model_shardings` and
    `shard`): a layer of a known Equinox type (`Linear`, `Embedding`,
    `LayerNorm`, `RMSNorm`, `GroupNorm`, `Conv`, `ConvTranspose`) whose weight
    has more axes than its type gives it (`eqx.filter_vmap` stacked it) is
    stacked along those leading axes, and so is every other array beside it in
    the same module, or below that module, whose leading axes are the same
    (the stacked block's own norm scales). A module holding layers stacked
    differently (a decoder's stack of blocks beside its unstacked output head)
    stacks none of its own arrays. Where the model has no layer of those types
    to tell from, say which leaves are stacked with `stacked`.

    **Arguments:**

    - `mesh`: the mesh (for `axis`'s size).
    - `axis`: the mesh axis (or tuple of them) to split along.
    - `min_size`: leaves with fewer elements are replicated.
    - `stacked`: `None` (read from the model, as above), or a selection (any
        `where`: `"blocks.**"`, `path("**").within(Block)`, ...) of the leaves that
        have one leading axis of stacked layers; no other leaf then has one.

    **Returns:**

    A function `(path, shape) -> list of PartitionSpec` for `model_shardings`,
    which takes the first spec the leaf can follow. Called by hand, it knows
    nothing of stacking: only the shape, whose last two axes are the rows and
    columns.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        assert fsdp(mesh)("layers.weight", (80, 8192, 1024))[0] == P(None, "data", None)

        class Block(eqx.Module):
            norm: jax.Array
            linear: eqx.nn.Linear

            def __init__(self, key):
                self.norm = jnp.ones(64)
                self.linear = eqx.nn.Linear(64, 64, key=key)

        blocks = eqx.filter_vmap(Block)(jr.split(jr.key(0), 4))  # 4 stacked layers
        specs = model_shardings(blocks, mesh, [("**", fsdp(mesh))])
        assert specs.norm.spec == P(None, "data")  # (4, 64): the layers kept whole
        assert specs.linear.weight.spec == P(None, "data", None)
        assert specs.linear.bias.spec == P(None, "data")
        ```
    """
    return _Fsdp(_axis_size(mesh, axis), axis, min_size, stacked)


class _Fsdp:
    """`fsdp`'s rule: `(path, shape)`, and `for_model(model)`, the same rule told
    how many leading axes of stacked layers each leaf of `model` has."""

    def __init__(
        self, size: int, axis: Any, min_size: int, stacked: Any, depths: dict | None = None
    ):
        self.size, self.axis, self.min_size = size, axis, min_size
        self.stacked, self.depths = stacked, depths or {}

    def for_model(self, model: PyTree) -> "_Fsdp":
        if self.stacked is None:
            depths = stack_depths(model)
        else:
            leaves = jtu.tree_flatten_with_path(model, is_leaf=is_value)[0]
            picked = selected(model, as_selection(self.stacked, "fsdp"), "fsdp")
            depths = {dotted_path(leaves[i][0]): 1 for i in picked}
        return _Fsdp(self.size, self.axis, self.min_size, self.stacked, depths)

    def __call__(self, path: str, shape: tuple[int, ...]) -> list[PartitionSpec] | None:
        if not shape or _count(shape) < max(self.min_size, 1):
            return None
        n = len(shape)
        depth = self.depths.get(path, 0)
        depth = depth if depth <= n else 0
        # Rows and columns of the layer's own array, never a stacked axis.
        if n - depth >= 2:
            axes = [n - 2, n - 1]
        else:
            axes = [depth] if n - depth == 1 else []
        specs = [
            PartitionSpec(*[self.axis if j == i else None for j in range(n)])
            for i in axes
            if shape[i] % self.size == 0
        ]
        return [*specs, PartitionSpec()]


# --- which leaves are stacked layers ------------------------------------------------

_MIXED = "mixed"  # a module holding layers stacked in different ways


def _weight_rank(node: Any) -> int | None:
    """How many axes the weight of a layer of a known Equinox type has, unstacked."""
    if isinstance(node, eqx.nn.Linear | eqx.nn.Embedding):
        return 2
    if isinstance(node, eqx.nn.LayerNorm | eqx.nn.RMSNorm):
        shape = node.shape
        return len(shape) if isinstance(shape, tuple) else 1
    if isinstance(node, eqx.nn.GroupNorm):
        return 1
    if isinstance(node, eqx.nn.Conv | eqx.nn.ConvTranspose):
        return node.num_spatial_dims + 2
    return None


def _is_leaf(node: Any) -> bool:
    # Not "anything with a shape": a `LayerNorm` has one too.
    return node is None or is_value(node) or isinstance(node, jax.Array | jax.ShapeDtypeStruct)


def stack_depths(model: PyTree) -> dict[str, int]:
    """How many leading axes of stacked layers each leaf of `model` has, by its
    dotted path (leaves with none left out), as `fsdp` reads them.

    **Arguments:**

    - `model`: a PyTree of arrays and Values (concrete or abstract).

    **Returns:**

    A dict from the dotted path of each stacked leaf to how many of its leading
    axes are stacked layers.

    !!! example

        ```python
        class Block(eqx.Module):
            norm: jax.Array
            linear: eqx.nn.Linear

            def __init__(self, key):
                self.norm = jnp.ones(8)
                self.linear = eqx.nn.Linear(8, 8, key=key)

        model = {"blocks": eqx.filter_vmap(Block)(jr.split(jr.key(0), 3)), "norm": jnp.ones(8)}
        assert stack_depths(model) == {
            "blocks.norm": 1, "blocks.linear.weight": 1, "blocks.linear.bias": 1
        }
        ```
    """
    # The leading shape (the stacked axes) each module's known layers agree on,
    # `()` unstacked, `_MIXED` where they disagree, `None` where it has none.
    stacks: dict[tuple, Any] = {}
    leaves: list[tuple[tuple, tuple[int, ...]]] = []

    def visit(prefix: tuple, node: Any) -> Any:
        if _is_leaf(node):
            shape = _shape(node)
            if shape is not None:
                leaves.append((prefix, shape))
            return None
        children = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
        found = [visit(prefix + tuple(key), child) for key, child in children if key]
        rank = _weight_rank(node)
        weight = _shape(getattr(node, "weight", None))
        if rank is not None and weight is not None and len(weight) >= rank:
            stack = weight[: len(weight) - rank]  # the layer's own evidence
        else:
            known = {f for f in found if f is not None}
            stack = known.pop() if len(known) == 1 else (_MIXED if known else None)
        stacks[prefix] = stack
        return stack

    visit((), model)
    depths = {}
    for path, shape in leaves:
        for end in range(len(path) - 1, -1, -1):  # the nearest module that knows
            stack = stacks.get(path[:end])
            if stack is not None:
                break
        else:
            continue
        if stack != _MIXED and stack and tuple(shape[: len(stack)]) == stack:
            depths[dotted_path(path)] = len(stack)
    return depths


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
