"""`shard_map` and the varying manual axes of its bodies: how the hook protocol
and the avals changed between releases (see README.md)."""

from collections.abc import Callable
from typing import Any

import jax

from ._primitives import shard_map_p
from ._probing import _api_util, _core, _first, _lu, _module, missing
from ._trace_api import ShapedArray, Tracer, tracking_varying_axes


# --- shard_map -----------------------------------------------------------------

_flattree = _module("jax._src.flattree")
FlatTree: Any = _first((_flattree, "FlatTree"), (_module("jax._src.tree_util"), "FlatTree"))
# Building one from a list: a classmethod `FlatTree.flatten` (jax 0.8 to 0.10),
# a function `jax._src.flattree.flatten` (0.11+).
_flatten_to_flat_tree = _first((FlatTree, "flatten"), (_flattree, "flatten"))


def _takes_subfuns_param(primitive_class) -> bool:
    # From jax 0.9 `shard_map_p.bind_with_trace` takes the body from
    # `params["subfuns"]`, and the body returns a FlatTree; before, the body is
    # the first operand, a `WrappedFun` returning a flat list.
    code = getattr(getattr(primitive_class, "bind_with_trace", None), "__code__", None)
    return code is not None and "subfuns" in code.co_consts + code.co_names + code.co_varnames


SHARD_MAP_RETURNS_FLAT_TREE = _takes_subfuns_param(type(shard_map_p))


def shard_map_body_outputs(
    fun, args, params, *, flat_tree: bool = SHARD_MAP_RETURNS_FLAT_TREE
) -> tuple[list, tuple, Callable[[list], Any]]:
    """Run a `shard_map` body as JAX hands it to a trace hook (with the hook's
    `params`): its flat outputs, their flat out specs, and a function turning
    a list of outputs into what the hook returns (a `FlatTree` like the body's,
    or a list). `flat_tree` says which protocol (see the inventory)."""
    if flat_tree:
        outs, out_specs = fun(*args).unpack_aux()
        # The structure only, not the outputs (tracers that must not outlive
        # their trace).
        template = outs.map(lambda _: None)
        return list(outs.vals), tuple(out_specs), template.update
    outs = list(fun.call_wrapped(*args))
    return outs, tuple(params["out_specs_thunk"]()), list


def map_shard_map_result(result, fn: Callable[[Any], Any]):
    """Apply `fn` to each output in what a `shard_map` hook returns."""
    if isinstance(result, (list, tuple)):
        return [fn(x) for x in result]
    return result.map(fn)


def bind_shard_map(
    body, flat_args, flat_in_specs, flat_out_specs_of, hook_params, *, renamed: bool
):
    """Bind `shard_map_p` on `flat_args` with `body` (a function of per-device
    arrays returning a flat list) and the hook's own `params`, whatever this
    JAX's protocol. `flat_out_specs_of()` gives the body's flat out specs once
    the body has been traced; `renamed` says the arguments no longer match the
    user's (so their names in JAX's debug information are dropped). Returns
    the flat outputs."""
    params: dict[str, Any] = dict(hook_params, in_specs=tuple(flat_in_specs))
    if SHARD_MAP_RETURNS_FLAT_TREE:
        if _flatten_to_flat_tree is None:
            raise missing("a way to build a FlatTree", "shard_map over Values")

        def flat_tree_body(*xs):
            return _flatten_to_flat_tree(body(*xs)).with_aux(tuple(flat_out_specs_of()))

        debug_info = params.get("debug_info")
        if renamed and hasattr(debug_info, "with_unknown_names"):
            params["debug_info"] = debug_info.with_unknown_names()  # pyright: ignore
        return list(shard_map_p.bind(*flat_args, subfuns=(flat_tree_body,), **params).vals)
    if _lu is None or _api_util is None:
        raise missing("jax._src.linear_util.wrap_init", "shard_map over Values")
    debug_info = _api_util.debug_info("shard_map", body, flat_args, {})
    wrapped = _lu.wrap_init(body, debug_info=debug_info)
    params["out_specs_thunk"] = lambda: tuple(flat_out_specs_of())
    return list(shard_map_p.bind(wrapped, *flat_args, **params))


def varying_axes(aval) -> frozenset:
    """The manual mesh axes over which `aval` varies inside a `shard_map` body
    (`aval.mat.varying` from jax 0.10, `aval.vma` before)."""
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


_ManualAxisType = _first((_core, "ManualAxisType"))


def with_varying_axes(aval, axes: frozenset):
    """`aval`, marked as varying over the manual mesh axes `axes` (with the
    current abstract mesh as its sharding's mesh, which JAX checks them against)."""
    sharding = jax.sharding.NamedSharding(
        jax.sharding.get_abstract_mesh(), jax.sharding.PartitionSpec(*[None] * aval.ndim)
    )
    if _ManualAxisType is not None:
        return aval.update(sharding=sharding, manual_axis_type=_ManualAxisType(varying=axes))
    return aval.update(sharding=sharding, vma=axes)


def with_varying_axes_of(aval, leaves):
    """Inside a `shard_map` body with `check_vma=True`, JAX tracks over which
    manual mesh axes each array varies (`float32[2]{V:x}`) and inserts `pvary`
    where an operation mixes varying and invariant operands. A Value's `aval()`
    knows nothing of that, so give it the union of its array leaves' varying
    axes; otherwise user code would skip the `pvary` and the rule's own
    operations would fail JAX's check. Outside such a body: `aval` unchanged.
    """
    if not tracking_varying_axes() or not isinstance(aval, ShapedArray):
        return aval
    varying: frozenset = frozenset()
    for leaf in leaves:
        leaf_aval = getattr(leaf, "aval", None) if isinstance(leaf, Tracer) else None
        if isinstance(leaf_aval, ShapedArray):
            varying |= varying_axes(leaf_aval)
    if not varying or varying == varying_axes(aval):
        return aval
    return with_varying_axes(aval, varying)
