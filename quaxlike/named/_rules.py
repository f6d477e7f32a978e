"""Rules for `NamedArray`: every result carries the names of the axes it came from.

A plain array operand counts as having no names (all `None`). Each rule works
out the result's names statically, binds the primitive on the plain arrays, and
wraps the result again; a result with no names left comes back as a plain array,
except a full contraction of two NamedArrays, which is a NamedArray with no axes
(as in Quax). A result allows materialisation only if every `NamedArray` operand
did.
"""

import jax.extend.core as jex_core
from jax import lax
from jaxtyping import Array, ArrayLike

import quaxlike
from quaxlike.internal import TRANSCENDENTAL_PRIMITIVES

from ._value import AxisName, NamedArray, NamedAxisError, NamedContractionError


_MISMATCH_MSG = (
    "`{primitive}`: cannot combine NamedArrays with axes {left} and {right}: {detail}. "
    "Operands are matched axis by axis; an unnamed axis (None) matches any name, and "
    "the same names in another order are transposed to match. Ways out: if two "
    "names mean the same axis, rename one (`rename(y, {{{right_name!r}: "
    "{left_name!r}}})`); if a lower-rank operand was broadcast against the wrong "
    "axis (NumPy lines up trailing axes), insert its missing axis where it belongs "
    "(`v[:, None]`); to reorder the axes, use `align(y, {left})` outside quaxify; "
    "to skip the check, pass the plain array (`y.array`)."
)
_CONTRACT_MSG = (
    "Cannot {verb} mismatched dimensions in `dot_general`: it {verbs} axis "
    "{left_name!r} (position {i} of the left operand, axes {left}) with axis "
    "{right_name!r} (position {j} of the right operand, axes {right}); {kind} axes "
    "must have the same name. If they are the same axis, "
    "rename one (`rename(w, {{{right_name!r}: {left_name!r}}})`). If you meant to "
    "contract the axes called {left_name!r}, use `dot(x, w, {left_name!r})` outside "
    "quaxify, or move that axis to where it is contracted{align_hint}."
)
_PAIRING_MSG = (
    "`dot_general` pairs the contracted and the batch axes of its operands one to "
    "one, but its dimension_numbers {dimension_numbers} pair {lc} of the left "
    "operand with {rc} of the right (contracted), and {lb} with {rb} (batch). Give "
    "both operands the same number of axes of each kind (`lax.dot_general` checks "
    "this; binding `dot_general_p` directly does not)."
)
_DUPLICATE_RESULT_MSG = (
    "`{primitive}`: the result would have two axes named {name!r} (its axes would be "
    "{axes}), from operands with axes {left} and {right}. If both are the same "
    "axis, make it a batch axis: `dot(x, w, axis)` outside quaxify treats shared "
    "names that way. Otherwise rename one of them with `rename`."
)


def _axes_of(x) -> tuple[AxisName, ...]:
    if isinstance(x, NamedArray):
        return x.axes
    return (None,) * len(getattr(x, "shape", ()))


def _array_of(x):
    return x.array if isinstance(x, NamedArray) else x


def _wrap(array: Array, axes, *sources) -> Array | NamedArray:
    """`array` with the names `axes`; plain if none is left. It allows
    materialisation if every `NamedArray` among `sources` (the operands) did."""
    axes = tuple(axes)
    if all(name is None for name in axes) or len(axes) != array.ndim:
        return array
    allow = all(x.allow_materialise for x in sources if isinstance(x, NamedArray))
    return NamedArray(array, axes, allow)


def _is_named(x) -> bool:
    return isinstance(x, NamedArray) and any(name is not None for name in x.axes)


def _merge_positionally(ref: list, axes: tuple) -> list | None:
    """Merge two name lists axis by axis; None if two different names meet or a
    name would appear twice."""
    merged = []
    for a, b in zip(ref, axes):
        if a is not None and b is not None and a != b:
            return None
        merged.append(a if a is not None else b)
    named = [name for name in merged if name is not None]
    return merged if len(named) == len(set(named)) else None


def _mismatch_detail(ref, axes) -> tuple[str, AxisName, AxisName]:
    for i, (a, b) in enumerate(zip(ref, axes)):
        if a is not None and b is not None and a != b:
            return f"position {i} is {a!r} in one and {b!r} in the other", a, b
    for name in ref:
        if name is not None and name in axes:
            i, j = ref.index(name), axes.index(name)
            if i != j:
                return f"{name!r} is at position {i} in one and {j} in the other", name, name
    return f"they have {len(ref)} and {len(axes)} axes", None, None


