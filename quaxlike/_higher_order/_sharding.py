"""`shard_map` over Values.

A Value going into `shard_map` comes with the `PartitionSpec` the user wrote for
the array it stands for. What that means for its leaves depends on the type, so
the rule works it out per leaf: a leaf axis is split like the Value's axis at the
same position when the two have the same size, and replicated otherwise. (For a
LoRA weight `W + A @ B` sharded along its rows, `W` and `A` are split by rows
and `B` is replicated, which is exactly right.)

The guess is then checked: a Value built from leaves of the per-device shapes
must report, through `aval()`, the per-device shape of the array it stands for.
Types with static shapes (a symbolic zero) or unrelated leaf shapes (sparse data
and indices) fail the check, and are materialised before the `shard_map`, which
is always correct. A type can take over by defining a method
`shard_map_leaf_specs(spec)` returning a PyTree of specs shaped like itself, or
`None` to be materialised, or by registering its own rule for `shard_map_p`.
An input whose type declares `logical_leaf_specs` (how its leaves follow a spec
of the logical array, as `device_put` and `jit` use it) is split that way, and
materialised where it cannot follow the spec.

The mapped function runs under a fresh `quaxify` inside the `shard_map` body, so
the rules see per-device Values. Outputs are treated the same way in reverse.
"""

import math
from typing import Any, cast

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import PartitionSpec

from .. import _jax_compat as jc
from .._diagnostics import LogicalShardingError
from .._logical_sharding import leaf_specs
from .._quaxify import lifted_call
from .._rules import register
from .._values import materialise_value, Value
from ._common import AnyValue


def _axis_factor(mesh, entry) -> int:
    # `P.UNCONSTRAINED` (which vmap inserts for its batch axis) lets XLA choose:
    # no known split, so the axis keeps its size for the shape bookkeeping.
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[name] for name in names)


def _spec_entries(spec, ndim: int) -> tuple:
    entries = tuple(spec) if spec is not None else ()
    return entries + (None,) * (ndim - len(entries))


def _guess_leaf_specs(value: Value, spec, shape: tuple[int, ...], inside: bool) -> list | None:
    """Split a leaf axis like the Value's axis at the same position when their
    sizes agree, else replicate it. For per-device leaves (`inside`), JAX's
    record of which mesh axes each leaf varies over settles coincidences of
    size; without that record (`check_vma=False`) a leaf whose shape differs
    from the Value's and still matches a split axis is ambiguous: `None`."""
    entries = _spec_entries(spec, len(shape))
    tracking = inside and jc.tracking_varying_axes()
    specs = []
    for leaf in jtu.tree_leaves(value):
        aval = jax.typeof(leaf)
        varying = jc.varying_axes(aval) if tracking else frozenset()
        if aval.ndim != len(shape):
            if varying:
                return None
            specs.append(PartitionSpec())
            continue
        leaf_entries = []
        for entry, size, value_size in zip(entries, aval.shape, shape):
            names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            split = entry is not None and size == value_size
            if split and tracking:
                split = set(names) <= varying
            elif split and inside and tuple(aval.shape) != tuple(shape):
                return None
            leaf_entries.append(entry if split else None)
        if tracking:
            used = {
                n
                for e in leaf_entries
                if e is not None
                for n in (e if isinstance(e, tuple) else (e,))
            }
            if not varying <= used:
                return None  # varies over an axis no leaf axis can carry
        while leaf_entries and leaf_entries[-1] is None:
            leaf_entries.pop()  # P("x") rather than P("x", None), as JAX writes it
        specs.append(PartitionSpec(*leaf_entries))
    return specs