def align_operands(primitive, args, *, allow_transpose: bool = True):
    """The result names and the plain arrays (transposed where needed) for an
    operation that matches its operands axis by axis."""
    ref: list | None = None
    arrays = []
    for arg in args:
        if not _is_named(arg):
            arrays.append(_array_of(arg))
            continue
        axes = arg.axes
        if ref is None:
            ref = list(axes)
            arrays.append(arg.array)
            continue
        merged = _merge_positionally(ref, axes) if len(axes) == len(ref) else None
        if merged is not None:
            ref = merged
            arrays.append(arg.array)
        elif allow_transpose and None not in ref and None not in axes and set(ref) == set(axes):
            arrays.append(lax.transpose(arg.array, [axes.index(name) for name in ref]))
        else:
            detail, left_name, right_name = _mismatch_detail(ref, axes)
            raise NamedAxisError(
                _MISMATCH_MSG.format(
                    primitive=primitive.name,
                    left=tuple(ref),
                    right=axes,
                    detail=detail,
                    left_name=left_name,
                    right_name=right_name,
                )
            )
    # No operand had a name (every NamedArray was all-None): a plain result.
    return (ref if ref is not None else []), arrays


# --- elementwise -------------------------------------------------------------

_UNARY = [
    *TRANSCENDENTAL_PRIMITIVES,
    lax.abs_p, lax.bessel_i0e_p, lax.bessel_i1e_p, lax.cbrt_p, lax.ceil_p, lax.clz_p,
    lax.conj_p, lax.convert_element_type_p, lax.copy_p, lax.cumlogsumexp_p,
    lax.cummax_p, lax.cummin_p, lax.cumprod_p, lax.cumsum_p, lax.floor_p, lax.imag_p,
    lax.integer_pow_p, lax.is_finite_p, lax.neg_p, lax.not_p, lax.population_count_p,
    lax.real_p, lax.reduce_precision_p, lax.rev_p, lax.round_p, lax.rsqrt_p, lax.sign_p,
    lax.slice_p, lax.sqrt_p, lax.square_p, lax.stop_gradient_p,
]  # fmt: skip

_NARY = [
    lax.add_p, jex_core.primitives.add_jaxvals_p, lax.sub_p, lax.mul_p, lax.div_p,
    lax.rem_p, lax.pow_p, lax.max_p, lax.min_p, lax.atan2_p, lax.nextafter_p,
    lax.and_p, lax.or_p, lax.xor_p, lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p,
    lax.gt_p, lax.ge_p, lax.select_n_p, lax.clamp_p, lax.complex_p, lax.igamma_p,
    lax.igammac_p, lax.polygamma_p, lax.zeta_p, lax.shift_left_p,
    lax.shift_right_arithmetic_p, lax.shift_right_logical_p,
]  # fmt: skip


def _rule_name(primitive, suffix: str) -> str:
    return f"{primitive.name.replace('-', '_')}_p_{suffix}"


def _make_unary_rule(primitive):
    def rule(x: NamedArray, **params):
        return _wrap(primitive.bind(x.array, **params), x.axes, x)

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "named")
    return rule


def _make_nary_rule(primitive):
    def rule(*args: NamedArray | ArrayLike, **params):
        axes, arrays = align_operands(primitive, args)
        return _wrap(primitive.bind(*arrays, **params), axes, *args)

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "named_any")
    return rule


for _primitive in _UNARY:
    quaxlike.register(_primitive)(_make_unary_rule(_primitive))
for _primitive in _NARY:
    quaxlike.register(_primitive)(_make_nary_rule(_primitive))


@quaxlike.register(lax.pad_p)
def pad_p_named_any(x: NamedArray, padding_value: ArrayLike, **params):
    return _wrap(lax.pad_p.bind(x.array, padding_value, **params), x.axes, x)


@quaxlike.register(lax.dynamic_slice_p)
def dynamic_slice_p_named_any(x: NamedArray, *indices: ArrayLike, **params):
    return _wrap(lax.dynamic_slice_p.bind(x.array, *indices, **params), x.axes, x)


@quaxlike.register(lax.concatenate_p)
def concatenate_p_named_any(*args: NamedArray | ArrayLike, **params):
    # Sizes differ along the joined axis, so names are matched by position only.
    axes, arrays = align_operands(lax.concatenate_p, args, allow_transpose=False)
    return _wrap(lax.concatenate_p.bind(*arrays, **params), axes, *args)


# --- reductions --------------------------------------------------------------


def _make_reduction_rule(primitive):
    def rule(x: NamedArray, *, axes, **params):
        remaining = [name for i, name in enumerate(x.axes) if i not in axes]
        return _wrap(primitive.bind(x.array, axes=axes, **params), remaining, x)

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "named")
    return rule


for _primitive in [
    lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p, lax.reduce_prod_p,
    lax.reduce_and_p, lax.reduce_or_p, lax.reduce_xor_p, lax.argmax_p, lax.argmin_p,
]:  # fmt: skip
    quaxlike.register(_primitive)(_make_reduction_rule(_primitive))


# --- structure ---------------------------------------------------------------


@quaxlike.register(lax.transpose_p)
def transpose_p_named(x: NamedArray, *, permutation, **params):
    out = lax.transpose_p.bind(x.array, permutation=permutation, **params)
    return _wrap(out, [x.axes[i] for i in permutation], x)


@quaxlike.register(lax.broadcast_in_dim_p)
def broadcast_in_dim_p_named(
    x: NamedArray, *dynamic_shape: ArrayLike, shape, broadcast_dimensions, **params
):
    if dynamic_shape:
        return NotImplemented
    out = lax.broadcast_in_dim_p.bind(
        x.array, shape=shape, broadcast_dimensions=broadcast_dimensions, **params
    )
    axes: list[AxisName] = [None] * len(shape)
    for name, dim in zip(x.axes, broadcast_dimensions):
        axes[dim] = name
    return _wrap(out, axes, x)


@quaxlike.register(lax.squeeze_p)
def squeeze_p_named(x: NamedArray, *, dimensions, **params):
    out = lax.squeeze_p.bind(x.array, dimensions=dimensions, **params)
    return _wrap(out, [name for i, name in enumerate(x.axes) if i not in dimensions], x)


@quaxlike.register(lax.reshape_p)
def reshape_p_named(x: NamedArray, *dynamic_shape: ArrayLike, new_sizes, dimensions, **params):
    # Only reshapes that add or drop axes of length 1 keep names; any other
    # reshape has no rule and gives a plain array.
    kept = [(size, name) for size, name in zip(x.array.shape, x.axes) if size != 1]
    if (
        dynamic_shape
        or dimensions is not None
        or [s for s in new_sizes if s != 1] != [s for s, _ in kept]
    ):
        return NotImplemented
    names = iter(name for _, name in kept)
    axes = [None if size == 1 else next(names) for size in new_sizes]
    out = lax.reshape_p.bind(x.array, new_sizes=new_sizes, dimensions=dimensions, **params)
    return _wrap(out, axes, x)


# --- dot_general -------------------------------------------------------------


def _in_range(positions, ndim: int) -> bool:
    return all(0 <= i < ndim for i in positions)


def _align_hint(axes: tuple, name: AxisName, position: int) -> str:
    """`: align(w, ...)` moving `name` to `position` in `axes`, where possible."""
    if name not in axes or None in axes:
        return " (`align`)"
    order = list(axes)
    k = order.index(name)
    order[k], order[position] = order[position], order[k]
    return f": `align(w, {tuple(order)})`"


@quaxlike.register(lax.dot_general_p)
def dot_general_p_named(
    x: NamedArray | ArrayLike, y: NamedArray | ArrayLike, *, dimension_numbers, **params
):
    left, right = _axes_of(x), _axes_of(y)
    (lc, rc), (lb, rb) = dimension_numbers
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            _PAIRING_MSG.format(lc=lc, rc=rc, lb=lb, rb=rb, dimension_numbers=dimension_numbers)
        )
    if not (_in_range((*lc, *lb), len(left)) and _in_range((*rc, *rb), len(right))):
        # No names to read at an axis that does not exist: JAX's own check says
        # what is wrong with the dimension numbers (a `TypeError`, as in Quax).
        return lax.dot_general_p.bind(
            _array_of(x), _array_of(y), dimension_numbers=dimension_numbers, **params
        )
    for verb, verbs, kind, pairs in (
        ("contract", "contracts", "contracted", zip(lc, rc)),
        ("batch", "batches", "batch", zip(lb, rb)),
    ):
        for i, j in pairs:
            a, b = left[i], right[j]
            if a is not None and b is not None and a != b:
                raise NamedContractionError(
                    _CONTRACT_MSG.format(
                        verb=verb,
                        verbs=verbs,
                        left_name=a,
                        right_name=b,
                        i=i,
                        j=j,
                        left=left,
                        right=right,
                        kind=kind,
                        align_hint=_align_hint(right, a, j),
                    )
                )
    batch = [left[i] if left[i] is not None else right[j] for i, j in zip(lb, rb)]
    free_left = [name for i, name in enumerate(left) if i not in lc and i not in lb]
    free_right = [name for j, name in enumerate(right) if j not in rc and j not in rb]
    axes = batch + free_left + free_right
    named = [name for name in axes if name is not None]
    for name in named:
        if named.count(name) > 1:
            raise NamedAxisError(
                _DUPLICATE_RESULT_MSG.format(
                    primitive="dot_general", name=name, axes=tuple(axes), left=left, right=right
                )
            )
    out = lax.dot_general_p.bind(
        _array_of(x), _array_of(y), dimension_numbers=dimension_numbers, **params
    )
    if not axes and isinstance(x, NamedArray) and isinstance(y, NamedArray):
        # A full contraction of two NamedArrays: a NamedArray with no axes, as in
        # Quax (`_wrap` would give a plain scalar).
        return NamedArray(out, (), x.allow_materialise and y.allow_materialise)
    return _wrap(out, axes, x, y)