def _rescaled(value: Value, leaf_specs, mesh, divide: bool):
    """`value` with each leaf replaced by a `ShapeDtypeStruct` of its per-device
    (`divide=True`) or global (`divide=False`) shape under `leaf_specs`."""
    leaves, treedef = jtu.tree_flatten(value)
    structs = []
    for leaf, spec in zip(leaves, leaf_specs):
        aval = jax.typeof(leaf)
        factors = [_axis_factor(mesh, e) for e in _spec_entries(spec, aval.ndim)]
        if divide:
            if any(size % f for size, f in zip(aval.shape, factors)):
                return None
            shape = tuple(size // f for size, f in zip(aval.shape, factors))
        else:
            shape = tuple(size * f for size, f in zip(aval.shape, factors))
        structs.append(jax.ShapeDtypeStruct(shape, aval.dtype))
    return jtu.tree_unflatten(treedef, structs)


def _leaf_specs(value: Value, spec, mesh, *, inside: bool) -> list | None:
    """Per-leaf specs for `value` with `spec`, or `None` if the Value must be
    materialised instead. `inside` says whether `value` holds per-device leaves
    (an output of the body) rather than global ones (an input)."""
    shape = tuple(cast(jc.ShapedArray, value.aval()).shape)
    factors = [_axis_factor(mesh, e) for e in _spec_entries(spec, len(shape))]
    if inside:
        local_shape = shape
        other_shape = tuple(size * f for size, f in zip(shape, factors))
    else:
        if any(size % f for size, f in zip(shape, factors)):
            return None
        local_shape = tuple(size // f for size, f in zip(shape, factors))
        other_shape = local_shape
    custom = getattr(value, "shard_map_leaf_specs", None)
    if custom is not None:
        specs = custom(spec)
        if specs is None:
            return None
        specs = jtu.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    elif not inside and hasattr(value, "logical_leaf_specs"):
        # An input: the type's own declaration, as for `device_put` and `jit`.
        try:
            specs = leaf_specs(value, spec, mesh)
        except LogicalShardingError:
            return None
        specs = jtu.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    else:
        specs = _guess_leaf_specs(value, spec, shape, inside)
        if specs is None:
            return None
    rescaled = _rescaled(value, specs, mesh, divide=not inside)
    if rescaled is None:
        return None
    try:
        check_shape = tuple(rescaled.aval().shape)
    except Exception:  # an aval() that cannot run on shape structs: be safe
        return None
    return specs if check_shape == other_shape else None


class _Layout:
    """How a flat list of arguments maps onto Values and arrays."""

    def __init__(self):
        self.entries = []  # (treedef or None, number of flat leaves)

    def add(self, x: Any, spec, leaf_specs: list | None, flat: list, flat_specs: list):
        if leaf_specs is None:
            self.entries.append((None, 1))
            flat.append(x)
            flat_specs.append(spec)
            return
        leaves, treedef = jtu.tree_flatten(x)
        self.entries.append((treedef, len(leaves)))
        flat.extend(leaves)
        flat_specs.extend(leaf_specs)

    def rebuild(self, flat) -> list:
        out, i = [], 0
        for treedef, n in self.entries:
            if treedef is None:
                out.append(flat[i])
            else:
                out.append(jtu.tree_unflatten(treedef, flat[i : i + n]))
            i += n
        return out


def _split(values, specs, mesh, *, inside: bool):
    layout, flat, flat_specs = _Layout(), [], []
    for x, spec in zip(values, specs):
        leaf_specs = None
        if isinstance(x, Value):
            leaf_specs = _leaf_specs(x, spec, mesh, inside=inside)
            if leaf_specs is None:
                x = materialise_value(x, jc.shard_map_p, fallback=True)
        layout.add(x, spec, leaf_specs, flat, flat_specs)
    return layout, flat, tuple(flat_specs)


@register(jc.shard_map_p)
def shard_map_p_values(*args: AnyValue, fun, mesh, in_specs, outer_trace=None, **params):
    """The built-in rule for `shard_map`. Its params are JAX's, plus `fun` (the
    mapped function as JAX hands it to a trace) and `outer_trace` (the
    `QuaxTrace` the `shard_map` was applied in, whose Values the body may
    close over)."""
    hook_params = dict(params, mesh=mesh, in_specs=in_specs)
    in_layout, flat_in, flat_in_specs = _split(args, in_specs, mesh, inside=False)
    found = {}

    def run_user_fun(*inner_args):
        outs, out_specs, rebuild = jc.shard_map_body_outputs(fun, inner_args, hook_params)
        found["out_specs"] = out_specs
        # Keep how to rebuild the hook's result only: the outputs themselves
        # are this trace's tracers.
        found["rebuild"] = rebuild
        return outs

    adopts = () if outer_trace is None else (outer_trace, *outer_trace.adopts)

    def body(*flat_local):
        inner_args = in_layout.rebuild(list(flat_local))
        outs = lifted_call(run_user_fun, *inner_args, adopts=adopts)
        out_layout, flat_out, flat_out_specs = _split(outs, found["out_specs"], mesh, inside=True)
        found["out_layout"] = out_layout
        found["flat_out_specs"] = flat_out_specs
        return flat_out

    flat_result = jc.bind_shard_map(
        body,
        flat_in,
        flat_in_specs,
        lambda: found["flat_out_specs"],
        hook_params,
        renamed=len(flat_in) != len(args),
    )
    outs = found["out_layout"].rebuild(flat_result)
    return found["rebuild"](outs)


@register(jc.pvary_p)
def pvary_p_value(*xs: AnyValue, axes, **params):
    """Inside a `shard_map` body, JAX marks an invariant operand as varying
    (`pvary`) before mixing it with varying ones. That changes no numbers, so a
    Value is marked leaf by leaf and keeps its type. (`pvary` takes several
    operands, and returns a list, up to jax 0.9; one from 0.10.)"""

    def mark(leaf):
        if not eqx.is_array(leaf):
            return leaf
        missing = tuple(a for a in axes if a not in jc.varying_axes(jax.typeof(leaf)))
        if not missing:
            return leaf
        out = jc.pvary_p.bind(leaf, axes=missing, **params)
        return out[0] if jc.pvary_p.multiple_results else out

    outs = [jtu.tree_map(mark, x) for x in xs]
    return outs if jc.pvary_p.multiple_results else outs[0]


def _leaf_by_leaf(x: Value, sharding, move):
    """`x` with each leaf given to `move(leaf, leaf_sharding)`: `sharding` with the
    spec the type declares for that leaf (`quaxlike.leaf_specs`), so an
    `NF4Array`'s codes and scales follow the same rows. A spec the leaves cannot
    follow raises `LogicalShardingError`; a sharding without a mesh and spec is
    left to the default (`NotImplemented`: it materialises)."""
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return NotImplemented
    specs = leaf_specs(x, spec, mesh)
    leaves, treedef = jtu.tree_flatten(x)
    flat_specs = jtu.tree_leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    moved = [
        move(leaf, sharding.update(spec=leaf_spec)) for leaf, leaf_spec in zip(leaves, flat_specs)
    ]
    return jtu.tree_unflatten(treedef, moved)


@register(jc.sharding_constraint_p)
def sharding_constraint_p_value(x: Value, *, sharding, **params):
    """`lax.with_sharding_constraint` on a Value: each leaf is constrained as the
    type declares for the array's spec (`_leaf_by_leaf`)."""
    return _leaf_by_leaf(x, sharding, jax.lax.with_sharding_constraint)


@register(jc.reshard_p)
def reshard_p_value(x: Value, *, dst_sharding, **params):
    """`jax.sharding.reshard` of a Value (mesh axes that are `Explicit`): each leaf
    is moved as the type declares for the array's spec (`_leaf_by_leaf`)."""

    def move(leaf, leaf_sharding):
        return jc.reshard_p.bind(leaf, dst_sharding=leaf_sharding, **params)

    return _leaf_by_leaf(x, dst_sharding, move)


@register(jax.lax.optimization_barrier_p, precedence=-1)
def optimization_barrier_p_values(*args: AnyValue, **params):
    """`lax.optimization_barrier` over Values: one barrier over every array leaf
    of every operand, each Value rebuilt with its own type (a barrier changes no
    numbers). Types with a rule of their own keep it (this one has the lowest
    precedence). `quaxlike.sharding.gathered` puts a layer's weights
    behind one, so that XLA gathers each stored leaf of the layer, not the
    stack it was sliced from."""
    leaves, treedef = jtu.tree_flatten(list(args))
    return jtu.tree_unflatten(treedef, list(jax.lax.optimization_barrier(leaves)))
